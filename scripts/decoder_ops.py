"""Kernel-launching ops in one streaming decode call of the codec decoder, by part: a CPU proxy for its launches.

At batch 1 a graphed decode on the GPU is bound by how many kernels it launches (issue 16: ~2.7 ms for one frame, a
few microseconds each), not by its arithmetic. This counts the ATen ops one `decode_step` of one frame dispatches,
leaving out views (ops whose output shares its input's storage), at the real decoder size with random weights, so a
change's effect on the launch count is seen on any machine. On the GPU, SnakeBeta and its padding are one Triton
kernel (`engine/kernels/conv_elementwise.py`) where this CPU count has ~10 ops: read the `upsample`/`blocks` rows
with that in mind; the quantizer and the transformer rows are the GPU's own.
    python scripts/decoder_ops.py
    python scripts/decoder_ops.py --dtype float32
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import CodecDecoderConfig  # noqa: E402
from engine.model.codec_decoder import CodecDecoder, DecoderState  # noqa: E402
from engine.synthetic.configs import REAL_DECODER  # noqa: E402


class LaunchCount(TorchDispatchMode):
    """Counts the ops dispatched inside it by name, views left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        results = out if isinstance(out, (tuple, list)) else [out]
        if not any(isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr() in storages for r in results):
            self.ops[func.overloadpacket.__name__] += 1
        return out


def real_decoder(dtype: torch.dtype) -> CodecDecoder:
    fields = {f.name for f in dataclasses.fields(CodecDecoderConfig)}
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in REAL_DECODER.items() if k in fields}
    return CodecDecoder(CodecDecoderConfig(**config)).eval().to(dtype)


def parts(decoder: CodecDecoder, codes: torch.Tensor, state: DecoderState) -> list[tuple[str, Callable]]:
    """decode_step's stages in order, each a call on the previous one's output (the same calls it makes)."""
    stages = [("quantizer", lambda _: decoder.quantizer.decode(codes)),
              ("pre_conv", lambda x: decoder.pre_conv(x, state).transpose(1, 2)),
              ("pre_transformer", lambda x: decoder.pre_transformer(x, state).transpose(1, 2))]
    for i, (up, convnext) in enumerate(decoder.upsample):
        stages.append((f"upsample{i}", lambda x, up=up, convnext=convnext: convnext(up(x, state), state)))
    stages.append(("decoder_in", lambda x: decoder.decoder[0](x, state)))
    for i, block in enumerate(decoder.decoder[1:-2]):
        stages.append((f"block{i}", lambda x, block=block: block(x, state)))
    stages.append(("decoder_out", lambda x: decoder.decoder[-1](x, state, decoder.decoder[-2])))
    return stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    decoder = real_decoder(dtype)
    codes = torch.zeros(1, 1, decoder.cfg.num_quantizers, dtype=torch.long)
    state = decoder.new_state(1, "cpu", dtype)
    report = {"dtype": args.dtype, "frames": 1, "batch": 1}
    with torch.inference_mode():
        decoder.decode_step(codes, state)  # the first call creates the convolution histories
        with LaunchCount() as whole:
            decoder.decode_step(codes, state)
        report["decode_step"] = sum(whole.ops.values())
        x = None
        for name, stage in parts(decoder, codes, state):
            with LaunchCount() as counted:
                x = stage(x)
            report[name] = {"ops": sum(counted.ops.values()), "top": dict(counted.ops.most_common(8))}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
