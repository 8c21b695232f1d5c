"""Per-slot streaming codec-decoder states, decoded in batches.

Each slot keeps its own exact streaming state (sliding-window K/V, conv histories, position); a decode call gathers
the states of the requests it serves, runs them as one batch and scatters them back, so requests that joined at
different times share one decoder pass and each still hears exactly its offline decode. A slot's state tensors are
views of one row of the pool (`PackedState`): a call gathers its rows in one copy, the decoder writes the state it
leaves into a second batch of rows (`DecoderState.next`), and one copy scatters those back.

With `capture=True` (CUDA), the gather-decode-scatter of each (batch bucket, chunk length) is one CUDA graph, so a
decode call costs one launch instead of one per op of the decoder. Batches are padded onto a scratch slot, as the
frame step's are; a chunk of another length (a final flush) is split into captured lengths by `pieces`, and only a
voice-clone reference (once per request) runs eagerly.

Without a graph, each request is decoded in calls of its own, one frame a call: the CPU's convolution and matrix
kernels (oneDNN, MKL) choose their algorithm by the batch size and the length, so a batched decode gave a request
audio that differed, by ~1e-6, with what it was batched with (`scripts/bench_engine.py --parts invariance`), and a
chunk of several frames audio that differed with how its frames were chunked (which follows when its text came),
against PROTOCOL.md's promise of identical fp32 audio however the text was split and the server batched it.
"""
from __future__ import annotations

import math

import torch

from engine.model.codec_decoder import CodecDecoder, DecoderState
from engine.transfer import upload

DECODER_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# A call of more rows than the largest graph runs as slices of it: the 256-row graphs' memory pool took 4.8 GiB of
# the GPU more than the 128-row ones (`scripts/gpu_memory.py`, docs/benchmarks.md), room for 20 more KV slots.
# cuDNN algorithms timed per convolution shape at capture: its 3 best-ranked were as fast as its default 10, and the
# server starts 13 s sooner (docs/benchmarks.md)
BENCHMARK_LIMIT = 3


