"""Audio out of the gateway: the model's float32 24 kHz mono samples resampled and encoded per context (Opus packets,
PCM s16le or G.711 mu-law frames), Ogg Opus files, and the whole-utterance files of `POST /v1/audio/speech`.

A `StreamEncoder` is stateful (resampler filter memory, Opus encoder state, a partial frame), so one context's audio
must go through one encoder, in order; frames come out with their pts so the session can write its binary headers.
"""
from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np
import opuslib_next as opuslib
import soundfile
import soxr

MODEL_SAMPLE_RATE = 24000
SAMPLE_RATES: dict[str, tuple[int, ...]] = {
    "opus": (8000, 16000, 24000, 48000),
    "pcm_s16le": (8000, 16000, 22050, 24000, 44100, 48000),
    "mulaw": (8000,),
}
DEFAULT_RATES: dict[str, int] = {"opus": 24000, "pcm_s16le": 24000, "mulaw": 8000}
FRAME_MS: dict[str, tuple[int, ...]] = {
    "opus": (10, 20, 40, 60),  # the Opus frame sizes a single packet can carry
    "pcm_s16le": tuple(range(10, 101, 10)),
    "mulaw": tuple(range(10, 101, 10)),
}
OPUS_BITRATES = (6000, 128000)
OPUS_RATE = 48000  # Ogg Opus counts granules and pre-skip at 48 kHz whatever the coded rate

HTTP_FORMATS = ("wav", "pcm", "opus", "flac", "mp3")
CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "opus": "audio/ogg", "flac": "audio/flac",
                 "mp3": "audio/mpeg"}


class UnsupportedFormat(ValueError):
    """An audio format the gateway cannot produce; the message names the bad value and what is allowed."""


def _listed(values: tuple[int, ...]) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True)
class AudioFormat:
    encoding: str = "opus"
    sample_rate: int = 24000
    frame_ms: int = 20
    bitrate: int = 24000  # bit/s, Opus only

    def check(self) -> AudioFormat:
        """Self when every field is allowed for its encoding, so a session can validate and assign in one step."""
        if self.encoding not in SAMPLE_RATES:
            raise UnsupportedFormat(f"audio.encoding {self.encoding!r} is not supported; "
                                    f"use one of: {', '.join(SAMPLE_RATES)}")
        if self.sample_rate not in SAMPLE_RATES[self.encoding]:
            raise UnsupportedFormat(f"{self.encoding} does not support sample_rate {self.sample_rate}; "
                                    f"allowed: {_listed(SAMPLE_RATES[self.encoding])}")
        if self.frame_ms not in FRAME_MS[self.encoding]:
            raise UnsupportedFormat(f"{self.encoding} does not support frame_ms {self.frame_ms}; "
                                    f"allowed: {_listed(FRAME_MS[self.encoding])}")
        low, high = OPUS_BITRATES
        if self.encoding == "opus" and not low <= self.bitrate <= high:
            raise UnsupportedFormat(f"opus bitrate {self.bitrate} is out of range; allowed: {low} to {high} bit/s")
        return self

    @property
    def frame_samples(self) -> int:
        """Samples per frame at sample_rate (rounded down where frame_ms does not divide it, as 10 ms at 22050 Hz)."""
        return self.sample_rate * self.frame_ms // 1000


