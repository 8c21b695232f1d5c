"""scripts/bench_gateway.py's open-loop mode: Poisson arrivals at the asked rate, an immediate player's underrun
accounting (hand-made timelines and random ones), tts_bench's audible onset, the prompt set, and short real runs
against a `voxgate serve` process (HTTP PCM and WebSocket)."""
from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.core.simulator import poisson_times
from scripts.bench_gateway import (PROMPTS, audible_onset, context_chunks, load_prompts, nearest_rank, playback,
                                   played_until)
from scripts.make_prompts import count_words, prompts
from tests.server_process import ROOT, server_process
from voxgate_client.client import AudioFrame, ContextResult


def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps():
    rate, duration = 20.0, 300.0
    times = list(poisson_times(random.Random(11), rate, duration))
    expected = rate * duration
    assert abs(len(times) - expected) < 3 * math.sqrt(expected)  # a Poisson count: sd = sqrt(mean)
    assert times == sorted(times) and 0 < times[0] and times[-1] < duration
    gaps = np.diff([0.0, *times])
    assert abs(gaps.mean() - 1 / rate) < 0.05 / rate
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential: coefficient of variation 1
    per_second = np.bincount(np.asarray(times, int), minlength=int(duration))
    assert abs(per_second.var() / per_second.mean() - 1) < 0.2  # Poisson counts: variance = mean
    assert list(poisson_times(random.Random(11), rate, duration)) == times  # seeded: the same run again


def test_poisson_arrivals_leave_draws_between_them_in_order():
    """poisson_workload draws lengths between arrivals: the generator must draw lazily."""
    rng = random.Random(5)
    arrivals = poisson_times(rng, 3.0, 10.0)
    first = next(arrivals)
    probe = rng.random()
    replay = random.Random(5)
    assert first == replay.expovariate(3.0) and probe == replay.random()


def test_a_stream_that_keeps_ahead_never_underruns():
    played = playback([(0.0, 0.08), (0.05, 0.08), (0.16, 0.16)])
    assert played.gaps == () and played.wall_time(0.2) == pytest.approx(0.2)


def test_late_chunks_stall_the_player_and_move_later_audio():
    played = playback([(0.0, 0.08), (0.10, 0.08), (0.20, 0.08)])
    assert played.gaps == pytest.approx((0.02, 0.02))
    assert played.wall_time(0.04) == pytest.approx(0.04)
    assert played.wall_time(0.10) == pytest.approx(0.12)  # 20 ms into the second chunk, which began at 0.10
    assert played.wall_time(0.20) == pytest.approx(0.24)


def test_no_audio_is_no_playback():
    assert playback([]) is None


chunk_lists = st.lists(st.tuples(st.floats(0, 2, allow_nan=False), st.floats(0, 0.5, allow_nan=False)),
                       min_size=1, max_size=40)


@given(chunk_lists)
@example([(1.0, 0.15299468630554217), (0.15299468630554217, 0.15299468630554217),
          (0.15299468630554217, 0.0)])  # on time only in the player's order of sums
def test_underrun_accounting_on_random_timelines(raw):
    arrivals = np.cumsum([gap for gap, _ in raw])
    chunks = [(float(at), seconds) for at, (_, seconds) in zip(arrivals, raw)]
    played = playback(chunks)
    total = sum(seconds for _, seconds in chunks)
    assert all(gap > 0 for gap in played.gaps)
    # the player ends after all the audio and all the stalls
    end = max(played.start + total + sum(played.gaps), chunks[-1][0])
    assert played.wall_time(total) == pytest.approx(end)
    # no stall exactly when every chunk arrives by the time a stall-free player reaches it (the closed loop's rule)
    # (its playhead summed in the player's order: start + s1 + s2 + ..., which rounds unlike start + (s1 + s2))
    reaches = itertools.accumulate((seconds for _, seconds in chunks[:-1]), initial=played.start)
    on_time = all(at <= reached for (at, _), reached in zip(chunks, reaches))
    assert on_time == (not played.gaps)
    # the playhead never runs ahead of real time or backwards
    times = [played.wall_time(m) for m in np.linspace(0, total, 13)]
    assert all(b >= a - 1e-9 for a, b in zip(times, times[1:]))
    assert all(t >= played.start + m - 1e-9 for t, m in zip(times, np.linspace(0, total, 13)))


