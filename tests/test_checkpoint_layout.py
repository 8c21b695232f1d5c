"""Our modules have exactly the official checkpoint's tensors at every size (checked on the meta device, so the
real 0.6B / 1.7B sizes cost no memory), and the tiny random checkpoints we write load back."""
import pytest
import torch

from tests.reference import qwen_tts  # noqa: F401  (imports the reference with its torchaudio shim)

# isort: split

from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

from engine.config import RANDOM_WEIGHTS_KEY
from engine.synthetic.checkpoints import tensor_shapes, write_random_checkpoint
from engine.synthetic.configs import SIZES, VARIANTS, model_config, speech_tokenizer_config
from engine.tts import TTSModel


def reference_shapes(size: str, variant: str) -> dict[str, dict[str, tuple[int, ...]]]:
    with torch.device("meta"):
        model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**model_config(size, variant)))
        speech = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**speech_tokenizer_config(size)))
    return {"model.safetensors": {k: tuple(v.shape) for k, v in model.state_dict().items()},
            "speech_tokenizer/model.safetensors": {k: tuple(v.shape) for k, v in speech.state_dict().items()}}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("size", SIZES)
def test_tensor_names_and_shapes_match_the_reference(size: str, variant: str) -> None:
    assert tensor_shapes(size, variant) == reference_shapes(size, variant)


def test_real_sizes_match_the_audited_parameter_counts() -> None:
    """Counts audited against the released checkpoints: 0.6B-Base 914,643,008 params in 478 tensors;
    the codec decoder 114,323,137 params in 271 tensors."""
    shapes = tensor_shapes("0b6", "base")
    main = shapes["model.safetensors"]
    assert len(main) == 478
    assert sum(torch.Size(s).numel() for s in main.values()) == 914_643_008
    decoder = {k: s for k, s in shapes["speech_tokenizer/model.safetensors"].items() if k.startswith("decoder.")}
    assert len(decoder) == 271
    assert sum(torch.Size(s).numel() for s in decoder.values()) == 114_323_137


def test_the_random_weights_mark_loads_in_ours_and_in_the_reference(tmp_path) -> None:
    """make-checkpoint marks its config.json; a transformers config keeps the extra key and builds the same model."""
    path = write_random_checkpoint(tmp_path / "ckpt", "tiny", "voice_design")
    assert TTSModel.load(path).config.random_weights
    config = Qwen3TTSConfig.from_pretrained(path)
    assert getattr(config, RANDOM_WEIGHTS_KEY) is True
    with torch.device("meta"):
        model = Qwen3TTSForConditionalGeneration(config)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == reference_shapes("tiny", "voice_design")[
        "model.safetensors"]
