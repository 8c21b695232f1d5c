"""Streaming tempo change with the pitch kept (`speed` of `POST /v1/audio/speech`): float32 chunks in as the model
makes them, float32 out, `flush` at the end.

Chosen: FFmpeg's `atempo` filter through PyAV (a WSOLA: windows overlap-added at the offset where they match best).
FFmpeg 7's `atempo` takes factors from 0.5 to 100, so slower factors are chained (0.25 = 0.5 x 0.5). Measured on a
2 s tone (220 Hz and three harmonics, 24 kHz) fed in 40 random chunks, each speed from 0.25 to 4.0:
- pitch: the FFT peak stays at 219.91-220.14 Hz (within 0.07%);
- seams: from 1.0 up the output is the same however the input is chunked (bit for bit); below 1.0 it differs from
  the whole-signal run by at most 0.006 (1.3% of the tone's peak; 300 random chunkings); the largest
  sample-to-sample step stays the tone's own (ratio 1.00), so chunk seams do not click;
- length: the filter alone ends up to 64 ms short (0.25) or 10 ms long (3.0) of input / speed, so `flush` feeds
  the input's last `TAIL_S` once more, mirrored (continuous with the end, where silence would make a step on a
  signal that ends loud), and cuts the output at exactly round(input samples / speed);
- latency: input goes to the filter in 20 ms frames (`FRAME`), and what has come out lags what went in by 40-100 ms
  of input, whatever the chunk sizes (the model's first chunk, 80 ms, gives some out up to 3.0);
- cost: 6-16 ms of CPU per 2 s of audio fed in 80 ms chunks (0.25, two filters: 100 ms).
A numpy WSOLA of our own would have to match all of this; Rubber Band is a C++ dependency PyAV does not bundle."""
from __future__ import annotations

import math

import av
import numpy as np
from av.audio.frame import AudioFrame

from realtime.audio.formats import MODEL_SAMPLE_RATE

SPEED_RANGE = (0.25, 4.0)  # OpenAI's
ATEMPO_RANGE = (0.5, 100.0)  # one FFmpeg `atempo` filter's
FRAME = 480  # samples per frame given to the filter: it fills an output buffer the size of one input frame's
#   output before giving it out, so a whole model chunk (up to 640 ms) at once would come out a chunk late
MIN_FRAME = 16  # samples: `atempo` fails (ENOMEM) on a frame it would shrink to none, so tiny chunks wait
TAIL_S = 0.1  # fed (mirrored) at the end so that the filter gives out all of the input (its window is ~40 ms)


class TimeStretch:
    """One stream's tempo change by `speed` (2.0: twice as fast, half as long): `feed` chunks, then `flush` once."""

    def __init__(self, speed: float, sample_rate: int = MODEL_SAMPLE_RATE) -> None:
        low, high = SPEED_RANGE
        if not low <= speed <= high:
            raise ValueError(f"speed must be from {low} to {high}, not {speed}")
        self.speed, self.sample_rate = speed, sample_rate
        self._graph = _atempo_graph(speed, sample_rate)
        self._tail_samples = math.ceil(TAIL_S * sample_rate)
        self._samples_in = 0
        self._samples_out = 0
        self._last = np.zeros(0, np.float32)  # the input's last TAIL_S, mirrored into the tail at the end
        self._pending = np.zeros(0, np.float32)  # fewer than MIN_FRAME samples, not yet given to the filter
        self._flushed = False

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """The stretched audio the filter can give out so far (often none at first: it holds a window)."""
        if self._flushed:
            raise RuntimeError("this stream was flushed")
        if len(samples) == 0:
            return np.zeros(0, np.float32)
        samples = np.asarray(samples, np.float32)
        self._samples_in += len(samples)
        self._last = np.concatenate([self._last, samples])[-self._tail_samples:]
        self._pending = np.concatenate([self._pending, samples])
        if len(self._pending) < MIN_FRAME:
            return np.zeros(0, np.float32)
        self._push(self._pending)
        self._pending = np.zeros(0, np.float32)
        return self._take(self._pull())

    def flush(self) -> np.ndarray:
        """The rest, so that the whole output is exactly round(samples fed / speed) long."""
        if self._flushed:
            raise RuntimeError("this stream was flushed")
        self._flushed = True
        if len(self._last):
            self._push(np.concatenate([self._pending, self._last[::-1]]))
        self._graph.push(None)
        rest = self._pull()
        missing = round(self._samples_in / self.speed) - self._samples_out - len(rest)
        if missing > 0:  # an input shorter than the filter's window: its tail is as short
            rest = np.concatenate([rest, np.zeros(missing, np.float32)])
        return self._take(rest)

    def _push(self, samples: np.ndarray) -> None:
        for start in range(0, len(samples), FRAME):
            frame = AudioFrame.from_ndarray(samples[start:start + FRAME].reshape(1, -1), format="flt", layout="mono")
            frame.sample_rate = self.sample_rate
            self._graph.push(frame)

    def _pull(self) -> np.ndarray:
        pieces = []
        while True:
            try:
                pieces.append(self._graph.pull().to_ndarray().reshape(-1))
            except (av.BlockingIOError, av.EOFError):
                break
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    def _take(self, samples: np.ndarray) -> np.ndarray:
        """`samples`, cut where the output reaches its length: what follows is the silent tail's."""
        if self._flushed:
            samples = samples[:max(round(self._samples_in / self.speed) - self._samples_out, 0)]
        self._samples_out += len(samples)
        return samples


def atempo_factors(speed: float) -> list[float]:
    """`speed` as a product of factors one `atempo` takes, as few as can be."""
    low, high = ATEMPO_RANGE
    factors = []
    while speed < low:
        factors.append(low)
        speed /= low
    while speed > high:
        factors.append(high)
        speed /= high
    return [*factors, speed]


def _atempo_graph(speed: float, sample_rate: int) -> av.filter.Graph:
    graph = av.filter.Graph()
    graph.threads = 1  # a few ms of work a chunk: no thread pool (realtime/audio/ffmpeg.py)
    chain = [graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono", time_base=f"1/{sample_rate}")]
    chain += [graph.add("atempo", repr(factor)) for factor in atempo_factors(speed)]
    chain.append(graph.add("abuffersink"))
    for node, following in zip(chain, chain[1:]):
        node.link_to(following)
    graph.configure()
    return graph
