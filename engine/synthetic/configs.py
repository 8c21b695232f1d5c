"""Config dicts in the official `config.json` format: the real 0.6B / 1.7B sizes and tiny test sizes.

The real values are the public Qwen3-TTS 12 Hz configs; the tiny ones keep every vocabulary, special id and the
decoder's frame geometry (16 codebooks x 2048 codes, 1920 samples per frame, 72-frame window) and shrink only widths
and depths, so tests exercise the exact code paths of the real model on a CPU.
"""
from __future__ import annotations

import copy
from typing import Any

LANGUAGES = {"chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071, "spanish": 2054,
             "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069}
DIALECTS = {"beijing_dialect": 2074, "sichuan_dialect": 2062}
SPEAKERS_1B7 = {"serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861, "ono_anna": 2873,
                "sohee": 2864, "eric": 2875, "dylan": 2878}
SPEAKER_DIALECTS = {name: False for name in SPEAKERS_1B7} | {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}
CODEC_IDS = dict(codec_bos_id=2149, codec_eos_token_id=2150, codec_pad_id=2148, codec_think_id=2154,
                 codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157)
SPECIAL_TEXT_IDS = dict(im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671,
                        tts_bos_token_id=151672, tts_eos_token_id=151673)
GENERATION_CONFIG = {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
                     "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
                     "subtalker_temperature": 0.9, "max_new_tokens": 8192}
SPEECH_PREPROCESSOR = {"feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
                       "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
                       "sampling_rate": 24000}
VARIANTS = ("custom_voice", "voice_design", "base")
SIZES = ("tiny", "0b6", "1b7")

_REAL_TALKER = {"0b6": dict(hidden_size=1024, intermediate_size=3072), "1b7": dict(hidden_size=2048, intermediate_size=6144)}
_REAL_LAYERS = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
_REAL_CODE_PREDICTOR = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128)
# Tiny: the CustomVoice / VoiceDesign talker is wider than its code predictor (exercises small_to_mtp_projection,
# like 1.7B); the Base talker has the code predictor's width (Identity projection, like 0.6B).
_TINY_TALKER = {"custom_voice": dict(hidden_size=64, intermediate_size=128),
                "voice_design": dict(hidden_size=64, intermediate_size=128),
                "base": dict(hidden_size=32, intermediate_size=96)}
_TINY_LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_TINY_CODE_PREDICTOR = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)

REAL_DECODER = dict(attention_bias=False, latent_dim=1024, codebook_dim=512, codebook_size=2048, decoder_dim=1536,
                    hidden_act="silu", hidden_size=512, intermediate_size=1024, layer_scale_initial_scale=0.01,
                    max_position_embeddings=8000, head_dim=64, num_attention_heads=16, num_hidden_layers=8,
                    num_key_value_heads=16, num_quantizers=16, rms_norm_eps=1e-5, rope_theta=10000,
                    sliding_window=72, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2])
TINY_DECODER = dict(REAL_DECODER, latent_dim=32, codebook_dim=16, decoder_dim=64, hidden_size=32, intermediate_size=64,
                    head_dim=8, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2)
REAL_ENCODER = dict(codebook_size=2048, codebook_dim=256, num_quantizers=32, hidden_size=512, frame_rate=12.5,
                    sampling_rate=24000)
TINY_ENCODER = dict(REAL_ENCODER, codebook_dim=16, hidden_size=16, num_filters=4, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=32, upsample_groups=16,
                    vector_quantization_hidden_dimension=16)
TINY_SPEAKER_ENCODER = dict(enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
                            enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=4,
                            enc_se_channels=8, sample_rate=24000)


def talker_config(size: str, variant: str) -> dict[str, Any]:
    tiny = size == "tiny"
    width = _TINY_TALKER[variant] if tiny else _REAL_TALKER[size]
    layers = _TINY_LAYERS if tiny else _REAL_LAYERS
    code_predictor = _TINY_CODE_PREDICTOR if tiny else _REAL_CODE_PREDICTOR
    sections = [4, 2, 2] if tiny else [24, 20, 20]
    custom = variant == "custom_voice"
    return dict(
        **width, **layers, **CODEC_IDS,
        vocab_size=3072, text_vocab_size=151936, text_hidden_size=32 if tiny else 2048, num_code_groups=16,
        max_position_embeddings=32768, rope_theta=1000000, rms_norm_eps=1e-6, hidden_act="silu",
        rope_scaling={"interleaved": True, "mrope_section": sections, "rope_type": "default"},
        position_id_per_seconds=13,
        code_predictor_config=dict(**code_predictor, vocab_size=2048, max_position_embeddings=65536,
                                   rope_theta=1000000, num_code_groups=16, rms_norm_eps=1e-6, hidden_act="silu"),
        codec_language_id=LANGUAGES | DIALECTS if custom else dict(LANGUAGES),
        spk_id=dict(SPEAKERS_1B7) if custom else {},
        spk_is_dialect=dict(SPEAKER_DIALECTS) if custom else {},
    )


def model_config(size: str, variant: str) -> dict[str, Any]:
    """The top-level config.json of a checkpoint."""
    if size not in SIZES or variant not in VARIANTS:
        raise ValueError(f"unknown checkpoint {size}/{variant}: sizes {SIZES}, variants {VARIANTS}")
    talker = talker_config(size, variant)
    config = dict(talker_config=talker, tokenizer_type="qwen3_tts_tokenizer_12hz", model_type="qwen3_tts",
                  tts_model_size="1b7" if size == "tiny" else size, tts_model_type=variant, **SPECIAL_TEXT_IDS)
    if variant == "base":
        speaker = TINY_SPEAKER_ENCODER if size == "tiny" else {}
        config["speaker_encoder_config"] = dict(speaker, enc_dim=talker["hidden_size"], sample_rate=24000)
    return copy.deepcopy(config)


def speech_tokenizer_config(size: str) -> dict[str, Any]:
    """speech_tokenizer/config.json."""
    tiny = size == "tiny"
    return copy.deepcopy(dict(
        model_type="qwen3_tts_tokenizer_12hz", encoder_valid_num_quantizers=16, input_sample_rate=24000,
        output_sample_rate=24000, decode_upsample_rate=1920, encode_downsample_rate=1920,
        decoder_config=TINY_DECODER if tiny else REAL_DECODER,
        encoder_config=TINY_ENCODER if tiny else REAL_ENCODER,
    ))
