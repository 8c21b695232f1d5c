"""scripts/bench_opus.py: its synthetic speech (deterministic, speech-shaped), its quality measures (a clean copy
scores perfectly, a damaged one does not) and a short real run's report (libopus runs outside the GIL)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from realtime.audio.encoders import OPUS_COMPLEXITY
from realtime.audio.formats import MODEL_SAMPLE_RATE
from scripts.bench_opus import log_spectral_distance, quality, speech_like
from tests.server_process import ROOT


def test_speech_like_is_deterministic_and_shaped_like_speech():
    audio = speech_like(4.0, seed=3)
    assert audio.dtype == np.float32 and len(audio) == 4 * MODEL_SAMPLE_RATE
    assert np.array_equal(audio, speech_like(4.0, seed=3)) and not np.array_equal(audio, speech_like(4.0, seed=4))
    level = 20 * np.log10(np.sqrt(np.mean(audio.reshape(-1, 480) ** 2, axis=1)))  # per 20 ms
    assert (level < -50).mean() > 0.05 and (level > -30).mean() > 0.5  # pauses between phrases, mostly speech
    spectrum = np.abs(np.fft.rfft(audio)) ** 2
    freqs = np.fft.rfftfreq(len(audio), 1 / MODEL_SAMPLE_RATE)
    assert spectrum[(freqs > 100) & (freqs < 1000)].sum() > spectrum[freqs > 4000].sum()  # voiced energy is low


def test_quality_measures_tell_a_clean_copy_from_a_damaged_one():
    audio = speech_like(2.0)
    clean = np.concatenate([np.zeros(156, np.float32), audio])
    perfect = quality(audio, clean, MODEL_SAMPLE_RATE, 156)
    assert perfect["snr_db"] > 100 and perfect["lsd_db"] == 0 and perfect["lag"] == 0
    noisy = clean + np.random.default_rng(0).normal(0, 0.03, len(clean)).astype(np.float32)
    scores = quality(audio, noisy, MODEL_SAMPLE_RATE, 156)
    assert 5 < scores["snr_db"] < 15 and scores["lsd_db"] > 3
    halved = log_spectral_distance(audio, audio * 0.5, MODEL_SAMPLE_RATE)
    assert 5 < halved <= 20 * np.log10(2) + 1e-6  # 6 dB everywhere, less where the floor holds both


def test_a_short_run_reports_cost_quality_and_threads():
    run = subprocess.run([sys.executable, "scripts/bench_opus.py", "--seconds", "1", "--complexities", "0,10",
                          "--threads", "1,2", "--repeats", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["gateway_complexity"] == OPUS_COMPLEXITY and report["machine"]["libopus"].startswith("libopus")
    assert [(row["rate"], row["mode"], row["complexity"]) for row in report["cost"]] == [
        (rate, mode, complexity) for rate in (24000, 48000) for mode in ("celt", "speech") for complexity in (0, 10)]
    assert [row["gateways_mode"] for row in report["cost"]] == [True, True, False, False] * 2
    for row in report["cost"]:
        assert row["cpu_us_per_audio_s"] > 0 and row["streams_per_core"] > 0
        assert 10 < row["kbit_s"] < 40 and row["snr_db"] > 5 and row["lsd_db"] < 10
    assert [row["threads"] for row in report["threads"]] == [1, 2]
    assert all(row["stream_encoder_audio_s_per_wall_s"] > 0 for row in report["threads"])
    gil = report["gil"]  # a thread in libopus lets the probe run; one that holds the GIL does not
    assert gil["opus_encode"]["wakeups_per_s"] > 3 * gil["gil_holding_sort"]["wakeups_per_s"], gil
