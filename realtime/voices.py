"""The voices a served model offers: CustomVoice speakers, the VoiceDesign voice (described by `instructions`), and
the Base model's clone voices given at start-up. Resolves a client's voice id into the engine's `Voice`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import RequestError
from engine.prompt import Voice
from engine.tts import TTSModel, VoiceRequest

DESIGN_VOICE = "design"


@dataclass(frozen=True)
class CloneVoice:
    name: str
    audio: Path
    transcript: str | None = None  # None: clone from the speaker embedding alone

    @classmethod
    def parse(cls, spec: str) -> "CloneVoice":
        """NAME=WAV[:TRANSCRIPT], as `--clone-voice` takes it."""
        name, sep, rest = spec.partition("=")
        if not sep or not name.strip() or not rest:
            raise ValueError(f"--clone-voice wants NAME=WAV[:TRANSCRIPT], got {spec!r}")
        audio, _, transcript = rest.partition(":")
        return cls(name.strip(), Path(audio), transcript.strip() or None)


class VoiceError(Exception):
    """A voice the client cannot have: `code` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class VoiceCatalog:
    def __init__(self, tts: TTSModel, clones: list[CloneVoice] = ()) -> None:
        self.tts = tts
        self.variant = tts.model_type
        self._voices: dict[tuple[str, str | None], Voice] = {}
        if self.variant == "custom_voice":
            self.ids = list(tts.config.speakers)
        elif self.variant == "voice_design":
            self.ids = [DESIGN_VOICE]
        else:
            self.ids = []
            for clone in clones:  # encoded once, at start-up: a bad reference audio stops the server there
                self._voices[(clone.name, None)] = tts.voice(VoiceRequest(
                    ref_audio=clone.audio, ref_text=clone.transcript, x_vector_only=clone.transcript is None))
                self.ids.append(clone.name)
        if not self.ids:
            raise ValueError("a Base model clones voices: give at least one --clone-voice NAME=WAV[:TRANSCRIPT]")

    @property
    def default(self) -> str:
        return "vivian" if "vivian" in self.ids else self.ids[0]

    def describe(self) -> dict[str, Any]:
        """The body of GET /v1/voices."""
        instructions = self.variant == "voice_design" or (
            self.variant == "custom_voice" and self.tts.config.tts_model_size != "0b6")
        voices = [{"id": voice, "variant": self.variant, "languages": self.tts.config.languages,
                   "instructions": "required" if self.variant == "voice_design" else instructions}
                  for voice in self.ids]
        return {"voices": voices, "default": self.default}

    def resolve(self, voice_id: str | None, instructions: str | None) -> Voice:
        """The engine voice for `voice_id` (None: the default) with optional instructions; raises VoiceError."""
        voice_id = voice_id or self.default
        key = voice_id.lower() if self.variant == "custom_voice" else voice_id
        if key not in self.ids:
            raise VoiceError("unknown_voice", f"unknown voice {voice_id!r}; GET /v1/voices lists them "
                                              f"({', '.join(self.ids[:12])}{', ...' if len(self.ids) > 12 else ''})")
        instructions = (instructions or "").strip() or None
        if self.variant == "voice_design" and instructions is None:
            raise VoiceError("invalid_config", "the VoiceDesign model needs `instructions` describing the voice")
        cached = self._voices.get((key, None if self.variant == "base" else instructions))
        if cached is not None:
            return cached
        if self.variant == "base":
            raise VoiceError("invalid_config", "a cloned voice does not take instructions")
        try:
            voice = self.tts.voice(VoiceRequest(speaker=key if self.variant == "custom_voice" else None,
                                                instruct=instructions))
        except RequestError as failure:
            raise VoiceError("invalid_config", str(failure)) from None
        if len(self._voices) < 1024:  # instructions are free text: bound the cache
            self._voices[(key, instructions)] = voice
        return voice
