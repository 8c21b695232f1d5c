"""One context's audio, encoded as it comes: the model's samples resampled and cut into Opus packets, PCM s16le or
mu-law frames.

A `StreamEncoder` is stateful (resampler filter memory, Opus encoder state, a partial frame), so one context's audio
must go through one encoder, in order; frames come out with their pts so the session can write its binary headers.
"""
from __future__ import annotations

import functools

import numpy as np
import opuslib_next as opuslib
import soxr

from realtime.audio.formats import MODEL_SAMPLE_RATE, AudioFormat, EncodedFrame, to_int16
from realtime.audio.mulaw import mulaw_encode

# 1.8x less CPU per stream than libopus's default (9) for speech at 24 kbit/s, at 0.1 dB more spectral distance
OPUS_COMPLEXITY = 5
# Opus's modes: "celt" alone (libopus's restricted-low-delay application), or "speech" (libopus picks SILK, hybrid
# or CELT, told the signal is a voice). At 24 and 48 kHz CELT alone takes ~0.35x the CPU of the speech modes and
# 4 ms less codec delay (a 2.5 ms lookahead, not 6.5), for ~0.3 dB more spectral distance on synthetic speech at
# 24 kbit/s; at 8 and 16 kHz SILK is much the better coder and cheap already (docs/benchmarks.md, "Opus modes").
# Below 16 kbit/s the speech modes stay: there libopus itself prefers SILK for a voice, a difference in what a
# listener hears that the synthetic measures here do not show.
OPUS_MODES = ("celt", "speech")
CELT_RATES = frozenset((24000, 48000))
CELT_MIN_BITRATE = 16000


def opus_mode(fmt: AudioFormat) -> str:
    """The gateway's Opus mode for a format (its rate and bitrate)."""
    return "celt" if fmt.sample_rate in CELT_RATES and fmt.bitrate >= CELT_MIN_BITRATE else "speech"


def _opus_encoder(fmt: AudioFormat, complexity: int, mode: str) -> opuslib.Encoder:
    if mode not in OPUS_MODES:
        raise ValueError(f"unknown Opus mode {mode!r}; one of {OPUS_MODES}")
    if mode == "celt":
        encoder = opuslib.Encoder(fmt.sample_rate, 1, opuslib.APPLICATION_RESTRICTED_LOWDELAY)
    else:
        encoder = opuslib.Encoder(fmt.sample_rate, 1, opuslib.APPLICATION_AUDIO)
        encoder.signal = opuslib.SIGNAL_VOICE  # the model speaks: let the encoder favour its speech modes
    encoder.complexity = complexity
    encoder.bitrate = fmt.bitrate
    encoder.vbr = 1
    return encoder


@functools.lru_cache(maxsize=None)
def pre_skip(fmt: AudioFormat) -> int:
    """Samples at the output rate that a decoder drops at the start of a stream of `fmt` (the Opus encoder's
    lookahead; 0 for other encodings), as `session.started` tells it: the same for every stream of a format, so a
    session's start does not build an encoder to ask (8% of the event loop's time in a storm of session starts)."""
    return StreamEncoder(fmt).pre_skip


class StreamEncoder:
    """One context's audio: stateful resampler + encoder."""

    def __init__(self, fmt: AudioFormat, complexity: int = OPUS_COMPLEXITY, mode: str | None = None):
        """`complexity`: libopus's, 0..10; `mode`: one of OPUS_MODES, None: `opus_mode` of the format
        (scripts/bench_opus.py measures what each costs)."""
        self.format = fmt.check()
        self._resampler = None
        if fmt.sample_rate != MODEL_SAMPLE_RATE:
            self._resampler = soxr.ResampleStream(MODEL_SAMPLE_RATE, fmt.sample_rate, 1, dtype="float32",
                                                  quality="HQ")
        self._opus = None
        if fmt.encoding == "opus":
            self._opus = _opus_encoder(fmt, complexity, mode or opus_mode(fmt))
        self.pre_skip = self._opus.lookahead if self._opus is not None else 0
        self._pending = np.zeros(0, np.float32)  # output-rate samples short of a whole frame
        self._samples_out = 0
        self._finished = False

    @property
    def samples_out(self) -> int:
        """Total samples emitted so far (sum of frame.samples)."""
        return self._samples_out

    def encode(self, samples: np.ndarray) -> list[EncodedFrame]:
        """The complete frames that `samples` (float32, 24 kHz, any length) finish; the rest waits for more."""
        if self._finished:
            raise RuntimeError("StreamEncoder.encode() after finish()")
        self._append(self._resample(np.asarray(samples, dtype=np.float32).reshape(-1), last=False))
        return self._take_frames(final=False)

    def finish(self, whole_frame: bool = False) -> list[EncodedFrame]:
        """The stream's last frames: the resampler's tail, for Opus the encoder's lookahead pushed out with silence
        (else the decoder, which drops `pre_skip` samples at the start, would lose the end). The remainder is padded
        with silence to a whole frame for Opus always, for PCM and mu-law with `whole_frame` (a flush in the middle
        of a context: only a context's last frame may be shorter)."""
        if self._finished:
            return []
        self._finished = True
        self._append(self._resample(np.zeros(0, np.float32), last=True))
        if self._opus is not None and (self._samples_out or len(self._pending)):
            self._append(np.zeros(self.pre_skip, np.float32))
        return self._take_frames(final=True, pad=whole_frame or self._opus is not None)

    def _resample(self, samples: np.ndarray, last: bool) -> np.ndarray:
        if self._resampler is None:
            return samples
        return self._resampler.resample_chunk(samples, last=last)

    def _append(self, samples: np.ndarray) -> None:
        if len(samples):
            self._pending = np.concatenate([self._pending, samples])

    def _take_frames(self, final: bool, pad: bool = False) -> list[EncodedFrame]:
        """Whole frames off the pending samples; with `final`, also the remainder (with `pad`, as a whole frame)."""
        size = self.format.frame_samples
        count, rest = divmod(len(self._pending), size)
        if final and rest:
            count += 1
            if pad:
                self._append(np.zeros(size - rest, np.float32))
        frames = [self._frame(self._pending[i * size:(i + 1) * size]) for i in range(count)]
        self._pending = self._pending[count * size:]
        return frames

    def _frame(self, samples: np.ndarray) -> EncodedFrame:
        pcm = to_int16(samples)
        if self._opus is not None:
            payload = self._opus.encode(pcm.tobytes(), len(pcm))
        elif self.format.encoding == "mulaw":
            payload = mulaw_encode(pcm)
        else:
            payload = pcm.astype("<i2").tobytes()
        frame = EncodedFrame(payload, self._samples_out, len(pcm))
        self._samples_out += len(pcm)
        return frame
