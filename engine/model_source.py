"""Where a model comes from: a checkpoint directory, or a Hugging Face hub id (`Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice`)
fetched into the hub's cache, or found there when offline (HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import re
from pathlib import Path

from engine.config import ModelConfig, SpeechTokenizerConfig
from engine.errors import CheckpointError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# the official checkpoints: config size -> (name in the hub id, talker width, talker depth); a config that claims a
# size with other dimensions (the tiny test models claim 1b7) is not that model
OFFICIAL_SIZES = {"0b6": ("0.6B", 1024, 28), "1b7": ("1.7B", 2048, 28)}
OFFICIAL_VARIANTS = {"base": "Base", "custom_voice": "CustomVoice", "voice_design": "VoiceDesign"}
OFFICIAL_FRAME_RATE = 12.5  # the "12Hz" of the hub ids
OFFICIAL_HUB_IDS = frozenset({"Qwen/Qwen3-TTS-12Hz-0.6B-Base", "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice",
                              "Qwen/Qwen3-TTS-12Hz-1.7B-Base", "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
                              "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign"})  # no 0.6B VoiceDesign was released


def resolve_model(spec: str | Path) -> tuple[Path, str]:
    """(checkpoint directory, the name to announce) of `spec`."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path, path.resolve().name
    if not is_hub_id(spec):
        raise CheckpointError(f"--model {spec}: no such checkpoint directory (nor a hub id like Qwen/Qwen3-TTS-...)")
    return _from_hub(str(spec)), str(spec).split("/")[1]


def is_hub_id(spec: str | Path) -> bool:
    """Whether `spec` names a hub repository rather than a directory on this machine."""
    return not Path(spec).expanduser().is_dir() and bool(_HUB_ID.fullmatch(str(spec))) and \
        not str(spec).startswith((".", "/"))


def official_hub_id(config: ModelConfig, speech: SpeechTokenizerConfig) -> str | None:
    """The hub id of the official checkpoint whose shape this config has (`Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice`),
    so that a server on a directory in the official layout answers to the name clients know; None when the config
    does not match one (a test model, another tokenizer)."""
    size = OFFICIAL_SIZES.get(config.tts_model_size)
    variant = OFFICIAL_VARIANTS.get(config.tts_model_type)
    layers = config.talker.layers
    frame_rate = speech.output_sample_rate / speech.decoder.samples_per_frame
    if size is None or variant is None or (layers.hidden_size, layers.num_hidden_layers) != size[1:] or \
            frame_rate != OFFICIAL_FRAME_RATE:
        return None
    hub_id = f"Qwen/Qwen3-TTS-12Hz-{size[0]}-{variant}"
    return hub_id if hub_id in OFFICIAL_HUB_IDS else None


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
