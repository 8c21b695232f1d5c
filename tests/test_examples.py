"""examples/ run as written against a real server, and the client's one-call audio decoding."""
from __future__ import annotations

import asyncio
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


def test_the_speak_example_writes_the_audio_it_was_sent(server, tmp_path):
    out = tmp_path / "hello.wav"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "speak.py"), server.ws, str(out)], cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    audio, rate = sf.read(out)
    assert rate == 24000 and len(audio) > rate // 10 and f"wrote {out}" in done.stdout


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