@dataclass(frozen=True)
class EncodedFrame:
    payload: bytes
    pts: int  # first sample of this frame, at the output rate, from the stream's start
    samples: int  # audio samples it carries at the output rate (padding of a final opus packet included)


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples as int16, clipped first: out-of-range model output must saturate, not wrap around."""
    return np.rint(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)


# --- G.711 mu-law ----------------------------------------------------------------------------------------------

_MULAW_BIAS = 0x84
_MULAW_CLIP = 32635


def mulaw_encode(pcm16: np.ndarray) -> bytes:
    """G.711 mu-law bytes of int16 samples (audioop is gone from Python 3.13, so numpy does it)."""
    pcm = np.asarray(pcm16, dtype=np.int32)
    sign = np.where(pcm < 0, 0x80, 0)
    magnitude = np.minimum(np.abs(pcm), _MULAW_CLIP) + _MULAW_BIAS
    exponent = np.frexp(np.maximum(magnitude >> 7, 1))[1] - 1  # segment: position of the top bit above 7
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8).tobytes()


def mulaw_decode(data: bytes) -> np.ndarray:
    """int16 samples of G.711 mu-law bytes."""
    code = ~np.frombuffer(data, dtype=np.uint8).astype(np.int32) & 0xFF
    exponent = (code >> 4) & 0x07
    magnitude = ((((code & 0x0F) << 3) + _MULAW_BIAS) << exponent) - _MULAW_BIAS
    return np.where(code & 0x80, -magnitude, magnitude).astype(np.int16)


# --- streaming -------------------------------------------------------------------------------------------------

def _opus_encoder(fmt: AudioFormat) -> opuslib.Encoder:
    encoder = opuslib.Encoder(fmt.sample_rate, 1, opuslib.APPLICATION_AUDIO)
    encoder.bitrate = fmt.bitrate
    encoder.vbr = 1
    encoder.signal = opuslib.SIGNAL_VOICE  # the model speaks: let the encoder favour its speech modes
    return encoder


class StreamEncoder:
    """One context's audio: stateful resampler + encoder."""

    def __init__(self, fmt: AudioFormat):
        self.format = fmt.check()
        self._resampler = None
        if fmt.sample_rate != MODEL_SAMPLE_RATE:
            self._resampler = soxr.ResampleStream(MODEL_SAMPLE_RATE, fmt.sample_rate, 1, dtype="float32",
                                                  quality="HQ")
        self._opus = _opus_encoder(fmt) if fmt.encoding == "opus" else None
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

    def finish(self) -> list[EncodedFrame]:
        """The stream's last frames: the resampler's tail, for Opus the encoder's lookahead pushed out with silence
        (else the decoder, which drops `pre_skip` samples at the start, would lose the end)."""
        if self._finished:
            return []
        self._finished = True
        self._append(self._resample(np.zeros(0, np.float32), last=True))
        if self._opus is not None and (self._samples_out or len(self._pending)):
            self._append(np.zeros(self.pre_skip, np.float32))
        return self._take_frames(final=True)

    def _resample(self, samples: np.ndarray, last: bool) -> np.ndarray:
        if self._resampler is None:
            return samples
        return self._resampler.resample_chunk(samples, last=last)

    def _append(self, samples: np.ndarray) -> None:
        if len(samples):
            self._pending = np.concatenate([self._pending, samples])

    def _take_frames(self, final: bool) -> list[EncodedFrame]:
        """Whole frames off the pending samples; with `final`, also the remainder (padded to a full Opus packet)."""
        size = self.format.frame_samples
        count, rest = divmod(len(self._pending), size)
        if final and rest:
            count += 1
            if self._opus is not None:
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


# --- Ogg Opus (RFC 7845) ---------------------------------------------------------------------------------------

OGG_SERIAL = 0x766F7867  # one logical stream per file, so a fixed serial is valid and keeps files reproducible
OGG_PAGE_GRANULES = OPUS_RATE  # audio per page: about a second, like opusenc
OGG_BOS, OGG_EOS = 0x02, 0x04  # header-type flags: first and last page of the stream


def _ogg_crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7 if crc & 0x80000000 else crc << 1) & 0xFFFFFFFF
        table.append(crc)
    return tuple(table)


_OGG_CRC_TABLE = _ogg_crc_table()


