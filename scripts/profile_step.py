"""Where the frame step's GPU time goes: kernels per step, grouped by name, on random real-size weights.

Profiles the eager step (so every kernel is visible with its own duration) and times the graphed step, at each
batch size and frame path given; `--ops` times instead each matmul shape and the decode attention of the step alone
(`triton.testing.do_bench`, L2 flushed between runs), with the bandwidth it reaches and its share of a step;
`--decoder 1x1,128x4` profiles the graphed codec decoder's kernels per call instead.
Usage: python scripts/profile_step.py --size 1b7 --batches 1,64 [--ops | --decoder 1x1,128x4]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
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


def kernel_table(run: Callable[[], object], steps: int) -> dict:
    """The CUDA kernels of `steps` calls of `run`, grouped by name: count and GPU time per call."""
    run()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
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


def op_table(tts: TTSModel, batch: int, talker_length: int = 300) -> dict:
    """Each matmul of the step (weights as loaded) and the decode attention at `batch` rows, timed alone: ms per call,
    GB/s of weights read, calls per step, and ms per step (calls x time)."""
    import triton.testing

    from engine.core.fused_layers import FusedLayers
    from engine.kernels.attention import varlen_attention
    talker, predictor = tts.talker, tts.talker.code_predictor
    groups = predictor.cfg.num_code_groups
    rows = {"talker": FusedLayers(talker.model, 1).layers[0], "predictor": FusedLayers(predictor.model, 1).layers[0]}
    sub_steps = {"talker": 1, "predictor": groups - 1}
    layers = {"talker": len(talker.model.layers), "predictor": len(predictor.model.layers)}
    weights = {f"{part}.{name}": (weight, layers[part] * sub_steps[part]) for part, merged in rows.items()
               for name, weight in (("qkv", merged.qkv), ("o", merged.layer.self_attn.o_proj.weight),
                                    ("gate_up", merged.gate_up), ("down", merged.layer.mlp.down_proj.weight))}
    weights["talker.codec_head"] = (talker.codec_head.weight, 1)
    weights["predictor.lm_head"] = (predictor.lm_head[0].weight, groups - 1)
    out = {}
    for name, (weight, calls) in weights.items():
        x = torch.randn(batch, weight.shape[1], dtype=weight.dtype, device=weight.device)
        ms = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, weight), warmup=20, rep=100)
        out[name] = dict(shape=list(weight.shape), ms=round(ms, 4), calls=calls, ms_per_step=round(ms * calls, 3),
                         gb_per_s=round(weight.numel() * weight.element_size() / ms / 1e6, 1))
    for part, length in (("talker", talker_length), ("predictor", groups // 2)):
        cfg = (talker if part == "talker" else predictor).cfg.layers
        k = torch.randn(batch + 1, cfg.num_key_value_heads, max(length, 16), cfg.head_dim, dtype=tts.dtype,
                        device=tts.device)
        q = torch.randn(batch, cfg.num_attention_heads, cfg.head_dim, dtype=tts.dtype, device=tts.device)
        slots = torch.arange(batch, device=tts.device)
        lengths = torch.full((batch,), length, device=tts.device)
        ms = triton.testing.do_bench(lambda: varlen_attention(q, k, k, slots, lengths), warmup=20, rep=100)
        calls = layers[part] * sub_steps[part]
        out[f"{part}.attention@{length}"] = dict(ms=round(ms, 4), calls=calls, ms_per_step=round(ms * calls, 3))
    out["sum_ms_per_step"] = round(sum(v["ms_per_step"] for v in out.values()), 3)
    return out


def decoder_table(tts: TTSModel, batch: int, frames: int) -> dict:
    """The codec decoder's kernels for one streaming call of `frames` frames at `batch` rows, as the engine runs it:
    the decoder pool's CUDA graph of the fast path (its kernels are profiled one by one inside the replay)."""
    from engine.core.codec_decoding import DecoderPool
    pool = DecoderPool(tts.decoder, batch, tts.device, tts.dtype, capture=True, chunk_lengths=(frames,))
    codes = torch.randint(0, tts.decoder.cfg.codebook_size, (batch, frames, tts.decoder.cfg.num_quantizers))
    slots = list(range(batch))
    return dict(decoder=f"{batch}x{frames}", **kernel_table(lambda: pool.decode(slots, codes), 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b7", choices=["0b6", "1b7"])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    parser.add_argument("--frame-paths", default="torch,triton")
    parser.add_argument("--ops", action="store_true", help="time each matmul shape and the attention alone")
    parser.add_argument("--decoder", type=lambda s: [tuple(int(x) for x in b.split("x")) for b in s.split(",")],
                        help="profile the graphed codec decoder instead, at BATCHxFRAMES shapes (1x1,128x4)")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model_dir = write_random_checkpoint(Path(tmp.name) / "ckpt", args.size, "custom_voice", seed=0)
    tts = TTSModel.load(model_dir, device="cuda", dtype=torch.bfloat16)
    if args.decoder:
        for batch, frames in args.decoder:
            print(json.dumps(decoder_table(tts, batch, frames)), flush=True)
        return
    if args.ops:
        for batch in args.batches:
            print(json.dumps(dict(batch=batch, ops=op_table(tts, batch))), flush=True)
        return
    for frame_path in args.frame_paths.split(","):
        for batch in args.batches:
            engine = running_engine(tts, batch, frame_path)
            batch_rows = engine.runner.batch(list(engine.running.values())).to(engine.runner.device)
            result = dict(frame_path=frame_path, batch=batch, graph_step_ms=graph_time(engine),
                          **kernel_table(lambda: engine.runner.step(batch_rows), 3))
            print(json.dumps(result), flush=True)
            del engine
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
