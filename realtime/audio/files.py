"""Whole-utterance files for `POST /v1/audio/speech`: WAV, raw PCM, Ogg Opus, FLAC and MP3."""
from __future__ import annotations

import io

import numpy as np
import soundfile

from realtime.audio.encoders import StreamEncoder
from realtime.audio.formats import (
    CONTENT_TYPES,
    HTTP_FORMATS,
    MODEL_SAMPLE_RATE,
    AudioFormat,
    UnsupportedFormat,
    pcm_s16le,
    to_int16,
)
from realtime.audio.ogg import ogg_opus


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
        data = pcm_s16le(samples)
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
