"""Where the engine's GPU memory goes: an `Engine` built as the server builds it on a GPU (graphs, the Triton frame
path), once per slot count, with the memory each part takes while it is built: the talker's KV cache, the frame step's
CUDA graphs, the prefill graphs, the codec decoder's per-slot states and its graphs; and the device's whole use
(`torch.cuda.mem_get_info`: the CUDA context, cuDNN's and cuBLAS's workspaces included). GiB; prints JSON lines.
    python3 scripts/gpu_memory.py --model /tmp/ck --max-batch 192,256
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core import codec_decoding, cuda_graphs, kv_cache, prefill_graphs  # noqa: E402
from engine.core.engine import Engine, EngineConfig  # noqa: E402
from engine.tts import TTSModel  # noqa: E402

GIB = 2 ** 30
# (part, class, method): the memory reserved while that method runs is the part's
PARTS = (("kv_cache", kv_cache.SlotKVCache, "__init__"),
         ("step_graphs", cuda_graphs.PaddedStep, "_capture"),
         ("prefill_graphs", prefill_graphs.PaddedPrefill, "_capture"),
         ("decoder_states", codec_decoding.DecoderPool, "__init__"),
         ("decoder_graphs", codec_decoding.DecoderPool, "_capture"))


def device_used() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


@contextlib.contextmanager
def measured(parts: dict[str, float]) -> Iterator[None]:
    """Each part's growth of the allocator's reserved memory, nested parts taken out of their enclosing one."""
    originals: list[tuple[type, str, Callable]] = []
    stack: list[list[float]] = []  # per running part: [reserved at its start, its nested parts' growth]

    def wrap(name: str, owner: type, method: str) -> None:
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            stack.append([torch.cuda.memory_reserved() / GIB, 0.0])
            try:
                return original(*args, **kwargs)
            finally:
                start, nested = stack.pop()
                grown = torch.cuda.memory_reserved() / GIB - start
                parts[name] = parts.get(name, 0.0) + grown - nested
                if stack:
                    stack[-1][1] += grown

        originals.append((owner, method, original))
        setattr(owner, method, timed)

    for name, owner, method in PARTS:
        wrap(name, owner, method)
    try:
        yield
    finally:
        for owner, method, original in originals:
            setattr(owner, method, original)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint directory (`voxgate make-checkpoint`)")
    parser.add_argument("--max-batch", default="192,256", help="slot counts, comma-separated")
    args = parser.parse_args()
    tts = TTSModel.load(args.model, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print(json.dumps({"model_reserved_gib": round(torch.cuda.memory_reserved() / GIB, 2),
                      "device_used_gib": round(device_used(), 2)}), flush=True)
    for slots in (int(n) for n in args.max_batch.split(",")):
        before_reserved, before_device = torch.cuda.memory_reserved() / GIB, device_used()
        parts: dict[str, float] = {}
        with measured(parts):
            engine = Engine(tts, EngineConfig(max_batch=slots, step_mode="graphs", attention_backend="triton",
                                              frame_path="triton", chunk_schedule="lead", admission="protect"))
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() / GIB - before_reserved
        print(json.dumps({"slots": engine.runner.cache.shape.slots,
                          "capacity": engine.runner.cache.shape.capacity,
                          **{name: round(value, 2) for name, value in parts.items()},
                          "other_reserved": round(grown - sum(parts.values()), 2), "engine_reserved": round(grown, 2),
                          "device_grown": round(device_used() - before_device, 2),
                          "device_used": round(device_used(), 2)}), flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
