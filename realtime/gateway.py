"""The gateway's shared state: the model and its engine (loaded and warmed up in the background so that /health
answers at once and /ready turns 200 only when synthesis works), the voices, limits, metrics and open sessions."""
from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.async_engine import AsyncEngine
from engine.engine_process import EngineSpec, ProcessEngine
from engine.engine import Engine, EngineConfig, Finished, SynthesisRequest
from engine.model_source import resolve_model
from engine.prompt import Voice
from engine.sampling import SamplingParams
from engine.speech_context import SpeechContext
from engine.tts import TTSModel
from engine.utterances import UtterancePlanner
from realtime.llm import LLMConfig
from realtime.metrics import Metrics
from realtime.protocol import Sampling
from realtime.voices import CloneVoice, VoiceCatalog

log = logging.getLogger("voxgate")
STALLED_STEP_S = 30.0  # a step running longer than this means the device hangs: /ready turns 503


@dataclass(frozen=True)
class Limits:
    """Every limit has a default; `voxgate serve --help` documents them."""
    max_sessions: int = 64
    max_contexts: int = 8  # open contexts per session
    max_text_chars: int = 20000  # per context
    max_message_bytes: int = 256 * 1024
    idle_timeout_s: float = 120.0
    send_queue_ms: int = 5000  # audio queued for a session before its synthesis pauses (slow consumer)
    max_message_rate: float = 200.0  # client messages per second per session (bursts of twice that)
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()


@dataclass(frozen=True)
class GatewayOptions:
    model: str | Path | None = None  # a checkpoint directory or a hub id; None: the embedded tiny model
    device: str = "cpu"
    clone_voices: tuple[CloneVoice, ...] = ()
    limits: Limits = field(default_factory=Limits)
    max_batch: int | None = None  # engine slots; None: 64 on a GPU, 8 on the CPU
    clean_text: bool = True  # LLM output: markdown and emoji are not read out
    llm: LLMConfig | None = None  # the chat endpoint's LLM (/v1/chat); None: the demo speaks what the user types
    dtype: str = "auto"  # "auto": bfloat16 on a GPU, float32 on the CPU
    engine_process: bool | None = None  # the engine in a child process; None: on a GPU


