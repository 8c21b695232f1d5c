"""Shared fixtures: tiny reference checkpoints (built once per session) and a reference audio clip.

`tests/reference.py` imports transformers and qwen_tts (seconds), so it is imported inside the fixtures and tests
that do not need the reference do not pay for it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # `engine` and `tests.reference` import under plain `pytest` too, not only `python -m pytest`
    sys.path.insert(0, ROOT)

VARIANTS = ("custom_voice", "voice_design", "base")
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU through its interpreter


@pytest.fixture(scope="session", autouse=True)
def private_data_home(tmp_path_factory: pytest.TempPathFactory):
    """No test writes to the real per-user data directory: `voxgate serve` processes the tests start (and their
    children) keep their voice library under a temporary $XDG_DATA_HOME."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg_data_home")))
        yield


@pytest.fixture(scope="session")
def reference_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """variant -> directory of a tiny random checkpoint in the official layout (seed 0), written by the reference."""
    from tests.reference import build_reference_checkpoint

    root = tmp_path_factory.mktemp("reference_checkpoints")
    return {variant: build_reference_checkpoint(root / variant, variant, seed=0) for variant in VARIANTS}


@pytest.fixture(scope="session")
def reference_models(reference_checkpoints: dict[str, Path]) -> Any:
    """variant -> the reference `Qwen3TTSModel` loaded from `reference_checkpoints` (loaded on first use)."""
    from tests.reference import load_reference

    class Models(dict):
        def __missing__(self, variant: str) -> Any:
            self[variant] = load_reference(reference_checkpoints[variant])
            return self[variant]

    return Models()


@pytest.fixture(scope="session")
def ref_audio() -> tuple[np.ndarray, int]:
    """A deterministic 2.0 s, 24 kHz test clip (a few sines + a little noise, peak 0.5) as (float32 array, 24000)."""
    sr = 24000
    t = np.arange(2 * sr) / sr
    wav = (0.5 * np.sin(2 * np.pi * 180.0 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 2.5 * t))
           + 0.3 * np.sin(2 * np.pi * 440.0 * t + 0.3) + 0.15 * np.sin(2 * np.pi * 1700.0 * t + 1.1))
    wav += 0.05 * np.random.default_rng(0).standard_normal(t.shape)
    return (0.5 * wav / np.abs(wav).max()).astype(np.float32), sr


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """variant -> a tiny random checkpoint written by our own writer (what `voxgate make-checkpoint` writes)."""
    from engine.synthetic.checkpoints import write_random_checkpoint

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {variant: write_random_checkpoint(root / variant, "tiny", variant, seed=1) for variant in VARIANTS}


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and OpenMP spin-waits crawl on a shared, busy CPU."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
