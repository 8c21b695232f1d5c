"""The gateway's shared state: the model and its engine (loaded and warmed up in the background so that /health
answers at once and /ready turns 200 only when synthesis works), the voices, limits, metrics and open sessions.

When the engine fails (a device fault, a stalled step) its open requests end with `EngineFailed` and the gateway
starts a new engine, once: /ready answers 503 meanwhile. If that fails too, or the new engine fails again soon, the
gateway has failed for good: readiness and health turn false and `on_fatal` lets the server drain and exit."""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.checkpoint import checkpoint_fingerprint
from engine.config import load_model_config
from engine.core.engine import Engine, EngineConfig
from engine.errors import EngineFailed, VoxgateError
from engine.model_source import is_hub_id, official_hub_id, resolve_model
from engine.prompt import Voice
from engine.request import Finished, SynthesisRequest, SyntheticLength, check_frames_per_token
from engine.sampling import SamplingParams
from engine.serving.async_engine import AsyncEngine
from engine.serving.heap import SERVING_THRESHOLDS, freeze_long_lived, thaw
from engine.serving.process_engine import EngineSpec, ProcessEngine
from engine.tts import TTSModel
from realtime.audio.encoder_pool import EncoderPool
from realtime.audio.ffmpeg import use_one_thread
from realtime.auth import same_key
from realtime.lexicon import Lexicon, LexiconStore
from realtime.lexicons_http import HTTP_RULES_RATE
from realtime.llm import LLMConfig
from realtime.metrics import Metrics
from realtime.voice_library import UPLOAD_VARIANTS, VoiceLibrary
from realtime.voice_store import VoiceStore, check_data_dir
from realtime.voices import CloneVoice, VoiceCatalog
from realtime.ws.protocol import Sampling
from realtime.ws.rate_limit import RateLimiter
from realtime.ws.speech_context import ReadAhead, ShuttingDown, SpeechContext
from realtime.ws.utterances import UtterancePlanner

log = logging.getLogger("voxgate")
STALLED_STEP_S = 30.0  # a step running longer than this means the device hangs: the engine is restarted
WATCHDOG_INTERVAL_S = 1.0  # how often the watchdog looks for a stalled step
REFAIL_WINDOW_S = 60.0  # an engine that fails again this soon after its restart has failed for good
RESTART_TIMEOUT_S = 300.0  # for each of building and warming up a new engine
# Engine slots on a GPU: as many KV slots of the engine's context as GPU_KV_MEMORY_SHARE of the free memory holds once
# the model is loaded, less whatever would leave under GPU_ENGINE_RESERVE free (the codec decoder's graphs and states,
# the step's graphs, eager decodes, voice-clone encodes), rounded down to a graph bucket, up to the largest. An H100
# with the 1.7B model: 56 GiB, 256 slots of 2,048 positions (the rest of the engine ~7 GiB: `scripts/gpu_memory.py`;
# 73.4 of 81.6 GB in use under load); at 256 slots the 256-session start burst and the stress load fared better than
# at 192 (docs/benchmarks.md, "256 slots").
GPU_KV_MEMORY_SHARE = 0.85
GPU_ENGINE_RESERVE = 12 * 2 ** 30
GPU_MAX_SLOTS = 256
# Scheduling on a GPU: chunks sized by each stream's buffer, every ready request admitted. `protect` (prefills held
# while a running stream's buffer is thin) made 256 sessions opened at once wait 1.6-2.3x longer for their first audio
# and bought no smoothness once a step's first chunks were decoded first; tts_bench at 60 req/s has no underrun with
# either (docs/benchmarks.md, "A burst of sessions"). On the CPU, where the tiny model runs slower than real time and
# every buffer is thin, the fixed schedule stays.
GPU_SCHEDULING = ("lead", "all")
# On a GPU a step of more than this many requests is busy: a new HTTP stream's first chunk waits for a second frame
# (160 ms of audio instead of 80 before its next chunk must be read; engine/core/decoding.py, `first_chunk`). Light
# load keeps the one-frame start (time to first audio), and so do WebSocket contexts (their players buffer); under
# tts_bench at 60-100 req/s the one-frame starts were where every underrun came (docs/benchmarks.md, "A busy
# engine's first chunks").
GPU_BUSY_BATCH = 32
# On a GPU, while more than GPU_BUSY_BATCH requests run and none waits for a slot, a WebSocket context whose audio
# is this far ahead of its client's playback holds: in a burst of 256 sessions the engine made their audio ~7x
# faster than real time and the gateway's one loop, busy encoding and sending it, delayed newcomers' first audio
# (all-context TTFA p95 pooled over a server's bursts: 58.6 ms without, 38.6 with it on one H200, 56.8 and 42.2 on
# another; docs/benchmarks.md, "The lead target on a busy GPU").
GPU_LEAD_TARGET_S = 1.0
SHUTTING_DOWN = "the server is shutting down; retry the request"  # to the requests it refuses or ends then
# Sessions, unless --max-sessions says: one per engine slot, at least MIN_SESSIONS (the CPU's 8 slots keep 64). A
# session speaks one context at a time in practice (it may open max_contexts, each one utterance at a time), so every
# session can speak at once without waiting for a slot; one more would wait seconds, for a slot to free, for its
# first audio, where a refusal at connect lets the client go elsewhere.
MIN_SESSIONS = 64


