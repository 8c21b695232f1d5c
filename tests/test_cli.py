"""The `voxgate synth` and `voxgate make-checkpoint` commands, run as a user runs them (a subprocess)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]


def voxgate(*args: str, cache: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
    return subprocess.run([sys.executable, "-m", "realtime.cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_synth_with_the_embedded_default_model(tmp_path):
    """The README's first command: no --model, the tiny default is built on first use and cached."""
    cache = tmp_path / "cache"
    out, codes_out = tmp_path / "hello.wav", tmp_path / "codes.npy"
    run = voxgate("synth", "--text", "Hello from voxgate.", "--max-frames", "6", "--seed", "3",
                  "--codes-out", codes_out, "-o", out, cache=cache)
    assert run.returncode == 0, run.stderr
    audio, rate = sf.read(out)
    codes = np.load(codes_out)
    assert rate == 24000
    assert codes.shape[1] == 16 and 1 <= codes.shape[0] <= 6 and codes.dtype.kind == "i"
    assert len(audio) == codes.shape[0] * 1920
    assert np.abs(audio).max() > 0
    assert (cache / "voxgate" / "models").is_dir()
    again = voxgate("synth", "--text", "Hello from voxgate.", "--max-frames", "6", "--seed", "3",
                    "--codes-out", tmp_path / "again.npy", "-o", tmp_path / "again.wav", cache=cache)
    assert again.returncode == 0, again.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "again.npy"), codes)  # same seed, same codes


def test_synth_greedy_with_every_option(tiny_checkpoints, tmp_path):
    out, codes_out = tmp_path / "out.wav", tmp_path / "codes.npy"
    run = voxgate("synth", "--model", tiny_checkpoints["custom_voice"], "--text", "Bonjour tout le monde.",
                  "--speaker", "Serena", "--instruct", "Cheerful.", "--language", "fr", "--greedy",
                  "--max-frames", "4", "--text-layout", "streaming", "--codes-out", codes_out, "-o", out)
    assert run.returncode == 0, run.stderr
    assert np.load(codes_out).shape == (4, 16)
    assert sf.info(out).frames == 4 * 1920


@pytest.mark.parametrize("args,message", [
    (["--speaker", "nobody"], "unknown speaker 'nobody'; choose one of: aiden"),
    (["--speaker", "vivian", "--language", "xx"], "unknown language 'xx'"),
    (["--speaker", "vivian", "--max-frames", "0"], "--max-frames must be at least 1"),
])
def test_synth_errors_are_one_clear_line(tiny_checkpoints, tmp_path, args, message):
    run = voxgate("synth", "--model", tiny_checkpoints["custom_voice"], "--text", "Hi.", *args,
                  "-o", tmp_path / "x.wav")
    assert run.returncode == 2
    assert message in run.stderr
    assert "Traceback" not in run.stderr


def test_synth_reports_a_missing_model_directory(tmp_path):
    run = voxgate("synth", "--model", tmp_path / "nope", "--text", "Hi.", "-o", tmp_path / "x.wav")
    assert run.returncode == 2 and "no such checkpoint directory" in run.stderr and "Traceback" not in run.stderr


def test_a_hub_id_is_found_in_the_hub_cache_when_offline(tiny_checkpoints, tmp_path):
    """`--model Qwen/...` takes the hub's cache layout (models--owner--name/snapshots/<commit>, refs/main)."""
    hub = tmp_path / "hub"
    repo = hub / "models--Qwen--Qwen3-TTS-Tiny-CustomVoice"
    shutil.copytree(tiny_checkpoints["custom_voice"], repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub)}
    run = voxgate("synth", "--model", "Qwen/Qwen3-TTS-Tiny-CustomVoice", "--speaker", "vivian", "--text", "Hi.",
                  "--max-frames", "3", "-o", tmp_path / "x.wav", env=env)
    assert run.returncode == 0, run.stderr
    assert sf.info(tmp_path / "x.wav").frames == 3 * 1920
    missing = voxgate("synth", "--model", "Qwen/Qwen3-TTS-Not-Cached", "--text", "Hi.", "-o", tmp_path / "y.wav",
                      env=env)
    assert missing.returncode == 2 and "not in the hub cache" in missing.stderr and "Traceback" not in missing.stderr


def test_make_checkpoint_writes_the_official_layout(tmp_path):
    out = tmp_path / "ckpt"
    run = voxgate("make-checkpoint", "--size", "tiny", "--variant", "voice_design", "-o", out)
    assert run.returncode == 0, run.stderr
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["config.json", "generation_config.json", "merges.txt", "model.safetensors",
                     "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors",
                     "speech_tokenizer/preprocessor_config.json", "tokenizer_config.json", "vocab.json"]


def test_serve_runs_the_readme_command_and_stops_cleanly():
    """`voxgate serve` with no model: loading shows progress, /ready turns 200 after warm-up, SIGINT stops it."""
    import json
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "realtime.cli", "serve", "--port", str(port)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, status = time.monotonic() + 180, None
        while status != 200 and time.monotonic() < deadline and server.poll() is None:
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5).status
            except OSError:
                time.sleep(0.2)
        assert status == 200
        voices = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/voices", timeout=5))
        assert voices["default"] in [v["id"] for v in voices["voices"]]
    finally:
        server.send_signal(signal.SIGINT)
        output = server.communicate(timeout=60)[0]
    assert server.returncode == 0, output
    assert "Finished server process" in output and "Traceback" not in output
    assert "loading the model" in output and "warming up" in output and "ready in" in output


def test_serve_refuses_bad_limits():
    run = voxgate("serve", "--max-sessions", "0")
    assert run.returncode == 2 and "--max-sessions must be at least 1" in run.stderr
    run = voxgate("serve", "--clone-voice", "nobody")
    assert run.returncode == 2 and "NAME=WAV" in run.stderr
    run = voxgate("serve", "--llm-url", "http://127.0.0.1:9/v1")
    assert run.returncode == 2 and "--llm-url and --llm-model go together" in run.stderr
