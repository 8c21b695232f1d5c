"""The request-level engine: submit requests, get their audio as it is produced, cancel them at any time.

Requests join and leave the running batch every step. A step admits waiting requests (their prompts prefilled in
one batch), runs one frame for the running requests the scheduler picks (`scheduler.py`; all of them unless
`max_step_batch` is set) whose next text token is in (`text_stream.py`), then decodes audio: the first chunk after
`first_chunk_frames` frames for the shortest time to first audio, larger chunks later to amortise the decoder.
On a GPU the decoding overlaps the next step's frame (`decode_stream`).

One request never hurts another: whatever raises while a request is planned, tokenized, prompted, prefilled,
stepped or decoded fails that request alone (`Finished(reason="error")` with its typed error) and the others go on.
Only a device fault (a CUDA error), or a step that fails for every request alone, fails the engine as a whole.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import count
from typing import TypeVar

import torch

from engine.core.attention import BACKENDS
from engine.core.codec_decoding import DecoderPool
from engine.core.cuda_graphs import PaddedStep
from engine.core.decode_overlap import DecodeStream, PendingAudio
from engine.core.frame_path import FRAME_PATHS
from engine.core.kv_cache import CacheShape
from engine.core.model_runner import ModelRunner, StepBatch
from engine.core.scheduler import Scheduler
from engine.errors import EmptyText, EngineFailed, EngineFull, RequestError, TextTooLong, VoxgateError, request_failure
from engine.prompt import Prompt
from engine.reference import BatchSampling
from engine.request import AudioChunk, Event, Finished, RunawayGuard, SynthesisRequest, check_request, check_text
from engine.sampling import SamplingParams
from engine.text.cleanup import clean_text
from engine.text.incremental import TextFeed
from engine.tts import TTSModel

DEVICE_FAULT = getattr(torch, "AcceleratorError", ())  # a CUDA error: the device, not a request, is at fault
T = TypeVar("T")

@dataclass
class EngineConfig:
    max_batch: int = 64  # slots: requests running at once
    capacity: int = 2048  # talker positions per slot (prompt + frames)
    kv_budget_bytes: int | None = None  # if set, fewer slots when the budget is smaller
    max_waiting: int = 256
    max_prefill_batch: int = 16
    first_chunk_frames: int = 1
    chunk_frames: int = 4  # the largest chunk
    attention_backend: str = "sdpa"  # "triton" reads only each request's length (GPU)
    step_mode: str = "eager"  # "eager" | "padded" (bucketed batches) | "graphs" (bucketed, CUDA graphs)
    frame_path: str = "torch"  # "torch" (the model's own code) | "triton" (fused kernels: the GPU's fast path)
    overlap_decoding: bool | None = None  # decode beside the next frame step; None: on CUDA
    scheduling: str = "deadline"  # which streams step when more are runnable than max_step_batch (scheduler.py)
    max_step_batch: int | None = None  # None: every runnable stream steps
    guard: RunawayGuard = field(default_factory=RunawayGuard)


@dataclass(eq=False)  # compared by identity: a stream is one request
class _Stream:
    request_id: int
    request: SynthesisRequest
    prompt: Prompt | None  # streaming text: built at admission, from the first ids
    sampling: SamplingParams
    max_frames: int
    feed: TextFeed | None = None  # streaming text
    slot: int = -1
    frames: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    decoded_frames: int = 0
    done: str | None = None
    error: VoxgateError | None = None
    cancelled: bool = False
    first_audio_at: float | None = None

    def text_id(self) -> int | None:
        """The text token of the next frame; None holds the stream (its text has not arrived)."""
        return self.feed.text_id(self.frames) if self.feed is not None else self.prompt.text_id(self.frames)


STEP_MODES = ("eager", "padded", "graphs")


class Engine:
    def __init__(self, tts: TTSModel, config: EngineConfig | None = None) -> None:
        self.tts = tts
        self.config = config = config or EngineConfig()
        if (config.attention_backend not in BACKENDS or config.step_mode not in STEP_MODES
                or config.frame_path not in FRAME_PATHS):
            raise ValueError(f"attention_backend must be one of {BACKENDS}, step_mode one of {STEP_MODES} and "
                             f"frame_path one of {FRAME_PATHS}")
        if config.first_chunk_frames < 1 or config.chunk_frames < 1:
            raise ValueError("first_chunk_frames and chunk_frames must be at least 1")
        layers = tts.config.talker.layers
        if config.kv_budget_bytes is None:
            shape = CacheShape(layers.num_hidden_layers, layers.num_key_value_heads, layers.head_dim,
                               config.max_batch, config.capacity)
        else:
            shape = CacheShape.from_budget(layers, config.kv_budget_bytes, config.capacity, tts.dtype,
                                           config.max_batch)
        self.runner = ModelRunner(tts.talker, shape, tts.device, tts.dtype, config.attention_backend,
                                  config.frame_path)
        self._step = self.runner.step
        if config.step_mode != "eager":
            self._step = PaddedStep(self.runner, tts.config.tts_pad_token_id, capture=config.step_mode == "graphs")
        overlap = config.overlap_decoding if config.overlap_decoding is not None else tts.device.type == "cuda"
        self.decoding = DecodeStream(tts.device, overlap)
        self._in_flight: list[PendingAudio] = []  # decoded chunks not yet delivered
        self._finishing: list[_Stream] = []  # done streams whose Finished follows their last chunk
        self.decoders = DecoderPool(tts.decoder, shape.slots, tts.device, tts.dtype,
                                    capture=config.step_mode == "graphs", chunk_lengths=self._chunk_lengths())
        self.scheduler = Scheduler(config.scheduling, config.max_step_batch)
        self.free_slots = list(range(shape.slots))
        self.waiting: deque[_Stream] = deque()
        self.running: dict[int, _Stream] = {}
        self._ids = count(1)

    @property
    def slots(self) -> int:
        return self.runner.cache.shape.slots

    def idle(self) -> bool:
        """No request left at all."""
        return not self.waiting and not self.running and not self._in_flight and not self._finishing

    def has_work(self) -> bool:
        """A step would do something now: streams whose text has not arrived wait for `append_text`, once the frames
        they made before holding are on their way to the decoder."""
        return (any(self._ready(s) for s in self.waiting) or bool(self._in_flight or self._finishing)
                or any(s.text_id() is not None or s.pending for s in self.running.values()))

    def submit(self, request: SynthesisRequest) -> int:
        """Validate and queue a request. Raises at once: RequestError (bad input), EngineFull, or SynthesisFailed
        (planning it raised unexpectedly)."""
        check_request(self.tts, request)
        if len(self.waiting) >= self.config.max_waiting:
            raise EngineFull(f"the engine is full ({len(self.waiting)} requests waiting); try again later")
        try:
            stream = self._planned(request) if request.text_complete else self._streaming(request)
        except VoxgateError:
            raise
        except Exception as error:
            raise _request_failure(error, "planning the request") from error
        self.waiting.append(stream)
        return stream.request_id

    def _planned(self, request: SynthesisRequest) -> _Stream:
        """A request whose whole text is here: tokenized and prompted now."""
        text = clean_text(request.text) if request.clean_text else request.text
        plan = self.tts.plan(text, request.voice, language=request.language, layout=request.layout,
                             sampling=request.sampling, max_frames=request.max_frames, guard=self.config.guard)
        max_frames = min(plan.max_frames, self._room(plan.prompt))
        return _Stream(next(self._ids), request, plan.prompt, plan.sampling, max_frames)

    def _streaming(self, request: SynthesisRequest) -> _Stream:
        """A request whose text is still arriving; its prompt is built once its first text is in."""
        cfg = self.tts.config
        feed = TextFeed(self.tts.tokenizer, cfg.tts_eos_token_id, cfg.tts_pad_token_id, request.clean_text)
        feed.append(request.text)
        sampling = request.sampling or SamplingParams.from_defaults(cfg.generation)
        return _Stream(next(self._ids), request, None, sampling, request.max_frames or self.runner.capacity, feed)

    def _find(self, request_id: int) -> _Stream:
        stream = self.running.get(request_id) or next((s for s in self.waiting if s.request_id == request_id), None)
        if stream is None or stream.feed is None:
            raise RequestError(f"request {request_id} is not a running request with streaming text")
        return stream

    def append_text(self, request_id: int, text: str) -> None:
        """More text for a streaming-text request. Raises RequestError for a request that is not open for text (the
        call had no effect); text that cannot be read fails the request alone, its Finished says why."""
        stream = self._find(request_id)
        if stream.feed.ended:
            raise RequestError(f"request {request_id}: text appended after its end")
        try:
            check_text("text", text)
            stream.feed.append(text)
        except Exception as error:
            self._end(stream, "error", _request_failure(error, "tokenizing its text"))

    def end_text(self, request_id: int) -> None:
        """The text of a streaming-text request is complete: it speaks to the end, then finishes."""
        stream = self._find(request_id)
        try:
            stream.feed.end()
        except Exception as error:
            self._end(stream, "error", _request_failure(error, "tokenizing its text"))
            return
        if stream.request.max_frames is None:
            stream.max_frames = min(stream.max_frames, self.config.guard.limit(len(stream.feed.ids)))

    def _room(self, prompt: Prompt) -> int:
        length = prompt.prefill.shape[0]
        if length >= self.runner.capacity:
            raise TextTooLong(f"the prompt takes {length} positions, more than the engine's "
                              f"context of {self.runner.capacity}; shorten the text")
        return self.runner.capacity - length

    def cancel(self, request_id: int) -> bool:
        """Stop a request now: its slot is free for the next step and it produces no further event."""
        for stream in self.waiting:
            if stream.request_id == request_id:
                self.waiting.remove(stream)
                return True
        stream = self.running.pop(request_id, None)
        if stream is not None:
            self.free_slots.append(stream.slot)
        else:
            stream = next((s for s in self._finishing if s.request_id == request_id), None)
        if stream is None:
            return False
        stream.cancelled = True  # its chunks still in flight are dropped
        return True

    def step(self, on_audio: Callable[[list[Event]], None] | None = None) -> list[Event]:
        """Admit, run one frame for the runnable requests the scheduler picks (a request whose next text has not
        arrived holds), queue the decoding of what is due. Returns the new events. Raises (EngineFailed, a device
        fault) only when the engine as a whole has failed.

        With overlapped decoding, the audio queued in one step is collected in the next one while that step's frame
        runs on the GPU; `on_audio`, if given, receives it then, before the frame's codes are waited for. A step that
        queues a request's first audio waits for it instead: time to first audio is the decoder alone on the GPU."""
        self._admit()
        held = [s for s in self.running.values() if s.text_id() is None]
        streams = self.scheduler.select([s for s in self.running.values() if s.text_id() is not None],
                                        time.monotonic())
        parts = self._frames(streams)  # queued on the GPU
        events = self._collect() if self.decoding.overlap else []
        if on_audio is not None and events:
            on_audio(events)
            events = []
        for part, codes in parts:
            self._take_frames(part, codes.cpu())  # the step's one device-to-host copy
        self._queue_decodes([s for part, _ in parts for s in part], held)
        if not self.decoding.overlap or self._first_audio_queued():
            events += self._collect()
        return events

    def _first_audio_queued(self) -> bool:
        return any(start_sample == 0 for pending in self._in_flight for _, start_sample in pending.owners)

    def _frames(self, streams: list[_Stream]) -> list[tuple[list[_Stream], torch.Tensor]]:
        """One frame for `streams`: (streams, codes) of each batch that ran. A batch that raises is bisected until
        the culprits are alone, and only they fail: running a subset again is safe, since a frame's KV-cache writes
        are idempotent, a request's state only advances once its frame has run, and the sampling noise is a pure
        function of (seed, frame, codebook). If every request fails alone, the fault is the engine's."""
        parts = self._isolated(streams, lambda batch: self._step(self._batch(batch)), "running its frame",
                               retry=lambda batch: self._step(self._batch(batch)).cpu())  # before a graph reruns
        if len(streams) > 1 and not parts:
            raise EngineFailed(f"a step failed for each of its {len(streams)} requests alone")
        return parts

    def _isolated(self, streams: list[_Stream], run: Callable[[list[_Stream]], T], stage: str,
                  retry: Callable[[list[_Stream]], T] | None = None) -> list[tuple[list[_Stream], T]]:
        """`run(streams)` as one batch; if it raises, `retry` (default: `run`) on each half, recursively, so that
        only the streams that fail alone end, with a typed error. Returns each batch that ran, with its result. A
        device fault is not bisected: it is the engine's."""
        if not streams:
            return []
        try:
            return [(streams, run(streams))]
        except Exception as error:
            if isinstance(error, DEVICE_FAULT):
                raise
            if len(streams) == 1:
                self._end(streams[0], "error", request_failure(error, stage))
                return []
        retry = retry or run
        middle = len(streams) // 2
        return self._isolated(streams[:middle], retry, stage) + self._isolated(streams[middle:], retry, stage)

    def _take_frames(self, streams: list[_Stream], codes: torch.Tensor) -> None:
        eos = self.tts.config.talker.codec_eos_token_id
        for stream, frame in zip(streams, codes):
            if frame[0].item() == eos:
                self._end(stream, "eos")
                continue
            stream.pending.append(frame)
            stream.frames += 1
            if stream.first_audio_at is None:
                stream.first_audio_at = time.monotonic()
            if stream.frames >= stream.max_frames:
                self._end(stream, "length")

    def _end(self, stream: _Stream, reason: str, error: VoxgateError | None = None) -> None:
        """The stream is done: its slot is free for the next admission (decodes queued for it run first), and its
        Finished follows its last audio. A failed stream's frames not yet decoded are dropped."""
        stream.done, stream.error = reason, error
        if error is not None:
            stream.pending.clear()
        if self.running.pop(stream.request_id, None) is not None:
            self.free_slots.append(stream.slot)
        elif stream in self.waiting:
            self.waiting.remove(stream)
        if stream not in self._finishing:
            self._finishing.append(stream)

    def _admit(self) -> None:
        """Prefill, in one batch, the waiting requests that have their first text, oldest first, and start their
        decoders; a request whose prompt, prefill or decoder start raises fails alone."""
        admitted = self._admissible()
        prefilled = [s for part, _ in self._isolated(admitted, self._prefill, "prefilling its prompt") for s in part]
        self._isolated(prefilled, self._start_decoders, "starting its decoder")

    def _admissible(self) -> list[_Stream]:
        """The waiting requests that can start now, each moved to a slot."""
        admitted: list[_Stream] = []
        for stream in list(self.waiting):
            if len(admitted) >= self.config.max_prefill_batch:
                break
            if not self._ready(stream):
                continue
            if stream.prompt is None and not self._prepare(stream):
                continue
            if not self.free_slots:
                break
            self.waiting.remove(stream)
            stream.slot = self.free_slots.pop(0)
            self.running[stream.request_id] = stream
            admitted.append(stream)
        return admitted

    def _prefill(self, streams: list[_Stream]) -> None:
        self.runner.prefill([s.slot for s in streams], [s.prompt.prefill for s in streams])

    def _start_decoders(self, streams: list[_Stream]) -> None:
        with self.decoding.context():  # after any decode still queued for the slot's previous request
            for stream in streams:
                self.decoders.reset(stream.slot)
                ref_codes = stream.request.voice.ref_codes
                if ref_codes is not None and ref_codes.shape[0]:
                    # Voice cloning: the reference frames are the decoder's left context, never heard.
                    self.decoders.decode([stream.slot], ref_codes[None])

    def _ready(self, stream: _Stream) -> bool:
        """Whether the prefill has its text: the first token, or for voice cloning enough tokens to fill the
        reference's frames (its text track is laid over them), or the end of the input."""
        feed = stream.feed
        if feed is None or stream.prompt is not None or feed.ended:
            return True
        voice = stream.request.voice
        if voice.ref_codes is None:
            return len(feed.ids) >= 1
        return len(voice.ref_text_ids) + len(feed.ids) >= voice.ref_codes.shape[0] + 1

    def _prepare(self, stream: _Stream) -> bool:
        """Build a streaming-text request's prompt from the ids in so far; a request that fails here fails alone."""
        try:
            self._build_prompt(stream)
        except Exception as error:
            self._end(stream, "error", _request_failure(error, "building its prompt"))
            return False
        return True

    def _build_prompt(self, stream: _Stream) -> None:
        feed, request = stream.feed, stream.request
        if feed.ended and not feed.text.strip():
            raise EmptyText("text is empty")
        stream.prompt = self.tts.prompt_from_ids(feed.ids, request.voice, request.language, "streaming")
        stream.max_frames = min(stream.max_frames, self._room(stream.prompt))
        voice = request.voice
        if voice.ref_codes is None:
            feed.consumed = 1
            return
        # the prefill lays reference text + text (+ tts_eos once ended) over codec bos + reference frames
        track = len(voice.ref_text_ids) + len(feed.ids) + feed.ended
        feed.consumed = min(voice.ref_codes.shape[0] + 1, track) - len(voice.ref_text_ids)
        if feed.consumed < 0:
            raise RequestError("the reference transcript has more tokens than its audio has frames")

    def _batch(self, streams: list[_Stream]) -> StepBatch:
        device = self.tts.device

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return StepBatch(
            slots=column([s.slot for s in streams]),
            positions=column([s.prompt.prefill.shape[0] + s.frames for s in streams]),
            frame_index=column([s.frames for s in streams]),
            text_ids=column([s.text_id() for s in streams]),
            sampling=BatchSampling.of([s.sampling for s in streams], device),
        )

    def _chunk_due(self, decoded_frames: int) -> int:
        """Chunks grow with the audio already out (1, 1, 2, 4, ... frames): each one is due before the audio in
        front of it has played, and the decoder's fixed cost is amortised as the buffer grows."""
        return min(self.config.chunk_frames, max(self.config.first_chunk_frames, decoded_frames))

    def _chunk_lengths(self) -> tuple[int, ...]:
        """Every chunk length the schedule produces (a final flush may be shorter)."""
        lengths, decoded = [], 0
        while not lengths or lengths[-1] < self.config.chunk_frames:
            lengths.append(self._chunk_due(decoded))
            decoded += lengths[-1]
        return tuple(sorted(set(lengths)))

    def _queue_decodes(self, streams: list[_Stream], held: list[_Stream]) -> None:
        """Queue the decoding of every stream whose next chunk is due, batching streams with the same chunk length;
        a held stream's frames are due at once. A chunk whose length has no decoder graph goes as pieces that have
        one, in order. A batch that raises is retried in halves down to single streams: the decoder's state is only
        written back once a decode has run, and only a stream that fails alone ends."""
        due = [s for s in streams if s.pending and (len(s.pending) >= self._chunk_due(s.decoded_frames) or s.done)]
        due += [s for s in held if s.pending]
        pieces = {stream: self.decoders.pieces(len(stream.pending)) for stream in due}
        with self.decoding.context():
            for piece in range(max(map(len, pieces.values()), default=0)):
                groups: dict[int, list[_Stream]] = {}  # length -> the streams whose piece has that length
                for stream, lengths in pieces.items():
                    if piece < len(lengths) and stream.error is None:
                        groups.setdefault(lengths[piece], []).append(stream)
                for length, group in groups.items():
                    first = {stream: sum(pieces[stream][:piece]) for stream in group}
                    self._isolated(group, partial(self._decode, first=first, length=length), "decoding its audio")
        for stream in due:
            stream.decoded_frames += len(stream.pending)
            stream.pending.clear()

    def _decode(self, streams: list[_Stream], first: dict[_Stream, int], length: int) -> None:
        """Queue the decoding of frames first[s]..first[s]+length of each stream's pending frames."""
        codes = torch.stack([torch.stack(s.pending[first[s]:first[s] + length]) for s in streams])
        audio = self.decoders.decode([s.slot for s in streams], codes)
        samples_per_frame = self.tts.decoder.samples_per_frame
        owners = [(s, (s.decoded_frames + first[s]) * samples_per_frame) for s in streams]
        self._in_flight.append(self.decoding.to_host(owners, audio))

    def _collect(self) -> list[Event]:
        """The queued chunks (waiting for their decode if needed), then the Finished of streams that ended."""
        events: list[Event] = []
        for pending in self._in_flight:
            for (stream, start_sample), samples in zip(pending.owners, pending.wait()):
                if not stream.cancelled:
                    events.append(AudioChunk(stream.request_id, start_sample, samples))
        events += [Finished(s.request_id, s.done, s.frames, s.error) for s in self._finishing if not s.cancelled]
        self._in_flight, self._finishing = [], []
        return events


def _request_failure(error: Exception, stage: str) -> VoxgateError:
    """A request's failure as its typed error; a device fault is the engine's, so it propagates."""
    if isinstance(error, DEVICE_FAULT):
        raise error
    return request_failure(error, stage)
