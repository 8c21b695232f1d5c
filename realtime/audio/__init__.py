"""Audio out of the gateway: formats, per-context stream encoders, Ogg Opus and whole files (one job per module)."""
from realtime.audio.encoders import StreamEncoder
from realtime.audio.files import encode_file, mp3_available
from realtime.audio.formats import (
    CONTENT_TYPES,
    DEFAULT_RATES,
    FRAME_MS,
    HTTP_FORMATS,
    MODEL_SAMPLE_RATE,
    SAMPLE_RATES,
    AudioFormat,
    EncodedFrame,
    UnsupportedFormat,
    pcm_s16le,
    to_int16,
)
from realtime.audio.mulaw import mulaw_decode, mulaw_encode
from realtime.audio.ogg import ogg_crc, ogg_opus

__all__ = ["CONTENT_TYPES", "DEFAULT_RATES", "FRAME_MS", "HTTP_FORMATS", "MODEL_SAMPLE_RATE", "SAMPLE_RATES",
           "AudioFormat", "EncodedFrame", "StreamEncoder", "UnsupportedFormat", "encode_file", "mp3_available",
           "mulaw_decode", "mulaw_encode", "ogg_crc", "ogg_opus", "pcm_s16le", "to_int16"]
