"""The matmuls of a transformer block at a few rows: cuBLAS and the separate kernels beside it (the engine's fused path
today) against `few_rows_linear` (norm, SwiGLU and residual add fused in), per kernel configuration.

Each variant is captured as one CUDA graph of every layer's four matmuls (distinct weights per layer, as in the frame
step, so nothing is served from L2 that would not be), replayed, and timed with CUDA events: the time a block's
matmuls cost inside the step's graph, launch gaps included. Also checked: the fused output against the separate
kernels (bf16 differences), and each row's bits alone and in the batch (fp32).
`--per-op` times each of the four fused matmuls alone instead, per configuration, and names the fastest.
Usage: python scripts/bench_linear.py --batches 1,4,16,64 [--configs 8x1024x4x1,8x256x4x3x4] [--per-op]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.few_rows_linear import few_rows_linear  # noqa: E402
from engine.kernels.layer_ops import add_rms_norm, silu_mul  # noqa: E402
from engine.synthetic.configs import talker_config  # noqa: E402


def block_shapes(size: str) -> dict[str, dict]:
    """The talker's and the code predictor's layer widths, and how many layers a frame step runs of each."""
    talker = talker_config(size, "custom_voice")
    predictor = talker["code_predictor_config"]
    return {"talker": dict(talker, layers=talker["num_hidden_layers"]),
            "predictor": dict(predictor, layers=predictor["num_hidden_layers"] * (talker["num_code_groups"] - 1))}


def widths(cfg: dict) -> tuple[int, int, int, int]:
    """hidden, MLP inner, all query heads, all key (or value) heads."""
    dim = cfg["head_dim"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return cfg["hidden_size"], cfg["intermediate_size"], heads * dim, kv_heads * dim


class Layer:
    def __init__(self, cfg: dict, dtype: torch.dtype, distinct_weights: int) -> None:
        hidden, inner, q, kv = widths(cfg)

        def weights(rows: int, cols: int) -> list[torch.Tensor]:
            return [torch.randn(rows, cols, device="cuda", dtype=dtype) / cols ** 0.5 for _ in range(distinct_weights)]

        self.qkv, self.o = weights(q + 2 * kv, hidden), weights(hidden, q)
        self.gate_up, self.down = weights(2 * inner, hidden), weights(hidden, inner)
        self.norm = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
        self.q_width = q


def separate(layer: Layer, x: torch.Tensor, attended: torch.Tensor, index: int) -> None:
    """The engine's path today (fused_layers.FusedLayers), the attention left out."""
    normed = add_rms_norm(x, None, layer.norm, 1e-6)
    F.linear(normed, layer.qkv[index])
    normed = add_rms_norm(x, F.linear(attended, layer.o[index]), layer.norm, 1e-6)
    add_rms_norm(x, F.linear(silu_mul(F.linear(normed, layer.gate_up[index])), layer.down[index]), layer.norm, 1e-6)


def fused(layer: Layer, x: torch.Tensor, attended: torch.Tensor, index: int, config: dict) -> None:
    few_rows_linear(x, layer.qkv[index], norm=layer.norm, **config)
    few_rows_linear(attended, layer.o[index], residual=x, **config)
    gate_up = few_rows_linear(x, layer.gate_up[index], norm=layer.norm, **config)
    few_rows_linear(gate_up, layer.down[index], swiglu=True, residual=x, **config)