class Gateway:
    def __init__(self, options: GatewayOptions) -> None:
        self.options = options
        self.limits = options.limits
        self.metrics = Metrics()
        self.state = "loading"
        self.failure: str | None = None
        self.tts: TTSModel | None = None
        self._model_name = "loading"
        self.voices: VoiceCatalog | None = None
        self.engine: AsyncEngine | ProcessEngine | None = None
        self.sessions: set = set()
        self.shutting_down = False
        self.metrics.sessions_active.set_function(lambda: len(self.sessions))
        self.metrics.engine_requests_active.set_function(lambda: self.engine.active if self.engine else 0)
        self.metrics.engine_queue_depth.set_function(
            lambda: self.engine.waiting if self.engine else 0)
        self._loaded = asyncio.Event()

    def session(self, session_id: str):
        """The open voxgate.v1 session with this id, or None."""
        return next((session for session in self.sessions if session.id == session_id), None)

    @property
    def model_name(self) -> str:
        return self._model_name

    async def start(self) -> None:
        """Load, build the engine, warm up; a failure is reported by /ready, never raised into the server."""
        try:
            started = time.perf_counter()
            log.info("loading the model from %s on %s", self.options.model or "the embedded tiny model",
                     self.options.device)
            self.tts, self.voices = await asyncio.to_thread(self._load)
            log.info("model %s (%s) loaded in %.1f s; building the engine", self.model_name,
                     self.voices.variant, time.perf_counter() - started)
            await self._start_engine()
            self.state = "warming up"
            log.info("warming up")
            await self._warm_up()
            self.state = "ready"
            log.info("ready in %.1f s", time.perf_counter() - started)
        except Exception as failure:  # reported by /ready and the log; the process stays up for /health
            self.state, self.failure = "failed", f"{type(failure).__name__}: {failure}"
            log.error("start-up failed: %s", self.failure)
        finally:
            self._loaded.set()

    def _load(self) -> tuple[TTSModel, VoiceCatalog]:
        from engine.random_checkpoint import default_model_dir

        model_dir, name = resolve_model(self.options.model or default_model_dir())
        tts = TTSModel.load(model_dir, device=self.options.device, dtype=self._dtype())
        self._model_name = name
        return tts, VoiceCatalog(tts, list(self.options.clone_voices))

    def _gpu(self) -> bool:
        return torch.device(self.options.device).type == "cuda"

    def _dtype(self) -> torch.dtype:
        """bf16 on a GPU (what the benchmarks measure), fp32 on the CPU, unless asked otherwise."""
        if self.options.dtype == "auto":
            return torch.bfloat16 if self._gpu() else torch.float32
        return getattr(torch, self.options.dtype)

    async def _start_engine(self) -> None:
        """The engine on a thread of this process, or in a process of its own (on a GPU by default: the gateway's
        threads would otherwise starve the step of the GIL; engine/engine_process.py says why)."""
        in_process = self.options.engine_process if self.options.engine_process is not None else self._gpu()
        if in_process:
            spec = EngineSpec(self.tts.model_dir, self.options.device, self._dtype(), self._engine_config())
            self.engine = ProcessEngine(spec, on_step=self.metrics.on_step)
            self.engine.start()
            await self.engine.ready()
        else:
            engine = await asyncio.to_thread(Engine, self.tts, self._engine_config())
            self.engine = AsyncEngine(engine, on_step=self.metrics.on_step)
            self.engine.start()

    def _engine_config(self) -> EngineConfig:
        gpu = self._gpu()
        slots = self.options.max_batch or (64 if gpu else 8)
        if gpu:
            return EngineConfig(max_batch=slots, step_mode="graphs", attention_backend="triton",
                                frame_path="triton")
        return EngineConfig(max_batch=slots)

    async def _warm_up(self) -> None:
        request = self.template(self.voices.resolve(None, "a calm voice" if self.voices.variant == "voice_design"
                                                    else None), "auto", Sampling(seed=0))
        stream = self.engine.submit(replace(request, text="Warm up.", text_complete=True, max_frames=4))
        async for event in stream:
            if isinstance(event, Finished) and event.reason == "error":
                raise RuntimeError(f"warm-up synthesis failed: {event.error}")

    async def wait_loaded(self) -> None:
        await self._loaded.wait()

    def readiness(self) -> tuple[bool, str]:
        if self.state != "ready":
            return False, self.failure or self.state
        if self.engine.error is not None:
            return False, f"engine failed: {self.engine.error}"
        started = self.engine.last_step_started
        if started is not None and time.monotonic() - started > STALLED_STEP_S:
            return False, f"engine step stalled for {time.monotonic() - started:.0f} s"
        if self.shutting_down:
            return False, "shutting down"
        return True, "ready"

    def authorized(self, key: str | None) -> bool:
        """Compared in constant time against every key (no key configured: open)."""
        if not self.limits.api_keys:
            return True
        given = (key or "").encode()
        return any(hmac.compare_digest(given, k.encode()) for k in self.limits.api_keys) and bool(given)

    def origin_allowed(self, origin: str | None) -> bool:
        return not self.limits.allowed_origins or origin is None or origin in self.limits.allowed_origins

    def template(self, voice: Voice, language: str, sampling: Sampling) -> SynthesisRequest:
        """A context's request without text; raises RequestError for an unknown language."""
        return SynthesisRequest("", voice, language=self.tts.resolve_language(language), layout="streaming",
                                sampling=self._sampling(sampling), text_complete=False,
                                clean_text=self.options.clean_text)

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

    def speech_context(self, template: SynthesisRequest, buffering: str, max_buffer_delay_ms: int) -> SpeechContext:
        return SpeechContext(self.engine, template, UtterancePlanner(buffering, max_buffer_delay_ms / 1000))

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
