"""The bodies of `POST /v1/audio/speech`, encoded as the audio comes: raw PCM, or a container file that PyAV (FFmpeg)
writes: WAV, FLAC, MP3, AAC in ADTS, Opus in Ogg.

Streamed, the muxer writes to a sink it cannot seek back in, so every header takes its "length unknown" form (WAV's
sizes 0xFFFFFFFF, FLAC's total samples 0, no MP3 Xing frame) and each packet leaves as soon as it is made. Whole, it
writes to a seekable file (`whole_file`: in memory while small, on disk past `WHOLE_IN_MEMORY_BYTES`) and its trailer
goes back to the headers: exact WAV sizes, FLAC's total and MD5, MP3's Xing/LAME frame (with which decoders trim the
encoder's delay). ADTS cannot say that AAC's first 1024 samples are priming, so AAC decodes to that much more audio
in either form; so does a streamed MP3 (its delay and last frame).
"""
from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass, field
from typing import BinaryIO

import av
import numpy as np

from realtime.audio.formats import MODEL_SAMPLE_RATE, pcm_s16le, to_int16

COMMON_MUXER_OPTIONS = {"fflags": "+bitexact",  # no encoder version in the file: the same audio, the same bytes
                        "metadata_header_padding": "0"}  # FLAC would reserve 8 KiB for taggers ahead of the audio
STREAMED_MUXER_OPTIONS = {"flush_packets": "1"}  # each packet goes out at once, not when FFmpeg's I/O buffer fills
# A whole body waits for its end in a file: past this size on disk, so that long whole responses (max_text_chars of
# text: ~60 MB of WAV with a real model) do not each hold their audio in the gateway's memory.
WHOLE_IN_MEMORY_BYTES = 1 << 20


@dataclass(frozen=True)
class Container:
    """How one response_format is written: muxer, codec, the sample format handed to the codec, their options."""
    muxer: str
    codec: str
    sample_format: str  # "s16" (rounded as pcm is) for the codecs that take integers, "fltp" for AAC
    codec_options: dict[str, str] = field(default_factory=dict)
    muxer_options: dict[str, str] = field(default_factory=dict)
    streamed_muxer_options: dict[str, str] = field(default_factory=dict)


CONTAINERS = {
    "wav": Container("wav", "pcm_s16le", "s16"),
    # 40 ms blocks instead of FFmpeg's ~190 ms at 24 kHz: the first bytes leave with the first audio chunk (80 ms)
    "flac": Container("flac", "flac", "s16", {"frame_size": "960"}),
    "mp3": Container("mp3", "libmp3lame", "s16p", {"b": "64000"}, {"id3v2_version": "0"}),
    "aac": Container("adts", "aac", "fltp", {"b": "64000"}),
    # the socket's Opus bitrate; streamed, a page per 20 ms packet (Ogg's default holds a page for a second, which
    # would hold the first audio back), at ~10 kbit/s of page headers
    "opus": Container("ogg", "libopus", "s16", {"b": "24000"}, streamed_muxer_options={"page_duration": "20000"}),
}


def format_available(response_format: str) -> bool:
    """Whether this FFmpeg build has the format's encoder (PyAV's wheels have all of them)."""
    container = CONTAINERS.get(response_format)
    return response_format == "pcm" or (container is not None and container.codec in av.codecs_available)


def whole_file() -> BinaryIO:
    """Where a whole body is written as it is made: in memory up to `WHOLE_IN_MEMORY_BYTES`, then on disk."""
    return tempfile.SpooledTemporaryFile(max_size=WHOLE_IN_MEMORY_BYTES)


class PcmBody:
    """`pcm`: s16le at 24 kHz, no header; cheap enough to run on the event loop."""
    off_loop = False

    def __init__(self, into: BinaryIO | None) -> None:
        self.samples = 0  # audio taken so far, at the model's rate
        self._into = into

    def encode(self, samples: np.ndarray) -> bytes:
        self.samples += len(samples)
        data = pcm_s16le(samples)
        if self._into is None:
            return data
        self._into.write(data)
        return b""

    def finish(self) -> bytes:
        return b""

    def close(self) -> None:
        """Nothing held."""


class _StreamSink:
    """A write-only file for the muxer: what it wrote since the last `take`. No `seek`, so FFmpeg streams."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


class ContainerBody:
    """One response's container file, fed the model's chunks in order (the codec and muxer keep state): heavy
    enough to run on a worker thread. Its calls hold a lock, so that `close` waits for a call still running there."""
    off_loop = True

    def __init__(self, response_format: str, into: BinaryIO | None) -> None:
        spec = CONTAINERS[response_format]
        self._spec = spec
        self._sink = _StreamSink() if into is None else None
        options = {**COMMON_MUXER_OPTIONS, **spec.muxer_options,
                   **(STREAMED_MUXER_OPTIONS | spec.streamed_muxer_options if into is None else {})}
        self._container = av.open(self._sink or into, "w", format=spec.muxer, options=options)
        self._stream = self._container.add_stream(spec.codec, rate=MODEL_SAMPLE_RATE, layout="mono",
                                                  options=dict(spec.codec_options))
        self._stream.codec_context.format = spec.sample_format
        self._container.start_encoding()  # the header now, so that even a response without audio is a valid file
        self.samples = 0  # audio taken so far, at the model's rate
        self._lock = threading.Lock()
        self._closed = False

    def encode(self, samples: np.ndarray) -> bytes:
        """The bytes ready to send once `samples` (float32, 24 kHz) are in: streamed, whatever the codec let out."""
        with self._lock:
            if len(samples):
                self._mux(self._frame(np.asarray(samples, dtype=np.float32).reshape(-1)))
            return self._taken()

    def finish(self) -> bytes:
        """The rest: the codec's delayed packets and the trailer (whole: the file complete)."""
        with self._lock:
            self._mux(None)
            self._close()
            return self._taken()

    def _taken(self) -> bytes:
        """Streamed, what the muxer wrote since the last call; whole, nothing (it is all in the file)."""
        return b"" if self._sink is None else self._sink.take()

    def close(self) -> None:
        """Free the codec and muxer (FFmpeg's threads and buffers) of a response cut short, now: left to the
        garbage collector, each whole-body request whose client left held ~3.5 MB and threads until a full
        collection (a hostile try's finding)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._container.close()

    def _frame(self, samples: np.ndarray) -> av.AudioFrame:
        planes = np.clip(samples, -1.0, 1.0) if self._spec.sample_format == "fltp" else to_int16(samples)
        frame = av.AudioFrame.from_ndarray(planes.reshape(1, -1), format=self._spec.sample_format, layout="mono")
        frame.sample_rate, frame.pts = MODEL_SAMPLE_RATE, self.samples
        self.samples += len(samples)
        return frame

    def _mux(self, frame: av.AudioFrame | None) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)


def body_encoder(response_format: str, into: BinaryIO | None = None) -> PcmBody | ContainerBody:
    """The encoder of one response (a format of HTTP_FORMATS that `format_available`): streamed, its calls return
    the bytes to send as they are made; with `into` (a seekable file, `whole_file`), whole: they write the body there
    and return nothing, and it is complete once `finish` has returned."""
    return PcmBody(into) if response_format == "pcm" else ContainerBody(response_format, into)