def graph_ms(run, layers: int, replays: int = 20) -> float:
    """ms per layer of a graph that runs `run(i)` for each of `layers` layers."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(layers):  # warm-up: compiles, and cuBLAS picks its kernels
            run(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            run(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays / layers


def parse_config(text: str) -> dict:
    """BLOCK_NxBLOCK_KxWARPSxSTAGES[xROWS]: ROWS per program, 1 unless given."""
    block_n, block_k, warps, stages, *rows = (int(v) for v in text.split("x"))
    return dict(block_n=block_n, block_k=block_k, warps=warps, stages=stages, rows_per_program=(rows or [1])[0])


def config_name(config: dict) -> str:
    return "x".join(str(v) for v in config.values())


def per_op(cfg: dict, configs: list[dict], batch: int) -> dict:
    """Each of the block's four fused matmuls alone, per configuration: us per call inside a graph, over enough
    distinct weights that L2 holds none of them between calls."""
    hidden, inner, q, kv = widths(cfg)
    x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(hidden, device="cuda", dtype=x.dtype) + 0.5
    inputs = {"qkv": (q + 2 * kv, hidden, dict(norm=norm)), "o": (hidden, q, dict(residual=x)),
              "gate_up": (2 * inner, hidden, dict(norm=norm)), "down": (hidden, inner, dict(swiglu=True, residual=x))}
    out = {}
    for name, (features, width, fused_with) in inputs.items():
        distinct = max(5, -(-150_000_000 // (features * width * 2)))
        weights = [torch.randn(features, width, device="cuda", dtype=x.dtype) / width ** 0.5 for _ in range(distinct)]
        source = torch.randn(batch, 2 * width if name == "down" else width, device="cuda", dtype=x.dtype)
        times = {}
        for config in configs:
            def run(i: int) -> None:
                few_rows_linear(source, weights[i % distinct], **fused_with, **config)
            times[config_name(config)] = round(1e3 * graph_ms(run, distinct), 2)
        best = min(times, key=times.get)
        out[f"{name}[{features}x{width}]"] = dict(best=best, best_us=times[best], us=times)
        del weights
    return out


def agreement(layer: Layer, batch: int, config: dict) -> dict:
    """bf16: the fused block's residual stream against the separate kernels'; fp32: a row's bits alone and batched."""
    x = torch.randn(batch, layer.norm.shape[0], device="cuda", dtype=layer.norm.dtype)
    attended = torch.randn(batch, layer.q_width, device="cuda", dtype=x.dtype)
    mine, theirs = x.clone(), x.clone()
    fused(layer, mine, attended, 0, config)
    separate(layer, theirs, attended, 0)
    out = dict(max_abs_diff_bf16=float((mine.float() - theirs.float()).abs().max()),
               residual_scale=float(theirs.float().abs().max()))
    weight = layer.gate_up[0].float()
    norm = layer.norm.float()
    rows = torch.randn(batch, weight.shape[1], device="cuda")
    together = few_rows_linear(rows, weight, norm=norm, **config)
    out["fp32_rows_bit_equal_alone"] = all(
        torch.equal(few_rows_linear(rows[i:i + 1].clone(), weight, norm=norm, **config)[0], together[i])
        for i in range(batch))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b7", choices=["0b6", "1b7"])
    parser.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 64])
    parser.add_argument("--configs", type=lambda s: [parse_config(v) for v in s.split(",")],
                        default=[parse_config(v) for v in ("8x1024x4x1", "8x512x4x2", "4x1024x4x1", "8x256x4x3x4")],
                        help="BLOCK_NxBLOCK_KxWARPSxSTAGES[xROWS] of few_rows_linear")
    parser.add_argument("--distinct-weights", type=int, default=5,
                        help="weight sets cycled through (5 x the predictor's 31 MB is past the H100's 50 MB L2)")
    parser.add_argument("--per-op", action="store_true", help="time each fused matmul alone, per configuration")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.per_op:
        for part, cfg in block_shapes(args.size).items():
            for batch in args.batches:
                print(json.dumps(dict(part=part, batch=batch, **per_op(cfg, args.configs, batch))), flush=True)
        return
    for part, cfg in block_shapes(args.size).items():
        layer = Layer(cfg, torch.bfloat16, args.distinct_weights)
        for batch in args.batches:
            x = torch.randn(batch, cfg["hidden_size"], device="cuda", dtype=torch.bfloat16)
            attended = torch.randn(batch, layer.q_width, device="cuda", dtype=x.dtype)
            cycle = args.distinct_weights
            result = dict(part=part, batch=batch, layers_per_step=cfg["layers"],
                          separate_us_per_layer=round(1e3 * graph_ms(lambda i: separate(layer, x, attended, i % cycle),
                                                                     cycle * 4), 2))
            for config in args.configs:
                us = 1e3 * graph_ms(lambda i: fused(layer, x, attended, i % cycle, config), cycle * 4)
                result[f"fused_us_per_layer[{config_name(config)}]"] = round(us, 2)
            result.update(agreement(layer, batch, args.configs[-1]))
            print(json.dumps(result), flush=True)
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
