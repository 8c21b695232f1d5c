"""Time the simple single-request path (eager PyTorch, no batching, no CUDA graphs) on random real-size weights.

This is the correctness reference that the batched engine is checked against, not the fast path; its numbers are
the baseline the engine's speed-ups are measured from. Usage:
    python scripts/bench_reference_path.py --size 1b7 --frames 75 --device cuda
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.reference import generate_frames  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.synthetic.checkpoints import write_random_checkpoint  # noqa: E402
from engine.tts import TTSModel, VoiceRequest  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog while the orchestra tunes up for tonight's concert."


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_frames(tts: TTSModel, frames: int, device: str) -> tuple[list[float], torch.Tensor]:
    voice = tts.voice(VoiceRequest(speaker="vivian"))
    prompt, _ = tts.prompt(TEXT, voice, "english")
    sampling = SamplingParams.from_defaults(tts.config.generation, seed=0)
    times, codes = [], []
    synchronize(device)
    start = time.perf_counter()
    for frame in generate_frames(tts.talker, prompt, sampling, frames):
        frame.cpu()  # what a streaming consumer needs each frame
        now = time.perf_counter()
        times.append(now - start)
        codes.append(frame)
        start = now
    return times, torch.stack(codes).cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b7", choices=["tiny", "0b6", "1b7"])
    parser.add_argument("--frames", type=int, default=75)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model_dir = write_random_checkpoint(Path(tmp) / "ckpt", args.size, "custom_voice", seed=0)
        written = time.perf_counter() - started
        tts = TTSModel.load(model_dir, device=args.device, dtype=dtype)
    timed_frames(tts, 3, args.device)  # warm-up
    runs = []
    for _ in range(args.repeats):
        times, codes = timed_frames(tts, args.frames, args.device)
        synchronize(args.device)
        started = time.perf_counter()
        audio = tts.decode(codes)
        synchronize(args.device)
        decode_s = time.perf_counter() - started
        runs.append(dict(frames=len(times), first_frame_ms=times[0] * 1e3,
                         frame_ms_p50=statistics.median(times[1:]) * 1e3 if len(times) > 1 else None,
                         decode_ms=decode_s * 1e3, audio_s=len(audio) / tts.sample_rate))
    print(json.dumps(dict(size=args.size, device=args.device, dtype=str(dtype), gpu=torch.cuda.get_device_name()
                          if args.device.startswith("cuda") else None, checkpoint_write_s=round(written, 1),
                          runs=runs), indent=1))


if __name__ == "__main__":
    main()
