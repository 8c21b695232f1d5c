"""Where the frame step's GPU time goes: kernels per step, grouped by name, on random real-size weights.

Profiles the eager step (so every kernel is visible with its own duration) and times the graphed step, at each
batch size and frame path given. Usage: python scripts/profile_step.py --size 1b7 --batches 1,64
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.engine import Engine, EngineConfig  # noqa: E402
from engine.request import SynthesisRequest
from engine.sampling import SamplingParams  # noqa: E402
from engine.synthetic.checkpoints import write_random_checkpoint  # noqa: E402
from engine.tts import TTSModel, VoiceRequest  # noqa: E402


def running_engine(tts: TTSModel, batch: int, frame_path: str) -> Engine:
    engine = Engine(tts, EngineConfig(max_batch=batch, capacity=512, step_mode="graphs", frame_path=frame_path,
                                      attention_backend="triton", max_waiting=batch))
    voice = tts.voice(VoiceRequest(speaker="vivian"))
    base = SamplingParams.from_defaults(tts.config.generation)
    sampling = SamplingParams(base.talker, base.code_predictor, base.repetition_penalty, 0, min_new_frames=400)
    for seed in range(batch):
        engine.submit(SynthesisRequest("a sentence of ordinary length to speak.", voice, language="english",
                                       sampling=sampling, max_frames=400))
    for _ in range(20):
        engine.step()
    return engine


def kernel_table(engine: Engine, steps: int) -> dict:
    batch = engine.runner.batch(list(engine.running.values()))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.runner.step(batch)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name[event.name[:90]]
            entry[0] += 1
            entry[1] += event.device_time_total
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    total_us = sum(v[1] for v in by_name.values()) / steps
    return dict(kernels_per_step=sum(v[0] for v in by_name.values()) / steps, kernel_time_ms=total_us / 1e3,
                top=[dict(name=n, per_step=c / steps, us_per_step=round(t / steps, 1)) for n, (c, t) in rows[:25]])


def graph_time(engine: Engine, repeats: int = 50) -> float:
    batch = engine.runner.batch(list(engine.running.values()))
    engine.runner.run(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        engine.runner.run(batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b7", choices=["0b6", "1b7"])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    parser.add_argument("--frame-paths", default="torch,triton")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model_dir = write_random_checkpoint(Path(tmp.name) / "ckpt", args.size, "custom_voice", seed=0)
    tts = TTSModel.load(model_dir, device="cuda", dtype=torch.bfloat16)
    for frame_path in args.frame_paths.split(","):
        for batch in args.batches:
            engine = running_engine(tts, batch, frame_path)
            result = dict(frame_path=frame_path, batch=batch, graph_step_ms=graph_time(engine),
                          **kernel_table(engine, 3))
            print(json.dumps(result), flush=True)
            del engine
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
