"""Where a model comes from: a checkpoint directory, or a Hugging Face hub id (`Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice`)
fetched into the hub's cache, or found there when offline (HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import re
from pathlib import Path

from engine.errors import CheckpointError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_model(spec: str | Path) -> tuple[Path, str]:
    """(checkpoint directory, the name to announce) of `spec`."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path, path.resolve().name
    if not _HUB_ID.fullmatch(str(spec)) or str(spec).startswith((".", "/")):
        raise CheckpointError(f"--model {spec}: no such checkpoint directory (nor a hub id like Qwen/Qwen3-TTS-...)")
    return _from_hub(str(spec)), str(spec).split("/")[1]


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(f"--model {repo_id}: not a directory, and fetching a hub id needs huggingface_hub "
                              "(pip install huggingface_hub)") from None
    try:
        return Path(snapshot_download(repo_id))
    except LocalEntryNotFoundError:
        raise CheckpointError(f"--model {repo_id}: not in the hub cache and the hub cannot be reached "
                              "(give a checkpoint directory instead)") from None
    except (HfHubHTTPError, OSError, ValueError) as failure:
        raise CheckpointError(f"--model {repo_id}: could not fetch it from the hub: {failure}") from None
