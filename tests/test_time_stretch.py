"""The streaming tempo change behind `speed` (realtime/audio/time_stretch.py) on a harmonic tone fed in random
chunks: the length is input / speed, the pitch is kept, and chunk seams leave no step the tone does not have."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realtime.audio.time_stretch import SPEED_RANGE, TimeStretch, atempo_factors

RATE = 24000
F0 = 220.0
SECONDS = 2.0
TIME = np.arange(int(SECONDS * RATE)) / RATE
TONE = sum(0.3 / k * np.sin(2 * np.pi * F0 * k * TIME + k) for k in range(1, 5)).astype(np.float32)
TONE_STEP = float(np.abs(np.diff(TONE)).max())  # the tone's own largest sample-to-sample step
SPEEDS = st.floats(*SPEED_RANGE) | st.sampled_from([0.25, 0.5, 0.75, 1.5, 2.0, 4.0])


def stretched(samples: np.ndarray, speed: float, cuts: list[int]) -> np.ndarray:
    stretch = TimeStretch(speed)
    pieces = [stretch.feed(piece) for piece in np.split(samples, sorted(set(cuts)))]
    return np.concatenate([*pieces, stretch.flush()])


def fundamental(samples: np.ndarray) -> float:
    """The strongest frequency of the middle half, by a zero-padded FFT with a parabola through the peak."""
    middle = samples[len(samples) // 4: 3 * len(samples) // 4]
    size = 16 * len(middle)
    spectrum = np.log(np.abs(np.fft.rfft(middle * np.hanning(len(middle)), size)) + 1e-12)
    peak = int(np.argmax(spectrum))
    left, centre, right = spectrum[peak - 1: peak + 2]
    return (peak + 0.5 * (left - right) / (left - 2 * centre + right)) * RATE / size


@settings(max_examples=40, deadline=None)
@given(speed=SPEEDS, cuts=st.lists(st.integers(1, len(TONE) - 1), max_size=60))
def test_a_tone_in_random_chunks_keeps_its_pitch_and_has_the_length_of_input_over_speed(speed, cuts):
    out = stretched(TONE, speed, cuts)
    assert out.dtype == np.float32
    assert len(out) == round(len(TONE) / speed)
    assert fundamental(out) == pytest.approx(F0, rel=0.01)
    assert np.abs(np.diff(out)).max() <= 1.25 * TONE_STEP, "a step the tone does not have: a click"


@settings(max_examples=25, deadline=None)
@given(speed=SPEEDS, cuts=st.lists(st.integers(1, len(TONE) - 1), min_size=1, max_size=60))
def test_chunking_changes_the_output_little_or_not_at_all(speed, cuts):
    """Against the whole signal stretched at once: from 1.0 up the same samples, below it within 2% of the tone's
    peak (the filter's frames fall elsewhere, and with them its choice of overlaps)."""
    whole = stretched(TONE, speed, [])
    chunked = stretched(TONE, speed, cuts)
    assert len(chunked) == len(whole)
    assert np.abs(chunked - whole).max() <= (0.0 if speed >= 1.0 else 0.02 * np.abs(TONE).max())


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.0, 4.0])
def test_model_sized_chunks_come_out_as_they_go_in(speed):
    """The model's chunks (80 ms, then up to 640 ms): at each chunk the input given out lags what came in by at most
    100 ms (about the filter's window), however large the chunk."""
    stretch = TimeStretch(speed)
    chunks = np.split(TONE, np.cumsum([1920, 1920, 3840, 7680, 15360]))
    taken, given_out = 0, 0
    for chunk in chunks:
        taken += len(chunk)
        given_out += len(stretch.feed(chunk))
        assert given_out * speed >= taken - 0.1 * RATE
    assert given_out + len(stretch.flush()) == round(len(TONE) / speed)


def test_silence_and_empty_input():
    stretch = TimeStretch(2.0)
    assert len(stretch.feed(np.zeros(0, np.float32))) == 0
    assert len(stretch.flush()) == 0
    quiet = stretched(np.zeros(4801, np.float32), 0.5, [100, 2000])
    assert len(quiet) == 9602 and not quiet.any()


def test_out_of_range_speeds_and_a_second_flush_are_refused():
    for speed in (0.2, 4.5, 0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="speed"):
            TimeStretch(speed)
    stretch = TimeStretch(1.5)
    stretch.flush()
    with pytest.raises(RuntimeError):
        stretch.feed(TONE[:10])
    with pytest.raises(RuntimeError):
        stretch.flush()


def test_factors_multiply_to_the_speed_and_each_fits_one_filter():
    for speed in (0.25, 0.3, 0.5, 1.0, 2.5, 4.0):
        factors = atempo_factors(speed)
        assert np.prod(factors) == pytest.approx(speed) and all(0.5 <= factor <= 100 for factor in factors)
    assert atempo_factors(0.25) == [0.5, 0.5]