@dataclass(frozen=True)
class Limits:
    """Every limit has a default; `voxgate serve --help` documents them."""
    max_sessions: int | None = None  # open WebSocket sessions; None: for the engine's slots (`for_slots`)
    max_contexts: int = 8  # open contexts per session
    max_text_chars: int = 20000  # per context
    max_message_bytes: int = 256 * 1024
    idle_timeout_s: float = 120.0
    send_queue_ms: int = 5000  # audio queued for a session before its synthesis pauses (slow consumer)
    max_message_rate: float = 200.0  # client messages per second per session (bursts of twice that)
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    handshake_timeout_s: float = 5.0  # a request's headers (a WebSocket handshake's too) must arrive within this
    max_connections: int | None = None  # open TCP connections, HTTP and WebSocket; None: 2 * max_sessions + 64
    max_voice_upload_bytes: int = 16 * 1024 * 1024  # a POST /v1/audio/voices body
    max_stored_voices: int = 1000  # the library's voices per checkpoint
    max_sessions_per_key: int | None = None  # one API key's open sessions; None: max_sessions alone

    @property
    def connection_cap(self) -> int:
        """Room for every session plus its HTTP traffic, so that the cap only bites on connections nobody uses."""
        return self.max_connections if self.max_connections is not None else 2 * self.max_sessions + 64

    def for_slots(self, slots: int) -> Limits:
        """These limits with the session limit filled in for an engine of `slots` (MIN_SESSIONS says why), below an
        explicit connection cap (which the command line checks is above MIN_SESSIONS)."""
        if self.max_sessions is not None:
            return self
        sessions = max(MIN_SESSIONS, slots)
        if self.max_connections is not None:
            sessions = min(sessions, self.max_connections - 1)
        return replace(self, max_sessions=sessions)


@dataclass(frozen=True)
class GatewayOptions:
    model: str | Path | None = None  # a checkpoint directory or a hub id; None: the embedded tiny model
    device: str = "cpu"
    clone_voices: tuple[CloneVoice, ...] = ()
    limits: Limits = field(default_factory=Limits)
    max_batch: int | None = None  # engine slots; None: sized by the GPU's free memory (_engine_config), 8 on the CPU
    clean_text: bool = True  # LLM output: markdown and emoji are not read out
    llm: LLMConfig | None = None  # the chat endpoint's LLM (/v1/chat); None: the demo speaks what the user types
    dtype: str = "auto"  # "auto": bfloat16 on a GPU, float32 on the CPU
    engine_process: bool | None = None  # the engine in a child process; None: on a GPU
    engine_setup: Callable[[Engine], None] | None = None  # run on each engine built (EngineSpec.setup): test faults
    synthetic_frames_per_token: float | None = None  # benchmark-only, random-weight checkpoints (EngineConfig)
    openai_voices: tuple[tuple[str, str], ...] = ()  # (OpenAI voice name, the model's voice): --openai-voice
    data_dir: Path | None = None  # the voice library's directory; None: voices uploaded are kept in memory only
    chunk_schedule: str | None = None  # EngineConfig's: "fixed" | "lead"; None: GPU_SCHEDULING on a GPU, else fixed
    admission: str | None = None  # EngineConfig's: "all" | "protect"; None: GPU_SCHEDULING on a GPU, else all
    busy_batch: int | None = None  # EngineConfig's; None: GPU_BUSY_BATCH on a GPU, none on the CPU
    lead_target_s: float | None = None  # EngineConfig's; None: GPU_LEAD_TARGET_S on a GPU, none on the CPU; 0: none
    encoder_workers: int | None = None  # audio encoder processes; None: half the cores, 1 to 8 (encoder_pool.py)


