"""One loaded Qwen3-TTS checkpoint and the single-request synthesis API on top of it.

Validation lives here so that every entry point (CLI, gateway, tests) gives the same clear error for a bad voice,
language or text before any model work starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.checkpoint import UNUSED_DECODER_TENSORS, load_module, read_tensors
from engine.config import ModelConfig, SpeechTokenizerConfig, load_model_config, load_speech_tokenizer_config
from engine.errors import CheckpointError, EmptyText, RequestError, TextTooLong
from engine.model.codec_decoder import CodecDecoder
from engine.model.talker import Talker
from engine.prompt import TEXT_LAYOUTS, Prompt, PromptBuilder, Voice
from engine.reference import generate_frames
from engine.request import RunawayGuard, SyntheticLength, check_text
from engine.sampling import SamplingParams
from engine.text.cleanup import speakable
from engine.text.tokenizer import TextTokenizer, load_tokenizer

ISO_LANGUAGES = {"zh": "chinese", "en": "english", "de": "german", "it": "italian", "pt": "portuguese",
                 "es": "spanish", "ja": "japanese", "ko": "korean", "fr": "french", "ru": "russian"}


@dataclass(frozen=True)
class VoiceRequest:
    """What the user asked for, before validation against the model."""

    speaker: str | None = None
    instruct: str | None = None
    ref_audio: Path | tuple[np.ndarray, int] | None = None
    ref_text: str | None = None
    x_vector_only: bool = False


@dataclass(frozen=True)
class Plan:
    """A validated request, ready for any generation path."""

    prompt: Prompt
    sampling: SamplingParams
    max_frames: int


@dataclass
class Synthesis:
    codes: torch.Tensor  # [frames, 16]
    audio: np.ndarray  # float32 mono
    sample_rate: int


class TTSModel:
    def __init__(self, model_dir: Path, config: ModelConfig, speech: SpeechTokenizerConfig, talker: Talker,
                 decoder: CodecDecoder, tokenizer: TextTokenizer, device: torch.device, dtype: torch.dtype) -> None:
        self.model_dir = model_dir
        self.config = config
        self.speech = speech
        self.talker = talker
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.prompts = PromptBuilder(config, talker)
        self._speaker_encoder = None
        self._reference_encoder = None

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "TTSModel":
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"model directory not found: {model_dir}")
        config = load_model_config(model_dir)
        speech = load_speech_tokenizer_config(model_dir)
        tokenizer = TextTokenizer(load_tokenizer(model_dir))
        with torch.device("meta"):
            talker, decoder = Talker(config.talker), CodecDecoder(speech.decoder)
        load_module(talker, read_tensors(model_dir / "model.safetensors", "talker."), "model.safetensors (talker)")
        load_module(decoder, read_tensors(model_dir / "speech_tokenizer" / "model.safetensors", "decoder."),
                    "speech_tokenizer/model.safetensors (decoder)", is_unused=UNUSED_DECODER_TENSORS.__contains__)
        target = torch.device(device)
        talker = talker.to(target, dtype).eval()
        decoder = decoder.to(target, dtype).eval()
        return cls(model_dir, config, speech, talker, decoder, tokenizer, target, dtype)

    @property
    def model_type(self) -> str:
        return self.config.tts_model_type

    @property
    def sample_rate(self) -> int:
        return self.speech.output_sample_rate

    def default_layout(self) -> str:
        """The reference's choice: all text in the prefill, except voice cloning which feeds a token per frame."""
        return "streaming" if self.model_type == "base" else "prefill"

    def resolve_language(self, language: str | None) -> str:
        name = (language or "auto").strip().lower()
        name = ISO_LANGUAGES.get(name, name)
        if name not in self.config.languages:
            raise RequestError(f"unknown language {language!r}; supported: {', '.join(self.config.languages)} "
                               f"(or ISO codes {', '.join(sorted(ISO_LANGUAGES))})")
        return name

    def voice(self, request: VoiceRequest) -> Voice:
        """Check the request against what this model type can do and build the voice (encodes reference audio)."""
        for field in ("speaker", "instruct", "ref_text"):
            if getattr(request, field) is not None:
                check_text(field, getattr(request, field))
        kind = self.model_type
        if request.speaker and kind != "custom_voice":
            hint = "describe the voice with an instruction" if kind == "voice_design" else "give a reference audio"
            raise RequestError(f"this {kind} model has no built-in speakers ({request.speaker!r} given); {hint}")
        if request.ref_audio is not None and kind != "base":
            raise RequestError(f"reference audio is for voice cloning with a Base model; this model is {kind}")
        if kind == "custom_voice":
            return self._custom_voice(request)
        if kind == "voice_design":
            if not (request.instruct or "").strip():
                raise RequestError("a VoiceDesign model needs an instruction describing the voice")
            return Voice(instruct=request.instruct)
        return self._clone_voice(request)

    def _custom_voice(self, request: VoiceRequest) -> Voice:
        speakers = self.config.speakers
        if not request.speaker:
            raise RequestError(f"a CustomVoice model needs a speaker; choose one of: {', '.join(speakers)}")
        if request.speaker.lower() not in self.config.talker.spk_id:
            raise RequestError(f"unknown speaker {request.speaker!r}; choose one of: {', '.join(speakers)}")
        if request.instruct and self.config.tts_model_size == "0b6":
            raise RequestError("the 0.6B CustomVoice model does not take instructions")
        return Voice(speaker=request.speaker.lower(), instruct=request.instruct or None)

    def _clone_voice(self, request: VoiceRequest) -> Voice:
        from engine.model.reference_encoder import load_reference_audio, resample, to_mono

        if request.instruct:
            raise RequestError("a Base (voice clone) model does not take instructions")
        if request.ref_audio is None:
            raise RequestError("a Base model clones a voice: give a reference audio (and its transcript)")
        if not request.x_vector_only and not (request.ref_text or "").strip():
            raise RequestError("voice cloning needs the reference audio's transcript (or x-vector-only mode)")
        audio, rate = (load_reference_audio(request.ref_audio) if isinstance(request.ref_audio, Path)
                       else (to_mono(request.ref_audio[0]), int(request.ref_audio[1])))
        audio_24k = resample(audio, rate, self.config.speaker_encoder.sample_rate)
        xvector = self.speaker_encoder.embed(audio_24k)
        if request.x_vector_only:
            return self.voice_from_parts(xvector)
        return self.voice_from_parts(xvector, self.reference_encoder.encode(audio, rate), request.ref_text)

    def voice_from_parts(self, xvector: torch.Tensor, ref_codes: torch.Tensor | None = None,
                         ref_text: str | None = None) -> Voice:
        """A clone voice from its encoded parts (a voice stored beside its speaker embedding and reference codes is
        not encoded again): x-vector only without `ref_codes`, in-context with them and their transcript. Raises
        RequestError when the parts cannot belong to this model."""
        if self.model_type != "base":
            raise RequestError(f"a cloned voice is for a Base model; this model is {self.model_type}")
        hidden, groups = self.config.speaker_encoder.enc_dim, self.config.talker.num_code_groups
        if tuple(xvector.shape) != (hidden,):
            raise RequestError(f"a speaker embedding of shape {tuple(xvector.shape)} does not fit this model "
                               f"({hidden},)")
        if ref_codes is None:
            return Voice(xvector=xvector.to(self.device, self.dtype))
        if ref_codes.dim() != 2 or ref_codes.shape[1] != groups or not (ref_text or "").strip():
            raise RequestError(f"reference codes must be [frames, {groups}] with their transcript")
        size = self.decoder.cfg.codebook_size
        if ref_codes.numel() and not 0 <= int(ref_codes.min()) <= int(ref_codes.max()) < size:
            # an index past a codebook would fault the GPU, and with it every request of the engine
            raise RequestError(f"reference codes must be from 0 to {size - 1} (a voice made for another model?)")
        check_text("ref_text", ref_text)
        ref_text_ids = self.tokenizer.reference_text(ref_text)
        if len(ref_text_ids) > ref_codes.shape[0] + 1:  # the prompt lays the transcript over the audio's frames
            raise TextTooLong(f"the transcript takes {len(ref_text_ids)} tokens, more than its audio's "
                              f"{ref_codes.shape[0]} frames (80 ms each) carry: give the words the audio speaks")
        return Voice(xvector=xvector.to(self.device, self.dtype), ref_codes=ref_codes.long().to(self.device),
                     ref_text_ids=ref_text_ids)

    @property
    def speaker_encoder(self):
        """The ECAPA x-vector model, loaded on first use (Base checkpoints only)."""
        if self._speaker_encoder is None:
            from engine.model.speaker_encoder import SpeakerEncoder

            with torch.device("meta"):
                module = SpeakerEncoder(self.config.speaker_encoder)
            load_module(module, read_tensors(self.model_dir / "model.safetensors", "speaker_encoder."),
                        "model.safetensors (speaker_encoder)")
            self._speaker_encoder = module.to(self.device, self.dtype).eval()
        return self._speaker_encoder

    @property
    def reference_encoder(self):
        """The Mimi encoder that turns a reference audio into codes, loaded on first use."""
        if self._reference_encoder is None:
            from engine.model.reference_encoder import ReferenceEncoder

            self._reference_encoder = ReferenceEncoder.from_dir(self.model_dir / "speech_tokenizer", self.device)
        return self._reference_encoder

    def prompt(self, text: str, voice: Voice, language: str, layout: str | None = None) -> tuple[Prompt, int]:
        """The talker prompt and the number of target text tokens."""
        if not speakable(text):
            raise EmptyText()
        role_ids, text_ids = self.tokenizer.target(text)
        return self.prompt_from_ids(text_ids, voice, language, layout, role_ids), len(text_ids)

    def prompt_from_ids(self, text_ids: list[int], voice: Voice, language: str, layout: str | None = None,
                        role_ids: list[int] | None = None) -> Prompt:
        """The talker prompt of tokenized text (streaming text: the ids that have arrived). `role_ids`: the whole
        text's (`TextTokenizer.target`: a text that starts with a line break merges it into the role's own, as the
        reference reads it); None: the plain role, all a stream can know before its text."""
        layout = layout or self.default_layout()
        if layout not in TEXT_LAYOUTS:
            raise RequestError(f"unknown text layout {layout!r}; use one of {', '.join(TEXT_LAYOUTS)}")
        instruct_ids = self.tokenizer.instruction(voice.instruct) if voice.instruct else None
        lang = self.resolve_language(language)
        with torch.inference_mode():
            return self.prompts.build(voice, role_ids or self.tokenizer.role_ids(), text_ids, instruct_ids, lang,
                                      layout)

    def plan(self, text: str, voice: Voice, *, language: str = "auto", layout: str | None = None,
             sampling: SamplingParams | None = None, max_frames: int | None = None,
             guard: RunawayGuard = RunawayGuard(), length: SyntheticLength | None = None) -> Plan:
        """The prompt, the sampling (the checkpoint's defaults unless given) and the frame limit (the runaway
        guard's unless given) of a request; with a synthetic `length` (benchmarks), its exact length instead of the
        guard, and EOS banned."""
        prompt, text_tokens = self.prompt(text, voice, language, layout)
        sampling = sampling or SamplingParams.from_defaults(self.config.generation)
        if length is not None:
            limit, sampling = length.limit(text_tokens, max_frames), length.sampling(sampling)
        else:
            limit = max_frames if max_frames is not None else guard.limit(text_tokens)
        if limit < 1:
            raise RequestError("max_frames must be at least 1")
        return Plan(prompt, sampling, limit)

    def synthesize(self, text: str, voice: Voice, *, language: str = "auto", layout: str | None = None,
                   sampling: SamplingParams | None = None, max_frames: int | None = None,
                   guard: RunawayGuard = RunawayGuard(), length: SyntheticLength | None = None) -> Synthesis:
        plan = self.plan(text, voice, language=language, layout=layout, sampling=sampling, max_frames=max_frames,
                         guard=guard, length=length)
        frames = list(generate_frames(self.talker, plan.prompt, plan.sampling, plan.max_frames))
        codes = (torch.stack(frames) if frames else
                 torch.zeros(0, self.config.talker.num_code_groups, dtype=torch.long, device=self.device))
        return Synthesis(codes=codes.cpu(), audio=self.decode(codes, voice.ref_codes), sample_rate=self.sample_rate)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, context: torch.Tensor | None = None) -> np.ndarray:
        """Codes [T, 16] -> waveform; `context` (voice-clone reference codes) primes the decoder, unheard."""
        state = self.decoder.new_state(1, self.device, self.dtype)
        if context is not None and context.shape[0]:
            self.decoder.decode_step(context[None].to(self.device), state)
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        return self.decoder.decode_step(codes[None].to(self.device), state)[0].float().cpu().numpy()