def test_context_frames_last_until_the_next_pts():
    frame = AudioFrame
    result = ContextResult("c", started_at=0.0,
                           frames=[frame("c", 1, 1, 0, b"a", True, False), frame("c", 1, 0, 960, b"b", False, False),
                                   frame("c", 1, 2, 2880, b"", False, True)],
                           arrivals=[0.1, 0.2, 0.3])
    assert context_chunks(result, 24_000, 2400) == [(0.1, 0.04), (0.2, 0.06)]  # the empty LAST frame carries no audio
    assert context_chunks(result, 24_000, 0) == [(0.1, 0.04), (0.2, 0.0)]  # not decoded: checked for lateness only


def tone(seconds: float, dbfs: float, rate: int = 24_000) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (10 ** (dbfs / 20) * math.sqrt(2) * np.sin(2 * math.pi * 220 * t)).astype(np.float32)


def test_audible_onset_is_where_sound_starts():
    rate = 24_000
    audio = np.concatenate([np.zeros(rate // 2, np.float32), tone(0.5, -20)])
    assert 0.48 <= audible_onset(audio, rate) <= 0.5
    assert audible_onset(np.zeros(rate, np.float32), rate) is None
    assert audible_onset(tone(1.0, -50), rate) is None  # under tts_bench's -45 dBFS
    assert audible_onset(tone(1.0, -40), rate) == 0.0
    assert audible_onset(np.full(rate, 0.5, np.float32), rate) is None  # a DC offset is not sound
    # a 5 ms click is loud in one window only (the next starts 10 ms in); two windows in a row are needed
    assert audible_onset(np.concatenate([tone(0.005, -10), np.zeros(rate, np.float32)]), rate) is None


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=60))
def test_nearest_rank_picks_a_sample_at_or_above_the_share(values):
    for name, value in nearest_rank(values).items():
        share = int(name[1:]) / 100
        assert value in [round(v, 1) for v in values]
        assert sum(v <= value + 0.05 for v in values) >= share * len(values)


def test_the_prompt_set_is_the_generated_one_and_fits_tts_bench():
    texts = load_prompts(PROMPTS)
    assert texts == prompts(1000, 17)  # the committed file is what scripts/make_prompts.py writes
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert len({row["id"] for row in rows}) == len(rows) == 1000  # tts_bench needs unique ids and nonempty text
    words = [count_words(text) for text in texts]
    assert 9 <= np.mean(words) <= 12 and min(words) >= 1 and len(set(texts)) == len(texts)
    assert sum("?" in t for t in texts) >= 100 and sum(any(c.isdigit() for c in t) for t in texts) >= 200
    assert sum('"' in t for t in texts) >= 30


@pytest.mark.parametrize("traffic", ["http", "ws"])
def test_a_short_open_loop_run_against_a_real_server(tmp_path, traffic):
    with server_process(["--synthetic-frames-per-token", "2"], tmp_path / "server.log") as server:
        run = subprocess.run(
            [sys.executable, "scripts/bench_gateway.py", "--url", server.ws, "--mode", "open", "--traffic", traffic,
             "--rate", "2", "--duration", "2", "--seed", "1", "--encoding", "pcm_s16le", "--timeout", "300"],
            cwd=ROOT, capture_output=True, text=True, timeout=600)
        server.assert_alive()
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["mode"] == "open" and report["traffic"] == traffic and report["errors"] == {}
    assert report["requests"] >= 1 and report["with_audio"] == report["requests"]
    assert report["audible_ttfa_ms"]["p50"] > 0 and report["e2e_ms"]["p99"] >= report["first_audio_ms"]["p99"]
    assert 1 <= report["peak_in_flight"] <= report["requests"]
    assert report["audio_s_per_wall_s"] > 0 and report["start_lag_ms"]["p99"] < 1000
    assert report["server_cpu"]["pid"] == server.process.pid and report["server_cpu"]["cores"] > 0
    assert "audible TTFA" in run.stderr and "underrun requests" in run.stderr


def test_a_closed_loop_spread_over_client_processes_reports_every_session(tmp_path):
    """`--processes 2`: each process speaks its share of the sessions; the report adds them up."""
    with server_process(["--synthetic-frames-per-token", "2"], tmp_path / "server.log") as server:
        run = subprocess.run(
            [sys.executable, "scripts/bench_gateway.py", "--url", server.ws, "--sessions", "3", "--processes", "2",
             "--duration", "1", "--encoding", "pcm_s16le", "--listen"], cwd=ROOT, capture_output=True, text=True,
            timeout=600)
        server.assert_alive()
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["processes"] == 2 and report["errors"] == {} and report["listen"]
    phases = report["context_phases_ms"]
    assert 0 < phases["audio_arrival_span_s"]["p50"] <= phases["context_s"]["p50"]
    assert report["contexts"] >= 3 and report["contexts_done"] == report["contexts"]
    assert report["audio_s"] > 0
    assert report["ttfa_server_ms"]["p50"] > 0
    assert 0 <= report["never_underrun"] <= report["never_underrun_behind_100ms"] <= 1  # a buffer only helps


def test_a_listening_session_waits_for_its_audio_to_play_stalls_included():
    """`--listen`: the next context waits until a player behind 100 ms has played the last audio."""
    frames = [AudioFrame("c", 1, 1, 0, b"a", True, False), AudioFrame("c", 1, 2, 24000, b"b", False, True)]
    result = ContextResult("c", started_at=0.0, frames=frames, arrivals=[10.0, 12.0])
    result.done = {"audio_ms": 2000}
    # 1 s of audio from 10.1 (the buffer), a stall until the second second arrives at 12.0, then 1 s more
    assert played_until(result, 24000) == pytest.approx(13.0)


def test_client_processes_are_for_the_closed_loop_against_a_server():
    run = subprocess.run([sys.executable, "scripts/bench_gateway.py", "--mode", "open", "--processes", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--processes" in run.stderr


def test_a_prebuffer_absorbs_a_gap_shorter_than_itself_and_not_a_longer_one():
    late = [(0.0, 0.08), (0.13, 0.08), (0.20, 0.08)]  # the second chunk 50 ms after the first one ran out
    assert playback(late).gaps == pytest.approx((0.05,))
    assert playback(late, prebuffer_s=0.1).gaps == ()
    assert playback([(0.0, 0.08), (0.30, 0.08)], prebuffer_s=0.1).gaps == pytest.approx((0.12,))


def test_sessions_still_running_after_the_drain_are_reported_as_stuck_not_waited_for(tmp_path):
    """A session that has not finished `--drain-s` after `--duration` (here: its first context's text is still being
    paced) is cancelled and reported with what it was doing, so that a hang shows in the report instead of none."""
    with server_process(["--synthetic-frames-per-token", "2"], tmp_path / "server.log") as server:
        started = time.monotonic()
        run = subprocess.run(
            [sys.executable, "scripts/bench_gateway.py", "--url", server.ws, "--sessions", "2", "--duration", "0.2",
             "--drain-s", "2", "--token-rate", "1", "--encoding", "pcm_s16le"], cwd=ROOT, capture_output=True,
            text=True, timeout=600)  # at a token a second an answer of 8 words or more takes 8 s and more
        elapsed = time.monotonic() - started
        server.assert_alive()
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["stuck_sessions"] == 2 and elapsed < 60
    assert all(s["doing"].startswith("speaking s") and 0.5 < s["for_s"] < 60 for s in report["stuck"]), report["stuck"]
