"""Per-slot streaming codec-decoder states, decoded in batches.

Each slot keeps its own exact streaming state (sliding-window K/V, conv histories, position); a decode call gathers
the states of the requests it serves, runs them as one batch and scatters them back, so requests that joined at
different times share one decoder pass and each still hears exactly its offline decode.

With `capture=True` (CUDA), the gather-decode-scatter of each (batch bucket, chunk length) is one CUDA graph, so a
decode call costs one launch instead of one per op of the decoder. Batches are padded onto a scratch slot, as the
frame step's are; a chunk of another length (a final flush) is split into captured lengths by `pieces`, and only a
voice-clone reference (once per request) runs eagerly.

Without a graph, each request is decoded in a call of its own: the CPU's convolution and matrix kernels (oneDNN, MKL)
choose their algorithm by batch size, so a batched decode gave a request audio that differed, by ~1e-6, with what it
was batched with, against PROTOCOL.md's promise of identical fp32 audio however the server batches
(`scripts/bench_engine.py --parts invariance`).
"""
from __future__ import annotations

import torch

from engine.model.codec_decoder import CodecDecoder, DecoderState

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


class DecoderPool:
    def __init__(self, decoder: CodecDecoder, slots: int, device: torch.device, dtype: torch.dtype,
                 capture: bool = False, chunk_lengths: tuple[int, ...] = ()) -> None:
        self.decoder = decoder
        self.scratch_slot = slots  # padding rows of graphed batches decode into this extra state
        template = decoder.new_state(1, device, dtype)
        codes = torch.zeros(1, 1, decoder.cfg.num_quantizers, dtype=torch.long, device=device)
        with torch.inference_mode():
            decoder.decode_step(codes, template)  # creates every conv history, so their shapes are known

        def pooled(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((slots + 1, *t.shape[1:]), dtype=t.dtype, device=device)

        self.state = DecoderState(
            position=torch.zeros(slots + 1, dtype=torch.long, device=device),
            history={name: pooled(t) for name, t in template.history.items()},
            keys=[pooled(t) for t in template.keys],
            values=[pooled(t) for t in template.values],
        )
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.graphed_lengths = tuple(sorted(chunk_lengths, reverse=True)) if capture else ()
        if capture:
            self._capture(slots, chunk_lengths, device)

    def _tensors(self, state: DecoderState) -> list[torch.Tensor]:
        return [state.position, *state.history.values(), *state.keys, *state.values]

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
        """Fresh states for `slots`: a multi-tensor kernel per dtype (the fast path wants one dtype) rather than a
        fill per state tensor and slot, ~60 launches a request's time to first audio waited for."""
        views = [tensor[slot] for slot in slots for tensor in self._tensors(self.state)]
        for dtype in {view.dtype for view in views}:
            torch._foreach_zero_([view for view in views if view.dtype == dtype])

    @torch.inference_mode()
    def decode(self, slots: list[int], codes: torch.Tensor) -> torch.Tensor:
        """codes [B, n, 16] (host) for the requests in `slots` -> waveform [B, n * samples_per_frame] (device).

        The inputs go up from pinned memory, so a call queued on a side stream never waits for the host."""
        rows, frames = codes.shape[:2]
        device = self.state.position.device
        index, codes = (_upload(torch.tensor(slots), device), _upload(codes, device))
        largest = max((size for size, length in self.graphs if length == frames), default=0)
        if not largest:  # one request a call: batch-invariant audio (module docstring)
            return torch.cat([self._decode(index[row:row + 1], codes[row:row + 1]) for row in range(rows)])
        if rows <= largest:
            return self._replay(index, codes)
        # each slice's audio is copied out before the next replay: the graphs share one memory pool, so any replay
        # may overwrite another graph's output
        return torch.cat([self._replay(index[at:at + largest], codes[at:at + largest]).clone()
                          for at in range(0, rows, largest)])

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
        state = DecoderState(
            position=self.state.position[index],
            history={name: t[index] for name, t in self.state.history.items()},
            keys=[t[index] for t in self.state.keys],
            values=[t[index] for t in self.state.values],
        )
        audio = self.decoder.decode_step(codes, state)
        for pool, updated in zip(self._tensors(self.state), self._tensors(state)):
            pool[index] = updated
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


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