def ogg_crc(data: bytes) -> int:
    """Ogg's page checksum: CRC-32, polynomial 0x04C11DB7, not reflected, zero start, no final xor."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _OGG_CRC_TABLE[(crc >> 24) ^ byte]
    return crc


def _lacing(packet: bytes) -> bytes:
    """A packet's segment-table entries: 255 per full segment, then the remainder (0 ends a multiple of 255)."""
    return bytes([255] * (len(packet) // 255) + [len(packet) % 255])


def _ogg_page(packets: list[bytes], flags: int, granule: int, sequence: int) -> bytes:
    segments = b"".join(_lacing(p) for p in packets)
    header = struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, OGG_SERIAL, sequence, 0, len(segments))
    page = header + segments + b"".join(packets)
    return page[:22] + struct.pack("<I", ogg_crc(page)) + page[26:]


def _opus_head(sample_rate: int, pre_skip_48k: int) -> bytes:
    return struct.pack("<8sBBHIhB", b"OpusHead", 1, 1, pre_skip_48k, sample_rate, 0, 0)


def _opus_tags() -> bytes:
    vendor = b"voxgate"
    return b"OpusTags" + struct.pack("<I", len(vendor)) + vendor + struct.pack("<I", 0)


def _audio_pages(frames: list[EncodedFrame], scale: int) -> list[tuple[list[bytes], int]]:
    """Packets grouped into pages of about a second (never over 255 segments), each with its end in 48 kHz units
    counted from the first decoded sample."""
    pages: list[tuple[list[bytes], int]] = []
    packets: list[bytes] = []
    segments = start = end = 0
    for frame in frames:
        laced = len(frame.payload) // 255 + 1
        if packets and (segments + laced > 255 or end - start >= OGG_PAGE_GRANULES):
            pages.append((packets, end))
            packets, segments, start = [], 0, end
        packets.append(frame.payload)
        segments += laced
        end += frame.samples * scale
    if packets:
        pages.append((packets, end))
    return pages


def _final_granule(frames: list[EncodedFrame], scale: int, pre_skip: int, total_samples: int | None) -> int:
    """Where decoding stops: all audio carried, or exactly pre_skip + total_samples, which must end inside the
    last packet (so no page's granule goes backwards)."""
    carried = sum(f.samples for f in frames)
    if total_samples is None:
        return carried * scale
    end = pre_skip + total_samples
    if not carried - frames[-1].samples < end <= carried:
        raise ValueError(f"total_samples {total_samples} must end inside the last packet: above "
                         f"{carried - frames[-1].samples - pre_skip}, at most {carried - pre_skip}")
    return end * scale


def ogg_opus(frames: list[EncodedFrame], sample_rate: int, pre_skip: int, total_samples: int | None = None) -> bytes:
    """A complete Ogg Opus file of one stream's packets. `pre_skip` and `total_samples` are at `sample_rate`; with
    `total_samples` the last granule trims the final packet's padding exactly."""
    if sample_rate not in SAMPLE_RATES["opus"]:
        raise UnsupportedFormat(f"Ogg Opus needs an Opus sample rate; allowed: {_listed(SAMPLE_RATES['opus'])}")
    scale = OPUS_RATE // sample_rate
    if not frames:
        raise ValueError("an Ogg Opus stream needs at least one packet")
    out = [_ogg_page([_opus_head(sample_rate, pre_skip * scale)], OGG_BOS, 0, 0), _ogg_page([_opus_tags()], 0, 0, 1)]
    pages = _audio_pages(frames, scale)
    for index, (packets, end) in enumerate(pages):
        last = index == len(pages) - 1
        granule = _final_granule(frames, scale, pre_skip, total_samples) if last else end
        out.append(_ogg_page(packets, OGG_EOS if last else 0, granule, index + 2))
    return b"".join(out)


# --- whole files -----------------------------------------------------------------------------------------------

def mp3_available() -> bool:
    """Whether this libsndfile can write MP3 (it needs LAME at build time)."""
    return "MP3" in soundfile.available_formats()


def _soundfile_bytes(pcm: np.ndarray, container: str, subtype: str) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, pcm, MODEL_SAMPLE_RATE, format=container, subtype=subtype)
    return buffer.getvalue()


def _ogg_opus_file(samples: np.ndarray) -> bytes:
    encoder = StreamEncoder(AudioFormat())
    # decoders refuse a stream without packets: no audio is one sample of silence, trimmed away by the last granule
    frames = encoder.encode(samples if len(samples) else np.zeros(1, np.float32)) + encoder.finish()
    return ogg_opus(frames, MODEL_SAMPLE_RATE, encoder.pre_skip, total_samples=len(samples))


def encode_file(samples: np.ndarray, response_format: str) -> tuple[bytes, str]:
    """(file bytes, content type) of a whole utterance (float32, 24 kHz), for `POST /v1/audio/speech`."""
    if response_format not in HTTP_FORMATS:
        raise UnsupportedFormat(f"response_format {response_format!r} is not supported; "
                                f"use one of: {', '.join(HTTP_FORMATS)}")
    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    pcm = to_int16(samples)
    if response_format == "wav":
        data = _soundfile_bytes(pcm, "WAV", "PCM_16")
    elif response_format == "pcm":
        data = pcm.astype("<i2").tobytes()
    elif response_format == "opus":
        data = _ogg_opus_file(samples)
    elif response_format == "flac":
        data = _soundfile_bytes(pcm, "FLAC", "PCM_16")
    elif mp3_available():
        data = _soundfile_bytes(pcm, "MP3", "MPEG_LAYER_III")
    else:
        raise UnsupportedFormat("mp3 is not available: no encoder installed (this libsndfile lacks MP3); "
                                "use wav, pcm, opus or flac")
    return data, CONTENT_TYPES[response_format]
