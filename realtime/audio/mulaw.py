"""G.711 mu-law, encoded and decoded with numpy (audioop is gone from Python 3.13): telephony's 8 kHz format."""
from __future__ import annotations

import numpy as np

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
