// The voice-chat page: type a message, read the LLM's answer as it streams, hear it spoken while it is written.
import {ChatSocket} from "./chat.js";
import {Player} from "./player.js";
import {OUTPUT_RATE, TtsSession, opusDecoding} from "./tts-session.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const token = params.get("token");
const wsBase = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}`;
const MAX_HISTORY = 20;

// Everything the page measures, also read by the end-to-end test.
const demo = window.voxgateDemo = {
  ready: false, format: null, llm: null, sessionId: null, frames: 0, bytes: 0, decodedSamples: 0, played: 0,
  underruns: 0, bufferedMs: 0, ttfaMs: null, serverTtfaMs: null, turnsCancelled: 0, cancelAcks: 0, errors: [],
};
const history = [];
let player, tts, chat;
let turn = null; // the latest message's answer: {id, sentAt, playedAtStart, bubble, stopped, done, ...}
const turnsById = new Map();
let turns = 0;

function withToken(url) {
  return token ? `${url}${url.includes("?") ? "&" : "?"}token=${encodeURIComponent(token)}` : url;
}

async function main() {
  try {
    const response = await fetch(withToken("/v1/voices"));
    if (!response.ok) throw new Error(`GET /v1/voices: HTTP ${response.status}`);
    fillVoices(await response.json());
    const useOpus = params.get("format") !== "pcm" && await opusDecoding();
    demo.format = useOpus ? "opus" : "pcm";
    player = new Player(OUTPUT_RATE);
    await player.start();
    player.onStats = showStats;
    tts = new TtsSession(withToken(`${wsBase}/v1/tts/stream`), useOpus, {onEvent, onAudio, onFrame, onEnd});
    const started = await tts.started;
    demo.sessionId = started.session_id;
    // the page may be silent for long between messages: keep the session from timing out
    setInterval(() => tts.send({type: "keepalive"}), started.limits.idle_timeout_s * 1000 / 3);
    chat = new ChatSocket(withToken(`${wsBase}/v1/chat`), {onDelta, onDone, onError: (m) => showError(m)});
    demo.llm = (await chat.ready).llm;
    $("note").textContent = demo.llm
      ? `Answers come from ${demo.llm.model} and are spoken while they are written.`
      : "No LLM is configured (start voxgate serve with --llm-url and --llm-model): the page speaks what you type.";
    $("format").textContent = useOpus ? "Opus (WebCodecs)" : "PCM (no WebCodecs Opus here)";
    $("send").disabled = $("stop").disabled = false;
    demo.ready = true;
    setStatus("ready");
  } catch (error) {
    showError({code: "startup", message: error.message});
  }
}

function fillVoices(catalog) {
  const voice = $("voice"), language = $("language");
  for (const v of catalog.voices) voice.add(new Option(`${v.id} (${v.variant})`, v.id, false, v.id === catalog.default));
  const languages = () => {
    const chosen = catalog.voices.find((v) => v.id === voice.value);
    language.replaceChildren(...["auto", ...(chosen?.languages || [])].map((l) => new Option(l, l)));
    const instructions = $("instructions");
    instructions.disabled = chosen?.instructions === false; // this voice takes none
    if (instructions.disabled) instructions.value = "";
    if (chosen?.instructions === "required" && !instructions.value) instructions.value = "A clear, friendly voice.";
  };
  voice.onchange = languages;
  languages();
}

async function send(text) {
  await player.resume(); // the click lets audio start
  bargeIn();
  const id = `turn-${++turns}`;
  addBubble("user", text);
  turn = {id, sentAt: performance.now(), playedAtStart: demo.played, bubble: addBubble("assistant", ""),
          stopped: false, done: false, chatDone: !demo.llm, recorded: !demo.llm, firstAudio: false};
  turnsById.set(id, turn);
  history.push({role: "user", content: text});
  const voice = {voice: $("voice").value, language: $("language").value};
  const instructions = $("instructions").value.trim();
  if (instructions) voice.instructions = instructions;
  if (demo.llm) {
    chat.request({id, session_id: demo.sessionId, context_id: id, messages: history.slice(-MAX_HISTORY), ...voice});
  } else {
    turn.bubble.textContent = text;
    tts.send({type: "text.append", context_id: id, text, ...voice});
    tts.send({type: "context.end", context_id: id});
  }
  setStatus("speaking");
}

// Barge-in: silence now, then cancel the speech (telling the server how much was heard) and the LLM.
function bargeIn() {
  if (!turn || turn.stopped) return;
  turn.stopped = true;
  if (turn.done && !player.stats.playing && player.stats.buffered === 0) return; // it had finished: nothing to stop
  player.clear();
  tts.cancel(turn.id, (demo.played - turn.playedAtStart) / OUTPUT_RATE * 1000);
  if (!turn.chatDone) chat.cancel(turn.id);
  remember(turn, turn.bubble.textContent); // the history holds what was shown up to the barge-in
  demo.turnsCancelled += 1;
  setStatus("stopped");
}

function onDelta(id, text) {
  if (turn && turn.id === id) turn.bubble.textContent += text;
}

function onDone(id, text, reason) {
  if (!turn || turn.id !== id) return; // a reply that was barged in on is already in the history
  turn.chatDone = true;
  remember(turn, text);
  if (reason === "error") setStatus("the LLM failed");
}

function remember(answered, text) {
  if (answered.recorded) return;
  answered.recorded = true;
  answered.entry = {role: "assistant", content: text};
  if (text) history.push(answered.entry);
}

// A barged-in answer enters the history as far as it was heard (the server's estimate from played_ms).
function rememberHeard(contextId, heardText) {
  const answered = turnsById.get(contextId);
  turnsById.delete(contextId);
  if (!answered?.entry || heardText === undefined || !demo.llm) return;
  answered.entry.content = heardText ? `${heardText}…` : "…";
}

function onFrame(contextId, bytes) {
  demo.frames += 1;
  demo.bytes += bytes;
  if (turn && turn.id === contextId && !turn.firstAudio) {
    turn.firstAudio = true;
    demo.ttfaMs = Math.round(performance.now() - turn.sentAt);
  }
  showStats();
}

function onAudio(contextId, samples) {
  if (!turn || turn.id !== contextId || turn.stopped) return;
  demo.decodedSamples += samples.length;
  player.push(samples);
}

function onEnd(contextId) {
  if (turn && turn.id === contextId) player.end();
}

function onEvent(message) {
  if (message.type === "context.done") {
    demo.serverTtfaMs = message.metrics?.ttfa_ms ?? null;
    turnsById.delete(message.context_id);
    if (turn && turn.id === message.context_id) {
      turn.done = true;
      setStatus("done");
    }
  } else if (message.type === "context.cancelled") {
    demo.cancelAcks += 1;
    rememberHeard(message.context_id, message.heard_text);
  } else if (message.type === "error" || message.type === "warning") {
    showError(message);
  } else if (message.type === "socket.closed") {
    showError({code: "closed", message: `the voxgate socket closed (${message.code})`});
    $("send").disabled = true;
  }
  showStats();
}

function showStats(stats) {
  if (stats) {
    demo.played = stats.played;
    demo.underruns = stats.underruns;
    demo.bufferedMs = player.bufferedMs;
  }
  const seconds = demo.decodedSamples / OUTPUT_RATE;
  $("ttfa").textContent = demo.ttfaMs === null ? "–" : `${demo.ttfaMs} ms`;
  $("server-ttfa").textContent = demo.serverTtfaMs === null ? "–" : `${demo.serverTtfaMs} ms`;
  $("underruns").textContent = String(demo.underruns);
  $("buffered").textContent = `${Math.round(demo.bufferedMs)} ms`;
  $("bitrate").textContent = seconds > 0 ? `${(demo.bytes * 8 / seconds / 1000).toFixed(1)} kbit/s` : "–";
  $("played").textContent = `${(demo.played / OUTPUT_RATE).toFixed(2)} s`;
  $("frames").textContent = String(demo.frames);
}

function addBubble(role, text) {
  const bubble = document.createElement("div");
  bubble.className = `bubble ${role}`;
  bubble.textContent = text;
  $("log").append(bubble);
  bubble.scrollIntoView({block: "end"});
  return bubble;
}

function setStatus(text) {
  $("status").textContent = text;
}

function showError(message) {
  demo.errors.push(message);
  setStatus(`${message.code}: ${message.message}`);
}

$("form").onsubmit = (event) => {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text || !demo.ready) return;
  $("message").value = "";
  send(text);
};
$("stop").onclick = bargeIn;
main();