def check_options(options: GatewayOptions) -> None:
    """What can be told before serving anything: the model exists and the device does, a synthetic length goes with
    a random-weight checkpoint, the data directory can be written; raises VoxgateError with one line naming the problem (a checkpoint that is there but
    cannot load fails the start-up, which exits)."""
    model_dir = resolve_model(options.model)[0] if options.model is not None else None
    if options.synthetic_frames_per_token is not None:
        _check_synthetic_length(options.synthetic_frames_per_token, model_dir)
    if options.data_dir is not None:
        check_data_dir(options.data_dir)
    try:
        device = torch.device(options.device)
    except RuntimeError:
        raise VoxgateError(f"--device {options.device!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise VoxgateError(f"--device {options.device}: no such CUDA device (this machine has {count})")
    elif device.type != "cpu":
        raise VoxgateError(f"--device {options.device}: only cpu and cuda devices are served")


def _check_synthetic_length(frames_per_token: float, model_dir: Path | None) -> None:
    """Benchmark-only: refused for a checkpoint not marked as random weights, so that it never cuts real speech (the
    embedded tiny model, `model_dir` None, is random; the engine checks it again when it is built)."""
    option = "--synthetic-frames-per-token"
    check_frames_per_token(frames_per_token, option)
    if model_dir is not None:
        SyntheticLength.for_model(frames_per_token, load_model_config(model_dir), str(model_dir), option)


class Gateway:
    def __init__(self, options: GatewayOptions) -> None:
        self.options = options
        self.limits = options.limits.for_slots(0)  # until the engine is built: sessions wait for /ready anyway
        self.metrics = Metrics()
        self.state = "loading"
        self.failure: str | None = None
        self.tts: TTSModel | None = None
        self._model_name = "loading"
        self.hub_id: str | None = None  # the hub id the model came from, or its official one; None: not known
        self.voices: VoiceCatalog | None = None
        self.library: VoiceLibrary | None = None
        self.engine: AsyncEngine | ProcessEngine | None = None
        self.encoders = EncoderPool(options.encoder_workers)  # the sockets' audio encoding, in processes of its own
        self.sessions: set = set()
        # the speech endpoint's requests (`start_speech`); each leaves the set once its response is gone
        self.http_speech: weakref.WeakSet[SpeechContext] = weakref.WeakSet()
        self.chats: set = set()  # the open `/v1/chat` sockets (ChatSocket; at most max_sessions)
        self.lexicons = LexiconStore()  # named pronunciation lexicons, in memory
        self.http_lexicon_rules = RateLimiter(HTTP_RULES_RATE)  # the rules HTTP requests may have compiled
        self.shutting_down = False
        self.on_fatal: Callable[[str], None] | None = None  # the gateway failed for good (the server exits)
        self._restarted_at: float | None = None  # when the engine was last restarted
        self.loaded_at = 0  # Unix time the model was loaded (OpenAI's `created` of GET /v1/models)
        self._tasks: set[asyncio.Task] = set()  # the watchdog, a restart
        self.metrics.sessions_active.set_function(lambda: len(self.sessions))
        self.metrics.engine_requests_active.set_function(lambda: self.engine.active if self.engine else 0)
        self.metrics.engine_queue_depth.set_function(
            lambda: self.engine.waiting if self.engine else 0)

    def session(self, session_id: str):
        """The open voxgate.v1 session with this id, or None."""
        return next((session for session in self.sessions if session.id == session_id), None)

    def sessions_of(self, key: str | None) -> int:
        """The open sessions opened with this API key (`--max-sessions-per-key`)."""
        return sum(1 for session in self.sessions if same_key(session.owner, key))

    def chat_sockets_of(self, key: str | None) -> int:
        """The open `/v1/chat` sockets opened with this API key (`--max-sessions-per-key`)."""
        return sum(1 for chat in self.chats if same_key(chat.owner, key))

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """What a request's `model` may name to mean this model: the announced name and the hub id, where known."""
        return tuple(dict.fromkeys(name for name in (self._model_name, self.hub_id) if name))

    async def start(self) -> None:
        """Load, build the engine, warm up; a failure is fatal (`on_fatal`), never raised into the server."""
        try:
            started = time.perf_counter()
            log.info("loading the model from %s on %s", self.options.model or "the embedded tiny model",
                     self.options.device)
            await self.encoders.start()
            use_one_thread()  # FFmpeg's graphs and codecs (realtime/audio/ffmpeg.py)
            self.tts, self.voices, self.library = await asyncio.to_thread(self._load)
            self.loaded_at = int(time.time())
            log.info("model %s (%s) loaded in %.1f s; building the engine", self.model_name,
                     self.voices.variant, time.perf_counter() - started)
            await self._start_engine()
            self.state = "warming up"
            log.info("warming up")
            await self._warm_up()
            freeze_long_lived(SERVING_THRESHOLDS)
            self.metrics.collections.watch()
            self.state = "ready"
            log.info("ready in %.1f s", time.perf_counter() - started)
            self._spawn(self._watch())
        except Exception as failure:
            self._fatal(f"start-up failed: {type(failure).__name__}: {failure}")

    def _load(self) -> tuple[TTSModel, VoiceCatalog, VoiceLibrary]:
        from engine.synthetic.checkpoints import default_model_dir

        spec = self.options.model or default_model_dir()
        model_dir, name = resolve_model(spec)
        tts = TTSModel.load(model_dir, device=self.options.device, dtype=self._dtype())
        self._model_name = name
        self.hub_id = str(spec) if is_hub_id(spec) else official_hub_id(tts.config, tts.speech)
        store = self._voice_store(tts)
        catalog = VoiceCatalog(tts, list(self.options.clone_voices), store.voices() if store else [],
                               self.options.openai_voices)
        return tts, catalog, VoiceLibrary(tts, catalog, store, self.limits.max_stored_voices)

    def _voice_store(self, tts: TTSModel) -> VoiceStore | None:
        """The library of a model that can make voices (Base, VoiceDesign), keyed by its checkpoint's fingerprint."""
        if tts.model_type not in UPLOAD_VARIANTS:
            return None
        store = VoiceStore.in_data_dir(self.options.data_dir, checkpoint_fingerprint(tts.model_dir))
        others = store.other_models()
        log.info("voice library %s: %d voices of this checkpoint%s", store.path or "in memory", store.count(),
                 f" ({others} of other checkpoints, not served)" if others else "")
        return store

    def _gpu(self) -> bool:
        return torch.device(self.options.device).type == "cuda"

    def _dtype(self) -> torch.dtype:
        """bf16 on a GPU (what the benchmarks measure), fp32 on the CPU, unless asked otherwise."""
        if self.options.dtype == "auto":
            return torch.bfloat16 if self._gpu() else torch.float32
        return getattr(torch, self.options.dtype)

    async def _start_engine(self) -> None:
        """The engine on a thread of this process, or in a process of its own (on a GPU by default: the gateway's
        threads would otherwise starve the step of the GIL; engine/serving/process_engine.py says why)."""
        in_process = self.options.engine_process if self.options.engine_process is not None else self._gpu()
        if in_process:
            spec = EngineSpec(self.tts.model_dir, self.options.device, self._dtype(), self._engine_config(),
                              self.options.engine_setup)
            self.engine = ProcessEngine(spec, self.tts, on_step=self.metrics.on_step, on_failure=self._engine_failed)
            self.engine.start()
            await self.engine.ready()
        else:
            engine = await asyncio.to_thread(self._build_engine)
            self.engine = AsyncEngine(engine, on_step=self.metrics.on_step, on_failure=self._engine_failed)
            self.engine.start()
        self.limits = self.options.limits.for_slots(self.engine.slots)
        log.info("engine: %d slots; at most %d WebSocket sessions and %d connections", self.engine.slots,
                 self.limits.max_sessions, self.limits.connection_cap)

    def _build_engine(self) -> Engine:
        engine = Engine(self.tts, self._engine_config())
        if self.options.engine_setup is not None:
            self.options.engine_setup(engine)
        return engine

    def _engine_config(self) -> EngineConfig:
        """On a GPU the slots fill GPU_KV_MEMORY_SHARE of its free memory less GPU_ENGINE_RESERVE, up to GPU_MAX_SLOTS
        (`--max-batch` sets them instead); on the CPU 8."""
        options = self.options
        schedule, admission = GPU_SCHEDULING if self._gpu() else ("fixed", "all")
        busy = options.busy_batch if options.busy_batch is not None else GPU_BUSY_BATCH if self._gpu() else None
        lead = options.lead_target_s if options.lead_target_s is not None else GPU_LEAD_TARGET_S if self._gpu() else 0
        common = dict(synthetic_frames_per_token=options.synthetic_frames_per_token,
                      chunk_schedule=options.chunk_schedule or schedule, admission=options.admission or admission,
                      busy_batch=busy, lead_target_s=lead or None)
        if self._gpu():
            sized = options.max_batch is None
            return EngineConfig(max_batch=options.max_batch or GPU_MAX_SLOTS,
                                kv_memory_share=GPU_KV_MEMORY_SHARE if sized else None,
                                kv_memory_reserve_bytes=GPU_ENGINE_RESERVE, step_mode="graphs",
                                attention_backend="triton", frame_path="triton", **common)
        return EngineConfig(max_batch=options.max_batch or 8, **common)

    async def _warm_up(self) -> None:
        request = self.template(self.voices.warm_up_voice(), "auto", Sampling(seed=0))
        handle = self.engine.submit(replace(request, text="Warm up.", text_complete=True, max_frames=4))
        async for event in handle:
            if isinstance(event, Finished) and event.reason == "error":
                raise EngineFailed(f"warm-up synthesis failed: {event.error}")

    def readiness(self) -> tuple[bool, str]:
        if self.state != "ready":
            return False, self.failure or self.state
        if self.engine.error is not None:
            return False, f"engine failed: {self.engine.error}"
        stalled = self._stalled_s()
        if stalled is not None:
            return False, f"engine step stalled for {stalled:.0f} s"
        if self.shutting_down:
            return False, "shutting down"
        return True, "ready"

    def capacity(self) -> dict[str, int | None]:
        """What the server holds at once, for operators (/ready): the session limit follows the engine's slots."""
        return {"engine_slots": self.engine.slots if self.engine is not None else None,
                "max_sessions": self.limits.max_sessions, "max_connections": self.limits.connection_cap}

    def healthy(self) -> bool:
        """False once the gateway has failed for good (its server is draining to exit)."""
        return self.state != "failed"

    def _stalled_s(self) -> float | None:
        """How long the running step has run, once that is more than STALLED_STEP_S."""
        started = self.engine.last_step_started
        running = time.monotonic() - started if started is not None else 0.0
        return running if running > STALLED_STEP_S else None

    async def _watch(self) -> None:
        """A step that runs too long means the device hangs: the engine is failed (its requests end, a process
        engine's child is killed), which restarts it."""
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            stalled = self._stalled_s()
            if stalled is not None and self.state == "ready" and self.engine.error is None:
                self.engine.abort(EngineFailed(f"the engine step stalled for {stalled:.0f} s"))

    def _engine_failed(self, error: EngineFailed) -> None:
        """On the event loop, once the engine has failed and its open requests have ended: start a new engine,
        unless this one was itself a restart that failed again soon."""
        if self.state != "ready" or self.shutting_down:
            return  # starting (the start-up fails with it) or stopping
        if self._restarted_at is not None and time.monotonic() - self._restarted_at < REFAIL_WINDOW_S:
            self._fatal(f"the engine failed again within {REFAIL_WINDOW_S:.0f} s of its restart: {error}")
            return
        self.state, self.failure = "restarting", f"restarting the engine after its failure: {error}"
        log.error("the engine failed, restarting it: %s", error)
        self._spawn(self._restart_engine(error))

    async def _restart_engine(self, error: EngineFailed) -> None:
        try:
            await self.engine.stop()
            thaw()  # the failed engine's objects can go
            await asyncio.wait_for(self._start_engine(), RESTART_TIMEOUT_S)
            await asyncio.wait_for(self._warm_up(), RESTART_TIMEOUT_S)
            freeze_long_lived(SERVING_THRESHOLDS)
        except Exception as failure:
            self._fatal(f"the engine failed ({error}) and so did its restart: {type(failure).__name__}: {failure}")
            return
        self._restarted_at = time.monotonic()
        self.state, self.failure = "ready", None
        log.info("the engine restarted")

    def _fatal(self, reason: str) -> None:
        """The gateway cannot serve: readiness and health turn false, the log says why in one line, and the server
        (`on_fatal`) drains and exits."""
        self.state, self.failure = "failed", reason
        log.error("fatal: %s", reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _spawn(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def template(self, voice: Voice, language: str, sampling: Sampling, layout: str = "streaming",
                 interactive: bool = True, owner: str | None = None) -> SynthesisRequest:
        """A context's request without text (`layout`: engine/prompt.py's TEXT_LAYOUTS; streaming starts speaking
        soonest; `interactive` and `owner`: SynthesisRequest's); raises VoiceError for an unknown language."""
        return SynthesisRequest("", voice, language=self.voices.resolve_language(language), layout=layout,
                                sampling=self._sampling(sampling), text_complete=False,
                                clean_text=self.options.clean_text, interactive=interactive, owner=owner)

    def _sampling(self, wanted: Sampling) -> SamplingParams:
        base = SamplingParams.from_defaults(self.tts.config.generation)
        talker = base.talker
        if wanted.temperature is not None:
            talker = replace(talker, temperature=max(wanted.temperature, 1e-5), do_sample=wanted.temperature > 0)
        if wanted.top_k is not None:
            talker = replace(talker, top_k=wanted.top_k)
        if wanted.top_p is not None:
            talker = replace(talker, top_p=wanted.top_p)
        seed = wanted.seed if wanted.seed is not None else secrets.randbits(62)
        penalty = base.repetition_penalty if wanted.repetition_penalty is None else wanted.repetition_penalty
        return SamplingParams(talker, base.code_predictor, penalty, seed)

    def speech_context(self, template: SynthesisRequest, buffering: str, max_buffer_delay_ms: int,
                       lexicon: Lexicon | None = None, read_ahead: ReadAhead | None = None) -> SpeechContext:
        return SpeechContext(self.engine, template, UtterancePlanner(buffering, max_buffer_delay_ms / 1000), lexicon,
                             self.limits.max_text_chars, read_ahead)

    async def end_speech(self, grace_s: float) -> None:
        """The server stops: the speech endpoint's requests get `grace_s` to finish; those still being made then end
        with ShuttingDown (`overloaded`: an SSE stream's `error` event, a raw body's early end, a 503 before the
        first audio), so that no response is left to the server's cancellation, unterminated."""
        running = [speech.finished() for speech in self.http_speech]
        if running:
            await asyncio.wait(running, timeout=grace_s)
        for speech in list(self.http_speech):
            speech.abort(ShuttingDown(SHUTTING_DOWN))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.engine is not None:
            await self.engine.stop()
        await self.encoders.stop()
        self.metrics.collections.unwatch()
        thaw()
        if self.library is not None and self.library.store is not None:
            self.library.store.close()
