"""Audio formats the gateway speaks: the model's rate, the encodings, rates and frame sizes each allows, and the
encoded frame every encoder gives out. One place, so the protocol, the encoders and the files agree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

MODEL_SAMPLE_RATE = 24000  # the model's output: float32 mono at 24 kHz
SAMPLE_RATES: dict[str, tuple[int, ...]] = {
    "opus": (8000, 16000, MODEL_SAMPLE_RATE, 48000),
    "pcm_s16le": (8000, 16000, 22050, MODEL_SAMPLE_RATE, 44100, 48000),
    "mulaw": (8000,),
}
DEFAULT_RATES: dict[str, int] = {"opus": MODEL_SAMPLE_RATE, "pcm_s16le": MODEL_SAMPLE_RATE, "mulaw": 8000}
FRAME_MS: dict[str, tuple[int, ...]] = {
    "opus": (10, 20, 40, 60),  # the Opus frame sizes a single packet can carry
    "pcm_s16le": tuple(range(10, 101, 10)),
    "mulaw": (20,),  # PROTOCOL.md: mu-law is 8 kHz in 20 ms frames (160 bytes), what telephony bridges expect
}
OPUS_BITRATES = (6000, 128000)
OPUS_RATE = 48000  # Ogg Opus counts granules and pre-skip at 48 kHz whatever the coded rate

HTTP_FORMATS = ("wav", "pcm", "opus", "flac", "mp3", "aac")  # OpenAI's response_format values
CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "opus": "audio/ogg", "flac": "audio/flac",
                 "mp3": "audio/mpeg", "aac": "audio/aac"}


class UnsupportedFormat(ValueError):
    """An audio format the gateway cannot produce; the message names the bad value and what is allowed."""


def listed(values: tuple[int, ...]) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True)
class AudioFormat:
    encoding: str = "opus"
    sample_rate: int = MODEL_SAMPLE_RATE
    frame_ms: int = 20
    bitrate: int = 24000  # bit/s, Opus only

    def check(self) -> AudioFormat:
        """Self when every field is allowed for its encoding, so a session can validate and assign in one step."""
        if self.encoding not in SAMPLE_RATES:
            raise UnsupportedFormat(f"audio.encoding {self.encoding!r} is not supported; "
                                    f"use one of: {', '.join(SAMPLE_RATES)}")
        if self.sample_rate not in SAMPLE_RATES[self.encoding]:
            raise UnsupportedFormat(f"{self.encoding} does not support sample_rate {_shown(self.sample_rate)}; "
                                    f"allowed: {listed(SAMPLE_RATES[self.encoding])}")
        if self.frame_ms not in FRAME_MS[self.encoding]:
            raise UnsupportedFormat(f"{self.encoding} does not support frame_ms {_shown(self.frame_ms)}; "
                                    f"allowed: {listed(FRAME_MS[self.encoding])}")
        low, high = OPUS_BITRATES
        if self.encoding == "opus" and not low <= self.bitrate <= high:
            raise UnsupportedFormat(f"opus bitrate {_shown(self.bitrate)} is out of range; "
                                    f"allowed: {low} to {high} bit/s")
        return self

    @property
    def frame_samples(self) -> int:
        """Samples per frame at sample_rate (rounded down where frame_ms does not divide it, as 10 ms at 22050 Hz)."""
        return self.sample_rate * self.frame_ms // 1000


class EncodedFrame(NamedTuple):
    """One packet or frame of a stream (a tuple: a chunk of Opus audio is many, made one by one on the event loop)."""
    payload: bytes
    pts: int  # first sample of this frame, at the output rate, from the stream's start
    samples: int  # audio samples it carries at the output rate (padding of a final opus packet included)


def _shown(number: int) -> str:
    """A refused number as an error message shows it: short, however long (10**308 written as 1e308 in JSON)."""
    text = str(number)
    return text if len(text) <= 20 else f"{number:.3g}"


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples as int16, clipped first: out-of-range model output must saturate, not wrap around."""
    return np.rint(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)


def pcm_s16le(samples: np.ndarray) -> bytes:
    """Float samples as little-endian 16-bit PCM bytes (the `pcm_s16le` encoding and the HTTP `pcm` format)."""
    return to_int16(samples).astype("<i2").tobytes()
