"""A residual unit's second half of the codec decoder (bias + SnakeBeta, 1x1 convolution, bias + residual) on an
H100: `snake_pointwise_residual` per tile configuration against what it replaces (the padding kernel's bias and
SnakeBeta, cuDNN's channels-last 1x1 convolution with its algorithm timed, `add_bias_residual`), at the four blocks'
shapes of a decoder call of 1 x 1 and 128 x 4 frames. Each variant is 10 calls in one CUDA graph, timed with
`triton.testing.do_bench`; us per call (the decoder takes the kernel where `pointwise_fits`). Then the share of
bit-equal values in bf16 on the last block's shape.
Usage: python scripts/bench_pointwise.py [--configs 128x128x32x8x3,64x128x32x4x3]
(BLOCK_M x largest BLOCK_N x BLOCK_K x warps x stages)
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine.kernels.conv_elementwise as kernels  # noqa: E402
from engine.model.codec_decoder import ResidualUnit  # noqa: E402

BLOCK_CHANNELS = (768, 384, 192, 96)
BLOCK_COLUMNS_PER_FRAME = (32, 160, 640, 1920)


def graphed_us(call: Callable[[], object]) -> float:
    call()  # compiles and picks cuDNN's algorithm outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            call()
    return triton.testing.do_bench(graph.replay, warmup=20, rep=100) * 100  # ms for 10 calls -> us per call


def case(batch: int, channels: int, columns: int, generator: torch.Generator) -> dict:
    unit = ResidualUnit("unit", channels, 1)
    for parameter in unit.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.3
    unit = unit.cuda().bfloat16()
    hidden, residual = (torch.randn(batch, columns, channels, generator=generator).cuda().bfloat16().transpose(1, 2)
                        for _ in range(2))
    weight = unit.conv2.conv.weight.unsqueeze(2).contiguous(memory_format=torch.channels_last)

    def separate() -> torch.Tensor:
        activated = kernels.snake_padded(hidden, unit.act2.alpha, unit.act2.beta, None, 0, True, unit.conv1.conv.bias)
        return kernels.add_bias_residual(residual, F.conv2d(activated.unsqueeze(2), weight).squeeze(2),
                                         unit.conv2.conv.bias)
    return dict(name=f"{batch}x{channels}x{columns}", fused=lambda: unit.fused_tail(residual, hidden),
                separate=separate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="128x128x32x8x3,64x128x32x4x3,64x64x32x4x3,128x256x32x8x3",
                        type=lambda text: [tuple(int(v) for v in config.split("x")) for config in text.split(",")])
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    cases = [case(batch, channels, columns * frames, generator) for batch, frames in ((1, 1), (128, 4))
             for channels, columns in zip(BLOCK_CHANNELS, BLOCK_COLUMNS_PER_FRAME)]
    with torch.backends.cudnn.flags(enabled=True, benchmark=True):
        print("separate kernels:", " | ".join(f"{c['name']} {graphed_us(c['separate']):.1f}" for c in cases))
    for config in args.configs:
        (kernels.POINTWISE_BLOCK_M, kernels.MAX_BLOCK_N, kernels.POINTWISE_BLOCK_K, kernels.POINTWISE_WARPS,
         kernels.POINTWISE_STAGES) = config
        timed = " | ".join(f"{c['name']} {graphed_us(c['fused']):.1f}" for c in cases)
        print(f"fused {'x'.join(map(str, config))}: {timed}", flush=True)
    last = cases[-1]
    with torch.inference_mode():
        fused, separate = last["fused"](), last["separate"]()
    print(f"bf16 bit-equal on {last['name']}: {(fused == separate).float().mean().item():.4f}")


if __name__ == "__main__":
    main()
