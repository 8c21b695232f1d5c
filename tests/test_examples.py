"""examples/ run as written against a real server, and the client's one-call audio decoding."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from tests.gateway_server import running_server
from voxgate_client.client import VoxgateClient, context_audio

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(one_thread):
    with running_server() as running:
        yield running


def run_example(name: str, *args: str, cwd: Path) -> str:
    """An example as a user runs it, in a fresh process; returns what it printed. An example makes no call that
    Pipecat warns is deprecated (its runner's call went in Pipecat 2: a clients' check)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # the client, when not installed
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=cwd,
                          env={"PYTHONPATH": path, "PATH": ""}, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "is deprecated since" not in done.stderr, done.stderr[-4000:]  # pipecat.utils.deprecation's words
    return done.stdout


def test_the_speak_example_writes_the_audio_it_was_sent(server, tmp_path):
    out = tmp_path / "hello.wav"
    printed = run_example("speak.py", server.ws, str(out), cwd=tmp_path)
    audio, rate = sf.read(out)
    assert rate == 24000 and len(audio) > rate // 10 and f"wrote {out}" in printed


def test_the_pipecat_example_writes_the_pipelines_audio_and_words(server, tmp_path):
    out = tmp_path / "pipecat.wav"
    printed = run_example("pipecat_tts.py", server.ws, str(out), cwd=tmp_path)
    audio, rate = sf.read(out)
    assert rate == 16000 and len(audio) > rate // 10
    assert f"wrote {out}: {len(audio) / rate:.2f} s" in printed and "words: Sure! The weather today" in printed


def test_the_livekit_example_writes_the_streamed_and_the_http_audio(server, tmp_path):
    printed = run_example("livekit_tts.py", server.http, str(tmp_path / "lk"), cwd=tmp_path)
    for name in ("stream", "http"):
        audio, rate = sf.read(tmp_path / f"lk-{name}.wav")
        assert rate == 24000 and len(audio) > rate // 10 and f"lk-{name}.wav: {len(audio) / rate:.2f} s" in printed
    assert "words: Hello@0.00s from@" in printed


@pytest.mark.parametrize("fields", [{}, {"preset": "pcm"}])
def test_context_audio_is_the_announced_length_across_flushes(server, fields):
    """With a flush inside, Opus restarts its encoder (DISCONTINUITY): each restart drops pre_skip again."""
    async def go():
        async with VoxgateClient.connect(server.ws, **fields) as client:
            result = await client.speak("c", ["Hello there. ", "And again."], flush=True)
            return client.session, result

    session, result = asyncio.run(go())
    audio, rate = context_audio(result, session), session["audio"]["sample_rate"]
    restarts = 1 + sum(bool(f.flags & 4) for f in result.frames)
    skipped = restarts * session["audio"].get("pre_skip", 0)
    assert result.done is not None and len(audio) > 0
    assert len(audio) + skipped == round(result.done["audio_ms"] * rate / 1000)
