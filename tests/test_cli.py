"""The `voxgate synth` and `voxgate make-checkpoint` commands, run as a user runs them (a subprocess)."""
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.request
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
    assert json.loads((out / "config.json").read_text())["voxgate_random_weights"] is True  # random weights, marked
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    run = voxgate("make-checkpoint", "--size", "tiny", "--variant", "base", "-o", a_file)
    assert run.returncode == 2 and "a checkpoint is a directory" in run.stderr and "Traceback" not in run.stderr


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
        encoders = encoder_processes(server.pid)
        assert encoders  # its audio encoder processes
    finally:
        server.send_signal(signal.SIGINT)
        output = server.communicate(timeout=60)[0]
    assert server.returncode == 0, output
    assert not any(Path(f"/proc/{pid}").exists() for pid in encoders)  # they left with it
    assert "Finished server process" in output and "Traceback" not in output
    assert "loading the model" in output and "warming up" in output and "ready in" in output
    assert "engine: 8 slots; at most 64 WebSocket sessions and 192 connections" in output  # the CPU keeps 64


def encoder_processes(parent: int) -> list[int]:
    """The pids of `parent`'s encoder worker processes (realtime/audio/encoder_pool.py)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if ppid == parent and b"realtime.audio.encoder_worker" in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_serve_refuses_bad_limits():
    run = voxgate("serve", "--max-sessions", "0")
    assert run.returncode == 2 and "--max-sessions must be at least 1" in run.stderr
    run = voxgate("serve", "--clone-voice", "nobody")
    assert run.returncode == 2 and "NAME=WAV" in run.stderr
    run = voxgate("serve", "--llm-url", "http://127.0.0.1:9/v1")
    assert run.returncode == 2 and "--llm-url and --llm-model go together" in run.stderr


@pytest.mark.parametrize("args,env,message", [
    (["--port", "70000"], {}, "a port is 0 to 65535"),  # it hung after uvicorn's traceback
    (["--max-batch", "0"], {}, "--max-batch must be at least 1"),  # 0 meant the default, -3 failed at start-up
    (["--api-key", ""], {}, "--api-key is empty"),  # `--api-key "$KEY"` with KEY unset served with no key
    (["--api-key", " "], {}, "--api-key is empty"),
    ([], {"VOXGATE_API_KEYS": " , "}, "holds no key"),
    # a key no Authorization header can carry (its bytes are read as latin-1) was accepted and then never matched
    (["--api-key", "k\u00e9y"], {}, "an API key holds 'é' (U+00E9); keys must be printable ASCII"),
    ([], {"VOXGATE_API_KEYS": "good,with space"}, "an API key holds ' ' (U+0020)"),
    (["--max-sessions-per-key", "2"], {}, "--max-sessions-per-key needs API keys"),
    (["--max-sessions-per-key", "0", "--api-key", "k"], {}, "--max-sessions-per-key must be at least 1"),
])
def test_serve_refuses_bad_flags_at_once_in_one_line(args, env, message):
    started = time.monotonic()
    run = voxgate("serve", *args, env=env)
    assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert time.monotonic() - started < 60


def test_serve_refuses_clone_voices_for_a_model_that_cannot_clone(tmp_path):
    reference = tmp_path / "me.wav"
    sf.write(reference, np.zeros(24000, np.float32), 24000)
    run = voxgate("serve", "--port", "0", "--clone-voice", f"eve={reference}")  # the embedded CustomVoice model
    assert run.returncode != 0 and "--clone-voice needs a Base" in run.stderr


def unmarked_checkpoint(tiny_checkpoints, tmp_path: Path) -> Path:
    """A tiny checkpoint whose config.json lacks the random-weights mark, as a real checkpoint's does."""
    path = tmp_path / "unmarked"
    shutil.copytree(tiny_checkpoints["custom_voice"], path)
    config = json.loads((path / "config.json").read_text())
    del config["voxgate_random_weights"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_serve_refuses_synthetic_lengths_for_a_checkpoint_not_marked_random(tiny_checkpoints, tmp_path):
    """Before serving anything: exit 2 and one line naming the option and the checkpoint."""
    from tests.server_process import free_port

    model = unmarked_checkpoint(tiny_checkpoints, tmp_path)
    started = time.monotonic()
    run = voxgate("serve", "--model", model, "--port", free_port(), "--synthetic-frames-per-token", "2.5")
    assert run.returncode == 2 and time.monotonic() - started < 60
    errors = [line for line in run.stderr.splitlines() if line.startswith("voxgate: error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr and "Uvicorn running" not in run.stderr
    assert "--synthetic-frames-per-token is benchmark-only" in errors[0] and f"{model} is not marked" in errors[0]
    synth = voxgate("synth", "--model", model, "--speaker", "vivian", "--text", "Hi.", "-o", tmp_path / "x.wav",
                    "--synthetic-frames-per-token", "2")
    assert synth.returncode == 2 and f"{model} is not marked" in synth.stderr and not (tmp_path / "x.wav").exists()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_serve_refuses_a_non_positive_or_non_finite_synthetic_length(value):
    run = voxgate("serve", "--synthetic-frames-per-token", value)
    assert run.returncode == 2 and "--synthetic-frames-per-token must be a positive finite number" in run.stderr


def test_serve_holds_each_utterance_to_its_synthetic_length(tiny_checkpoints, tmp_path):
    """A real server on a marked checkpoint: the speech endpoint's audio is exactly ceil(X x tokens) frames."""
    from engine.tts import TTSModel
    from tests.server_process import server_process

    model, text, x = tiny_checkpoints["custom_voice"], "Hello there, this is a benchmark.", 1.5
    tokens = len(TTSModel.load(model).tokenizer.target(text)[1])
    options = ["--model", str(model), "--synthetic-frames-per-token", str(x), "--max-batch", "2"]
    with server_process(options, tmp_path / "server.log") as server:
        body = json.dumps({"input": text, "voice": "vivian", "response_format": "pcm", "seed": 1}).encode()
        request = urllib.request.Request(server.http + "/v1/audio/speech", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            pcm = response.read()
    assert len(pcm) == math.ceil(x * tokens) * 1920 * 2  # 16-bit samples, 1920 a frame


@pytest.mark.parametrize("args,message", [
    (["--chunk-schedule", "bogus"], "--chunk-schedule 'bogus': choose one of fixed, lead"),
    (["--admission", "nope"], "--admission 'nope': choose one of all, protect"),
    (["--busy-batch", "-1"], "--busy-batch must be at least 0"),
    (["--lead-target", "nan"], "--lead-target nan: a number of seconds, 0 (never) or more"),
    (["--lead-target", "-1"], "--lead-target -1: a number of seconds, 0 (never) or more"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
])
def test_serve_refuses_unknown_scheduling_by_name(args, message):
    run = voxgate("serve", *args)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


def test_serve_scheduling_reaches_the_engine():
    from realtime.gateway import Gateway, GatewayOptions

    config = Gateway(GatewayOptions(chunk_schedule="lead", admission="protect", busy_batch=5,
                                    lead_target_s=1.5))._engine_config()
    assert (config.chunk_schedule, config.admission, config.busy_batch, config.lead_target_s) == (
        "lead", "protect", 5, 1.5)


def test_scheduling_defaults_fit_the_machine():
    """Unset, a GPU serves with the lead schedule, longer first chunks in busy steps and a 1 s lead target, the CPU
    (the tiny model slower than real time, every buffer thin) with the fixed schedule, one-frame starts and no
    target, both admitting every ready request; a flag always wins (a lead target of 0: none)."""
    from realtime.gateway import GPU_BUSY_BATCH, GPU_LEAD_TARGET_S, GPU_SCHEDULING, Gateway, GatewayOptions

    def scheduling(**options) -> tuple[str, str, int | None, float | None]:
        config = Gateway(GatewayOptions(**options))._engine_config()
        return config.chunk_schedule, config.admission, config.busy_batch, config.lead_target_s

    assert scheduling() == ("fixed", "all", None, None)
    assert scheduling(device="cuda") == (*GPU_SCHEDULING, GPU_BUSY_BATCH, GPU_LEAD_TARGET_S) == ("lead", "all", 32, 1.0)
    assert scheduling(device="cuda", chunk_schedule="fixed", admission="protect", busy_batch=1000, lead_target_s=0) == (
        "fixed", "protect", 1000, None)
    assert scheduling(lead_target_s=0.5)[3] == 0.5


def test_session_limit_follows_the_engine_slots():
    """Unset, one session per engine slot and at least 64 (the CPU's 8 slots keep 64), connections with them, below an
    explicit connection cap; an explicit limit always wins."""
    from realtime.gateway import MIN_SESSIONS, Limits

    assert MIN_SESSIONS == 64 and Limits().for_slots(8).max_sessions == 64
    gpu = Limits().for_slots(192)
    assert gpu.max_sessions == 192 and gpu.connection_cap == 2 * 192 + 64
    assert Limits(max_connections=100).for_slots(192).max_sessions == 99
    assert Limits(max_sessions=10).for_slots(192).max_sessions == 10


def test_max_connections_must_exceed_the_smallest_session_limit():
    """Unset, the session limit is never below 64, so a connection cap of 64 or less is refused at once."""
    run = voxgate("serve", "--max-connections", "64")
    assert run.returncode == 2 and "--max-connections must be more than --max-sessions" in run.stderr
