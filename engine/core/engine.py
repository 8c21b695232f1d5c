"""The request-level engine: submit requests, get their audio as it is produced, cancel them at any time.

The engine is the loop over three parts, as in nano-vllm: the `Scheduler` (which requests wait, run, hold or step),
the `ModelRunner` (the model's prefill and frame step over the requests it is given) and `Decoding` (frames to audio
chunks). Requests join and leave the running batch every step. A step admits waiting requests (their prompts
prefilled in one batch), runs one frame for the runnable requests the scheduler picks, then queues the decoding of
what is due; on a GPU the decoding overlaps the next step's frame.

One request never hurts another: whatever raises while a request is planned, tokenized, prompted, prefilled,
stepped or decoded fails that request alone (`Finished(reason="error")` with its typed error; `isolation.py`) and
the others go on. Only a device fault (a CUDA error), or a step that fails for every request alone, fails the
engine as a whole.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import count

import torch

from engine.core.cuda_graphs import DEFAULT_BUCKETS
from engine.core.decoding import Decoding
from engine.core.isolation import isolated, request_error
from engine.core.kv_cache import CacheShape
from engine.core.model_runner import ModelRunner
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.step_batch import StepCodes
from engine.errors import EmptyText, EngineFailed, RequestError, TextTooLong, VoxgateError
from engine.prompt import Prompt
from engine.request import Event, RunawayGuard, SynthesisRequest, SyntheticLength, check_request, check_text
from engine.sampling import SamplingParams
from engine.text.cleanup import clean_text, speakable
from engine.text.incremental import TextFeed
from engine.tts import TTSModel


@dataclass
class EngineConfig:
    max_batch: int = 64  # slots: requests running at once
    capacity: int = 2048  # talker positions per slot (prompt + frames)
    kv_budget_bytes: int | None = None  # if set, fewer slots when the budget is smaller
    # if set (and no kv_budget_bytes), the budget is this share of the device's free memory once the model is loaded:
    # slots sized by the GPU, as LLM servers size their KV cache
    kv_memory_share: float | None = None
    # with kv_memory_share: free memory kept from the KV cache however large the share, for the rest of the engine
    # (the decoder's graphs and states) and the runtime (eager decodes, voice-clone encodes); never more than half the
    # share's budget, so that a small GPU still gets slots
    kv_memory_reserve_bytes: int = 0
    max_waiting: int = 256
    # prefills a step: a burst of new sessions (a server's start, a reconnect storm) waits a few steps, not tens
    max_prefill_batch: int = 64
    first_chunk_frames: int = 1
    busy_batch: int | None = None  # a step of more requests is busy: first chunks wait for a frame more (decoding.py)
    chunk_frames: int = 4  # the largest chunk
    frame_path: str = "torch"  # "torch" (the model's own code) | "triton" (fused kernels: the GPU's fast path)
    # The torch frame path's decode attention: None or "sdpa" (masked, any device) | "triton" (reads only each
    # request's length: GPU). The triton frame path attends with its own kernel: None or "triton" (else ValueError).
    attention_backend: str | None = None
    step_mode: str = "eager"  # "eager" | "padded" (bucketed batches) | "graphs" (bucketed, CUDA graphs)
    overlap_decoding: bool | None = None  # decode beside the next frame step; None: on CUDA
    scheduling: str = "deadline"  # which requests step when more are runnable than max_step_batch (scheduler.py)
    max_step_batch: int | None = None  # None: every runnable request steps
    chunk_schedule: str = "fixed"  # "fixed" (1, 1, 2, 4 ... frames) | "lead" (by the client's buffer; decoding.py)
    admission: str = "all"  # "all" (every ready request) | "protect" (prefills wait for thin leads; scheduler.py)
    # interactive requests this far ahead of playback hold while more than `busy_batch` run (any number if None)
    lead_target_s: float | None = None
    guard: RunawayGuard = field(default_factory=RunawayGuard)
    # Benchmark-only, for random-weight checkpoints (never EOS): each request makes exactly ceil(this x its text
    # tokens) frames (its max_frames if fewer) instead of running to the guard. Refused for an unmarked checkpoint.
    synthetic_frames_per_token: float | None = None


class Engine:
    def __init__(self, tts: TTSModel, config: EngineConfig | None = None) -> None:
        self.tts = tts
        self.config = config = config or EngineConfig()
        self.length = (None if config.synthetic_frames_per_token is None else
                       SyntheticLength.for_model(config.synthetic_frames_per_token, tts.config, str(tts.model_dir)))
        layers = tts.config.talker.layers
        budget = config.kv_budget_bytes or self._kv_budget(tts.device, config)
        if budget is None:
            shape = CacheShape(layers.num_hidden_layers, layers.num_key_value_heads, layers.head_dim,
                               config.max_batch, config.capacity)
        else:
            shape = CacheShape.from_budget(layers, budget, config.capacity, tts.dtype, config.max_batch)
            if config.kv_budget_bytes is None:  # sized by the GPU: a bucket's size, so that every batch is graphed
                shape = replace(shape, slots=max(b for b in DEFAULT_BUCKETS if b <= shape.slots))
        self.runner = ModelRunner(tts.talker, shape, tts.device, tts.dtype, config.frame_path,
                                  config.attention_backend, config.step_mode, tts.config.tts_pad_token_id)
        overlap = config.overlap_decoding if config.overlap_decoding is not None else tts.device.type == "cuda"
        self.decoding = Decoding(tts.decoder, shape.slots, tts.device, tts.dtype, config.first_chunk_frames,
                                 config.chunk_frames, overlap, capture=config.step_mode == "graphs", fail=self._fail,
                                 schedule=config.chunk_schedule, clock=lambda: self.scheduler.clock(),
                                 busy_batch=config.busy_batch)
        self.scheduler: Scheduler[Sequence] = Scheduler(shape.slots, config.scheduling, config.max_step_batch,
                                                        config.max_prefill_batch, config.max_waiting,
                                                        admission=config.admission,
                                                        lead_target_s=config.lead_target_s,
                                                        busy_rows=config.busy_batch or 0)
        self._ids = count(1)

    @classmethod
    def _kv_budget(cls, device: torch.device, config: EngineConfig) -> int | None:
        """The KV cache's bytes from the GPU's free memory: its `kv_memory_share`, less whatever would leave under
        `kv_memory_reserve_bytes` free, but at least half the share (None on the CPU or without a share: slots as
        configured)."""
        share = config.kv_memory_share
        if share is None:
            return None
        if not 0.0 < share < 1.0:
            raise ValueError(f"kv_memory_share must be between 0 and 1, got {share}")
        free = cls._free_memory(device)
        if free is None:
            return None
        return int(max(free * share / 2, min(free * share, free - config.kv_memory_reserve_bytes)))

    @staticmethod
    def _free_memory(device: torch.device) -> int | None:
        """The device's free bytes; None on the CPU."""
        return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None

    @property
    def slots(self) -> int:
        return self.runner.cache.shape.slots

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> dict[int, Sequence]:
        return self.scheduler.running

    @property
    def free_slots(self) -> list[int]:
        return self.scheduler.free_slots

    def idle(self) -> bool:
        """No request left at all."""
        return self.scheduler.idle() and not self.decoding.in_flight and not self.decoding.finishing

    def has_work(self) -> bool:
        """A step would do something now: requests whose text has not arrived wait for `append_text`, once the
        frames they made before holding are on their way to the decoder; a waiting request counts only while a slot
        is free for it, by the reserve's rule too (else its loop spun, stepping nothing, until a slot freed)."""
        scheduler = self.scheduler
        return (scheduler.admissible() or bool(self.decoding.in_flight or scheduler.finished)
                or bool(self.decoding.finishing)
                or scheduler.steppable() or any(s.pending for s in scheduler.running.values()))

    def idle_wait_s(self, longest: float) -> float:
        """How long the loop may wait for a command when there is no work: `longest`, or less until a request held
        at the lead target is due to step again."""
        release = self.scheduler.next_release()
        return longest if release is None else min(longest, max(0.0, release - self.scheduler.clock()))

    def submit(self, request: SynthesisRequest) -> int:
        """Validate and queue a request. Raises at once: RequestError (bad input), EngineFull, or SynthesisFailed
        (planning it raised unexpectedly)."""
        check_request(self.tts, request)
        self.scheduler.check_room(request.interactive)
        try:
            seq = self._planned(request) if request.text_complete else self._streaming(request)
        except VoxgateError:
            raise
        except Exception as error:
            raise request_error(error, "planning the request") from error
        self.scheduler.add(seq)
        return seq.request_id

    def _planned(self, request: SynthesisRequest) -> Sequence:
        """A request whose whole text is here: tokenized and prompted now."""
        text = clean_text(request.text) if request.clean_text else request.text
        plan = self.tts.plan(text, request.voice, language=request.language, layout=request.layout,
                             sampling=request.sampling, max_frames=request.max_frames, guard=self.config.guard,
                             length=self.length)
        room = self._room(plan.prompt)
        return Sequence(next(self._ids), request, plan.prompt, plan.sampling, min(plan.max_frames, room), room=room)

    def _streaming(self, request: SynthesisRequest) -> Sequence:
        """A request whose text is still arriving; its prompt is built once its first text is in."""
        cfg = self.tts.config
        feed = TextFeed(self.tts.tokenizer, cfg.tts_eos_token_id, cfg.tts_pad_token_id, request.clean_text)
        feed.append(request.text)
        sampling = request.sampling or SamplingParams.from_defaults(cfg.generation)
        if self.length is not None:
            sampling = self.length.sampling(sampling)
        return Sequence(next(self._ids), request, None, sampling, request.max_frames or self.runner.capacity, feed)

    def _find(self, request_id: int) -> Sequence:
        seq = self.scheduler.find(request_id)
        if seq is None or seq.feed is None:
            raise RequestError(f"request {request_id} is not a running request with streaming text")
        return seq

    def append_text(self, request_id: int, text: str) -> None:
        """More text for a streaming-text request. Raises RequestError for a request that is not open for text (the
        call had no effect); text that cannot be read fails the request alone, its Finished says why."""
        seq = self._find(request_id)
        if seq.feed.ended:
            raise RequestError(f"request {request_id}: text appended after its end")

        def append() -> None:
            check_text("text", text)
            seq.feed.append(text)
        self._tokenize(seq, append)

    def settle_text(self, request_id: int) -> None:
        """The text of a streaming-text request has paused: its last words are read now instead of when more text
        shows where they end (`TextFeed.settle`)."""
        seq = self._find(request_id)
        self._tokenize(seq, seq.feed.settle)

    def end_text(self, request_id: int) -> None:
        """The text of a streaming-text request is complete: it speaks to the end, then finishes."""
        seq = self._find(request_id)
        if not self._tokenize(seq, seq.feed.end):
            return
        if self.length is not None:
            self._hold_to_length(seq)
        elif seq.request.max_frames is None:
            seq.max_frames = min(seq.max_frames, self.config.guard.limit(len(seq.feed.ids)))

    def _tokenize(self, seq: Sequence, feed: Callable[[], None]) -> bool:
        """Run a step of a request's text feed; text that cannot be read fails that request alone (False)."""
        try:
            feed()
        except Exception as error:
            self._fail(seq, request_error(error, "tokenizing its text"))
            return False
        return True

    def _hold_to_length(self, seq: Sequence) -> None:
        """Synthetic length: a streaming-text request's frame count is known once its text is. One that already
        has that many (it ran ahead of a late end) ends now, its frames not yet decoded queued as at any end."""
        tokens = len(seq.feed.ids)
        if not tokens:
            return  # nothing to speak: its prefill fails it with EmptyText
        seq.max_frames = min(seq.max_frames, self.length.limit(tokens, seq.request.max_frames))
        if seq.frames >= seq.max_frames and self.scheduler.running.get(seq.request_id) is seq:
            self.scheduler.finish(seq, "length")
            self.decoding.queue([seq], [])

    def _room(self, prompt: Prompt) -> int:
        length = prompt.prefill.shape[0]
        if length >= self.runner.capacity:
            raise TextTooLong(f"the prompt takes {length} positions, more than the engine's "
                              f"context of {self.runner.capacity}; shorten the text")
        return self.runner.capacity - length

    def pause(self, request_id: int, paused: bool) -> None:
        """Pause or resume a request whose listener cannot take more audio now (a client that reads slower than
        real time): paused, it runs no frame and keeps its slot, as a request whose text has not arrived holds; the
        frames it made are still decoded and delivered. Its output is the same as if it had never paused. A request
        that has finished or was cancelled is left as it is. The time it spent paused moves its first audio later
        (the lead's clock): its client took no audio meanwhile, and would otherwise seem to have run dry."""
        seq = self.scheduler.find(request_id)
        if seq is None or seq.paused == paused:
            return
        now = self.scheduler.clock()
        if not paused and seq.first_audio_at is not None and seq.paused_at is not None:
            seq.first_audio_at += now - seq.paused_at
        seq.paused, seq.paused_at = paused, now if paused else None

    def cancel(self, request_id: int) -> bool:
        """Stop a request now: its slot is free for the next step and it produces no further event."""
        return self.scheduler.cancel(request_id)

    def step(self, on_audio: Callable[[list[Event]], None] | None = None) -> list[Event]:
        """Admit, run one frame for the runnable requests the scheduler picks (a request whose next text has not
        arrived holds), queue the decoding of what is due. Returns the new events. Raises (EngineFailed, a device
        fault) only when the engine as a whole has failed.

        With overlapped decoding, the audio queued in one step is collected while the next steps' frames run on the
        GPU: the step polls, delivering each decode that has landed, and waits only for decodes queued before the
        previous step (or for all, when it has no frame to run); `on_audio`, if given, receives the audio before the
        frame's codes are waited for. A step that queues a request's first audio waits for it instead (queued before
        the step's other chunks, it does not wait for them): time to first audio is the decoder alone on the GPU."""
        self._admit()
        seqs, held = self.scheduler.schedule()
        parts = self._frames(seqs)  # queued on the GPU
        decoding = self.decoding
        overlap = decoding.overlap.enabled
        events = (self._collect(decoding.through_step(decoding.queued_steps - 1 if parts else decoding.queued_steps))
                  if overlap else [])
        if on_audio is not None and events:
            on_audio(events)
            events = []
        eos = self.tts.config.talker.codec_eos_token_id
        for part, codes in parts:
            self.scheduler.postprocess(part, codes.host(), eos)  # the step's one device-to-host copy
        stepped = [s for part, _ in parts for s in part]
        decoding.queue(stepped, held)
        self._out_of_room(stepped)  # after its last frames are queued: an error's frames would not be decoded
        if not overlap:
            events += self._collect(len(decoding.in_flight))
        elif first_audio := decoding.through_first_audio():
            events += self._collect(first_audio)
        return events

    def _collect(self, wait_for: int) -> list[Event]:
        return self.decoding.collect(self.scheduler.take_finished(), wait_for)

    def _out_of_room(self, seqs: list[Sequence]) -> None:
        """A request that filled its KV slot before its own end (EOS, its length limit) has not spoken all its
        text: it ends with TextTooLong, after the audio it made, rather than passing as done with its end lost."""
        for seq in seqs:
            if seq.done == "length" and seq.frames >= seq.room:
                seq.done, seq.error = "error", TextTooLong(
                    f"the text filled the engine's context ({self.runner.capacity} positions, prompt included) before "
                    f"its end: what did not fit was not spoken; split it into shorter sentences")

    def _frames(self, seqs: list[Sequence]) -> list[tuple[list[Sequence], StepCodes]]:
        """One frame for `seqs`: (requests, codes) of each batch that ran. A batch that raises is bisected until
        the culprits are alone, and only they fail: running a subset again is safe, since a frame's KV-cache writes
        are idempotent, a request's state only advances once its frame has run, and the sampling noise is a pure
        function of (seed, frame, codebook). If every request fails alone, the fault is the engine's."""
        runner = self.runner
        parts = isolated(seqs, lambda batch: runner.run(runner.batch(batch)), "running its frame", self._fail,
                         retry=lambda batch: runner.run(runner.batch(batch)).landed())  # before a graph reruns
        if len(seqs) > 1 and not parts:
            raise EngineFailed(f"a step failed for each of its {len(seqs)} requests alone")
        return parts

    def _fail(self, seq: Sequence, error: VoxgateError) -> None:
        """The request failed alone: its frames not yet decoded are dropped, its slot is free for the next admission
        (decodes queued for it run first), and its Finished, with the error, follows its audio already queued."""
        seq.error = error
        seq.pending.clear()
        self.scheduler.finish(seq, "error")

    def _admit(self) -> None:
        """Prefill, in one batch, the waiting requests that have their first text, oldest first, and start their
        decoders; a request whose prompt, prefill or decoder start raises fails alone."""
        admitted = self.scheduler.admit(self._prepare)
        prefilled = [s for part, _ in isolated(admitted, self.runner.prefill, "prefilling its prompt", self._fail)
                     for s in part]
        isolated(prefilled, self.decoding.start, "starting its decoder", self._fail)

    def _prepare(self, seq: Sequence) -> bool:
        """Build a streaming-text request's prompt from the ids in so far, once; a request that fails here fails
        alone."""
        if seq.prompt is not None:
            return True
        try:
            self._build_prompt(seq)
        except Exception as error:
            self._fail(seq, request_error(error, "building its prompt"))
            return False
        return True

    def _build_prompt(self, seq: Sequence) -> None:
        feed, request = seq.feed, seq.request
        if feed.ended and not speakable(feed.text):
            raise EmptyText()
        seq.prompt = self.tts.prompt_from_ids(feed.ids, request.voice, request.language, "streaming")
        seq.room = self._room(seq.prompt)
        seq.max_frames = min(seq.max_frames, seq.room)
        voice = request.voice
        if voice.ref_codes is None:
            feed.consumed = 1
            return
        # the prefill lays reference text + text (+ tts_eos once ended) over codec bos + reference frames
        track = len(voice.ref_text_ids) + len(feed.ids) + feed.ended
        feed.consumed = min(voice.ref_codes.shape[0] + 1, track) - len(voice.ref_text_ids)
        if feed.consumed < 0:
            raise RequestError("the reference transcript has more tokens than its audio has frames")