class _Graph:
    def __init__(self, size: int, frames: int, scratch: int, quantizers: int, device: torch.device) -> None:
        self.slots = torch.full((size,), scratch, dtype=torch.long, device=device)
        self.codes = torch.zeros(size, frames, quantizers, dtype=torch.long, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.audio: torch.Tensor | None = None


class PackedState:
    """Where each state tensor of one slot lies in a row of model-dtype values: the histories channels-minor (as the
    fast path's convolutions write them), the key and value windows as they are; each part starts at a multiple of
    16 bytes."""

    ALIGN = 8  # elements

    def __init__(self, template: DecoderState) -> None:
        self.parts: list[tuple[int, tuple[int, ...]]] = []  # (offset, shape of one slot's tensor)
        width = 0
        for tensor in [*template.history.values(), *template.keys, *template.values]:
            self.parts.append((width, tuple(tensor.shape[1:])))
            width += -(-tensor[0].numel() // self.ALIGN) * self.ALIGN
        self.width = width
        self.names = list(template.history)
        self.layers = len(template.keys)

    def views(self, rows: torch.Tensor, position: torch.Tensor) -> DecoderState:
        """A DecoderState whose tensors are views of `rows` [B, width]."""
        tensors = [self._view(rows, offset, shape) for offset, shape in self.parts]
        histories, windows = tensors[:len(self.names)], tensors[len(self.names):]
        return DecoderState(position=position, history=dict(zip(self.names, histories)),
                            keys=windows[:self.layers], values=windows[self.layers:])

    def _view(self, rows: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        part = rows[:, offset:offset + math.prod(shape)]
        if len(shape) == 2:  # a history [C, context], stored [context, C]
            channels, context = shape
            return part.unflatten(1, (context, channels)).transpose(1, 2)
        return part.unflatten(1, shape)


class DecoderPool:
    def __init__(self, decoder: CodecDecoder, slots: int, device: torch.device, dtype: torch.dtype,
                 capture: bool = False, chunk_lengths: tuple[int, ...] = ()) -> None:
        self.decoder = decoder
        self.scratch_slot = slots  # padding rows of graphed batches decode into this extra state
        template = decoder.new_state(1, device, dtype)
        codes = torch.zeros(1, 1, decoder.cfg.num_quantizers, dtype=torch.long, device=device)
        with torch.inference_mode():
            decoder.decode_step(codes, template)  # creates every conv history, so their shapes are known
        self.packing = PackedState(template)
        self.rows = torch.zeros(slots + 1, self.packing.width, dtype=dtype, device=device)
        self.position = torch.zeros(slots + 1, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.graphed_lengths = tuple(sorted(chunk_lengths, reverse=True)) if capture else ()
        if capture:
            self._capture(slots, chunk_lengths, device)

    def pieces(self, frames: int) -> list[int]:
        """Split a chunk into lengths that have a graph (largest first), so that no regular decode runs eagerly."""
        if not self.graphed_lengths or frames in self.graphed_lengths:
            return [frames]
        out = []
        for length in self.graphed_lengths:
            while frames >= length:
                out.append(length)
                frames -= length
        return out + ([frames] if frames else [])

    def reset(self, slots: list[int]) -> None:
        """Fresh states for `slots`: their rows and positions zeroed by a multi-tensor kernel each (no index to
        upload: a request's time to first audio waits for this)."""
        if not slots:
            return
        torch._foreach_zero_([self.rows[slot] for slot in slots])
        torch._foreach_zero_([self.position[slot] for slot in slots])

    @torch.inference_mode()
    def decode(self, slots: list[int], codes: torch.Tensor) -> torch.Tensor:
        """codes [B, n, 16] (host) for the requests in `slots` -> waveform [B, n * samples_per_frame] (device).

        The inputs go up from pinned memory, so a call queued on a side stream never waits for the host."""
        rows, frames = codes.shape[:2]
        device = self.rows.device
        index, codes = (upload(torch.tensor(slots), device), upload(codes, device))
        largest = max((size for size, length in self.graphs if length == frames), default=0)
        if not largest:  # one request and one frame a call: audio however batched and chunked (module docstring)
            return torch.cat([torch.cat([self._decode(index[row:row + 1], codes[row:row + 1, frame:frame + 1])
                                         for frame in range(frames)], dim=1) for row in range(rows)])
        if rows <= largest:
            return self._replay(index, codes)
        # each slice's audio is copied out before the next replay: the graphs share one memory pool, so any replay
        # may overwrite another graph's output
        return torch.cat([self._replay(index[at:at + largest], codes[at:at + largest]).clone()
                          for at in range(0, rows, largest)])

    @torch.inference_mode()
    def prime(self, slot: int, codes: torch.Tensor) -> None:
        """A voice-clone reference's frames [n, 16] (host) as the slot's left context, never heard: one eager call,
        the same for every request of that voice."""
        device = self.rows.device
        self._decode(upload(torch.tensor([slot]), device), upload(codes[None], device))

    def _replay(self, index: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The graph of the smallest bucket that holds these rows, replayed; its output, valid until the next replay
        of any graph of the pool."""
        rows, frames = codes.shape[:2]
        graph = self.graphs[(next(b for b in DECODER_BUCKETS if b >= rows), frames)]
        graph.slots[:rows].copy_(index)
        graph.slots[rows:] = self.scratch_slot
        graph.codes[:rows].copy_(codes)
        graph.graph.replay()
        return graph.audio[:rows]

    def _decode(self, index: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The rows `index` gathered, decoded into a second batch of rows, and those scattered back."""
        dense = torch.arange(len(index), device=index.device)
        before = self.rows.new_empty(len(index), self.packing.width)
        after = torch.empty_like(before)
        _copy_rows(self.rows, index, before, dense)
        state = self.packing.views(before, self.position[index])
        state.next = self.packing.views(after, state.position)
        audio = self.decoder.decode_step(codes, state)
        _copy_rows(after, dense, self.rows, index)
        self.position[index] = state.position
        return audio

    @torch.inference_mode()
    def _capture(self, slots: int, chunk_lengths: tuple[int, ...], device: torch.device) -> None:
        """The graphs run the decoder's fast path (`CodecDecoder.use_fast_path`) with the convolution algorithms
        timed here; eager calls (a voice-clone reference, once per request) keep the plain path: without timing, cuDNN's
        heuristics pick channels-last kernels 7-16x slower than the plain path's (docs/benchmarks.md)."""
        self.decoder.use_fast_path()
        try:
            self._capture_graphs(slots, chunk_lengths, device)
        finally:
            self.decoder.use_fast_path(False)

    def _capture_graphs(self, slots: int, chunk_lengths: tuple[int, ...], device: torch.device) -> None:
        stream = torch.cuda.Stream()
        pool = torch.cuda.graph_pool_handle()  # replays run in order on one stream; each output is copied out first
        quantizers = self.decoder.cfg.num_quantizers
        for size, frames in [(b, n) for b in DECODER_BUCKETS if b <= slots for n in chunk_lengths]:
            # the fastest conv kernels, timed once; the other cuDNN settings as they are
            with torch.backends.cudnn.flags(enabled=True, benchmark=True, benchmark_limit=BENCHMARK_LIMIT,
                                            deterministic=torch.backends.cudnn.deterministic,
                                            allow_tf32=torch.backends.cudnn.allow_tf32):
                graph = _Graph(size, frames, self.scratch_slot, quantizers, device)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._decode(graph.slots, graph.codes)  # warm-up outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(graph.graph, pool=pool, stream=stream):
                    graph.audio = self._decode(graph.slots, graph.codes)
            self.graphs[(size, frames)] = graph
        self.stream = stream
        torch.cuda.synchronize()
        self.reset([self.scratch_slot])


def _copy_rows(source: torch.Tensor, source_rows: torch.Tensor, target: torch.Tensor, target_rows: torch.Tensor
               ) -> None:
    """target[target_rows] = source[source_rows]: one Triton launch on a GPU (`engine/kernels/rows.py`)."""
    if source.is_cuda:
        from engine.kernels.rows import copy_rows  # imported here: Triton only where it runs
        copy_rows(source, source_rows, target, target_rows)
    else:
        target.index_copy_(0, target_rows, source.index_select(0, source_rows))


