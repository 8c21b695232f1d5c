// One voxgate.v1 session (../shared/PROTOCOL.md): sends text, receives binary audio frames and decodes them to
// float samples at OUTPUT_RATE — Opus with WebCodecs' AudioDecoder (the `browser` preset), or PCM (the `pcm` preset,
// asked at OUTPUT_RATE) where the browser has no Opus decoder.
export const OUTPUT_RATE = 48000;
const MODEL_RATE = 24000; // the rate the browser preset's pts and pre_skip count in
const FLAG_FIRST = 1, FLAG_LAST = 2, FLAG_DISCONTINUITY = 4;

export async function opusDecoding() {
  if (typeof AudioDecoder === "undefined") return false;
  try {
    const config = {codec: "opus", sampleRate: MODEL_RATE, numberOfChannels: 1};
    return (await AudioDecoder.isConfigSupported(config)).supported === true;
  } catch {
    return false;
  }
}

export class TtsSession {
  // handlers: onEvent(message), onAudio(contextId, Float32Array), onFrame(contextId, bytes), onEnd(contextId)
  constructor(url, useOpus, handlers) {
    this.useOpus = useOpus;
    this.handlers = handlers;
    this.contexts = new Map(); // stream_id -> {id, decoder, skip, dropped}
    this.byId = new Map();
    const query = useOpus ? "preset=browser" : `preset=pcm&sample_rate=${OUTPUT_RATE}`;
    this.ws = new WebSocket(url + (url.includes("?") ? "&" : "?") + query);
    this.ws.binaryType = "arraybuffer";
    this.started = new Promise((resolve, reject) => {
      this.ws.onerror = () => reject(new Error("the voxgate socket failed"));
      this.ws.onclose = (event) => {
        reject(new Error(`the voxgate socket closed (${event.code} ${event.reason})`));
        this.handlers.onEvent({type: "socket.closed", code: event.code, reason: event.reason});
      };
      this.ws.onmessage = (event) => {
        if (typeof event.data !== "string") return this.frame(event.data);
        const message = JSON.parse(event.data);
        if (message.type === "session.started") {
          this.session = message;
          resolve(message);
        }
        this.message(message);
      };
    });
  }

  send(message) {
    this.ws.send(JSON.stringify(message));
  }

  cancel(contextId, playedMs) {
    const context = this.byId.get(contextId);
    if (context) this.drop(context);
    this.send({type: "context.cancel", context_id: contextId, played_ms: Math.round(playedMs)});
  }

  message(message) {
    if (message.type === "context.started") {
      const context = {id: message.context_id, stream: message.stream_id, decoder: null, skip: 0, dropped: false};
      this.contexts.set(message.stream_id, context);
      this.byId.set(message.context_id, context);
    } else if (message.type === "context.done" || message.type === "context.cancelled") {
      const context = this.byId.get(message.context_id); // no frame of it follows either event
      if (context && message.type === "context.cancelled") this.drop(context);
      if (context) {
        this.contexts.delete(context.stream);
        this.byId.delete(context.id);
      }
    }
    this.handlers.onEvent(message);
  }

  frame(buffer) {
    const view = new DataView(buffer);
    if (buffer.byteLength < 8 || view.getUint8(0) !== 0xa1) return;
    const flags = view.getUint8(1), stream = view.getUint16(2, true), pts = view.getUint32(4, true);
    const context = this.contexts.get(stream);
    if (!context || context.dropped) return; // cancelled: its late frames are never played
    const payload = new Uint8Array(buffer, 8);
    this.handlers.onFrame(context.id, payload.byteLength);
    if (this.useOpus) this.decodeOpus(context, flags, pts, payload);
    else if (payload.byteLength) this.handlers.onAudio(context.id, pcmToFloat(payload));
    if (flags & FLAG_LAST) this.finish(context);
  }

  decodeOpus(context, flags, pts, payload) {
    const preSkip = this.session.audio.pre_skip || 0;
    if (flags & FLAG_FIRST || !context.decoder) {
      context.decoder = new AudioDecoder({
        output: (audio) => this.decoded(context, audio),
        error: (error) => this.handlers.onEvent({type: "error", code: "decode", message: String(error)}),
      });
      context.decoder.configure({codec: "opus", sampleRate: MODEL_RATE, numberOfChannels: 1});
      context.skip = preSkip;
    } else if (flags & FLAG_DISCONTINUITY) {
      context.skip += preSkip; // a fresh encoder: its lookahead again (the decoder goes on, as after a lost packet)
    }
    if (!payload.byteLength) return; // the empty LAST frame carries no audio
    const data = payload.slice(); // the chunk keeps its own copy
    context.decoder.decode(new EncodedAudioChunk({type: "key", timestamp: pts * 1e6 / MODEL_RATE, data}));
  }

  decoded(context, audio) {
    const samples = new Float32Array(audio.numberOfFrames);
    audio.copyTo(samples, {planeIndex: 0, format: "f32-planar"});
    const rate = audio.sampleRate;
    const skip = Math.min(samples.length, Math.round(context.skip * rate / MODEL_RATE));
    context.skip -= skip * MODEL_RATE / rate;
    audio.close();
    if (context.dropped || samples.length <= skip) return;
    const kept = samples.subarray(skip);
    this.handlers.onAudio(context.id, rate === OUTPUT_RATE ? kept.slice() : resample(kept, rate));
  }

  async finish(context) {
    const decoder = context.decoder;
    context.decoder = null;
    if (decoder) {
      await decoder.flush().catch(() => {}); // fails only if a barge-in closed it meanwhile
      if (decoder.state !== "closed") decoder.close();
    }
    if (!context.dropped) this.handlers.onEnd(context.id);
  }

  drop(context) {
    context.dropped = true;
    if (context.decoder) context.decoder.close();
    context.decoder = null;
  }
}

function pcmToFloat(payload) {
  const view = new DataView(payload.buffer, payload.byteOffset, payload.byteLength);
  const samples = new Float32Array(payload.byteLength >> 1);
  for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
  return samples;
}

// Linear interpolation to OUTPUT_RATE, for a browser whose Opus decoder gives another rate (Chrome gives 48 kHz).
function resample(samples, rate) {
  const out = new Float32Array(Math.round(samples.length * OUTPUT_RATE / rate));
  for (let i = 0; i < out.length; i++) {
    const x = i * rate / OUTPUT_RATE, k = Math.floor(x), t = x - k;
    out[i] = samples[k] * (1 - t) + (samples[Math.min(k + 1, samples.length - 1)] * t);
  }
  return out;
}
