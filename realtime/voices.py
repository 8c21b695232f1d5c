"""The voices a served model offers: CustomVoice speakers, the VoiceDesign voice (described by `instructions`), the
Base model's clone voices given at start-up, and the voices of the library (`voice_library.py`: cloned or designed
while the server runs, stored on disk). Resolves a client's voice id into the engine's `Voice`, maps OpenAI's voice
names (for the speech endpoint) onto them, and checks languages against the model."""
from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import RequestError
from engine.prompt import Voice
from engine.tts import TTSModel, VoiceRequest
from realtime.voice_store import StoredVoice
from realtime.ws.protocol import ProtocolError

log = logging.getLogger("voxgate")

DESIGN_VOICE = "design"
VOICE_CACHE_BYTES = 4 * 1024 * 1024  # voices with instructions (free text) kept for reuse, least recently used out
VOICE_ENTRY_BYTES = 512  # what a cached voice costs beside its text
# OpenAI's voice names -> the official CustomVoice speaker of a like voice (women to women, men to men, the deep onyx
# to the low uncle_fu); a name whose speaker this model lacks maps to its default voice; `--openai-voice` chooses
OPENAI_VOICES = {"alloy": "vivian", "ash": "ryan", "ballad": "aiden", "coral": "serena", "echo": "eric",
                 "fable": "dylan", "nova": "sohee", "onyx": "uncle_fu", "sage": "ono_anna", "shimmer": "serena",
                 "verse": "aiden", "marin": "vivian", "cedar": "ryan"}


def parse_openai_voice(spec: str) -> tuple[str, str]:
    """NAME=VOICE, as `--openai-voice` takes it: one of OpenAI's voice names and a voice of the served model."""
    name, sep, voice = (part.strip() for part in spec.partition("="))
    if not sep or not voice:
        raise ValueError(f"--openai-voice wants NAME=VOICE (alloy=vivian), got {spec!r}")
    if name.lower() not in OPENAI_VOICES:
        raise ValueError(f"--openai-voice {spec!r}: {name!r} is not an OpenAI voice name ({', '.join(OPENAI_VOICES)})")
    return name.lower(), voice


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
    """A voice the client cannot have: `code` is the protocol's error code for a message's field (`unknown_voice`,
    `invalid_message`; `session.start` answers a bad setting with `invalid_config`), `field` that field."""

    def __init__(self, code: str, message: str, field: str) -> None:
        super().__init__(message)
        self.code, self.field = code, field


class VoiceCatalog:
    def __init__(self, tts: TTSModel, clones: list[CloneVoice] = (), stored: list[StoredVoice] = (),
                 openai_voices: tuple[tuple[str, str], ...] = ()) -> None:
        self.tts = tts
        self.variant = tts.model_type
        self._clones: dict[str, Voice] = {}
        self._stored: dict[str, tuple[StoredVoice, Voice]] = {}  # the library's, in the order they were made
        self._described = _VoiceCache(VOICE_CACHE_BYTES)  # (speaker, instructions) -> voice
        if clones and self.variant != "base":
            raise ValueError(f"--clone-voice needs a Base (voice clone) model; this one is {self.variant}")
        if self.variant == "custom_voice":
            self.builtin_ids = list(tts.config.speakers)
        elif self.variant == "voice_design":
            self.builtin_ids = [DESIGN_VOICE]
        else:
            self.builtin_ids = []
            for clone in clones:  # encoded once, at start-up: a bad reference audio stops the server there
                self._clones[clone.name] = tts.voice(VoiceRequest(
                    ref_audio=clone.audio, ref_text=clone.transcript, x_vector_only=clone.transcript is None))
                self.builtin_ids.append(clone.name)
        for voice in stored:
            try:
                self.add_stored(voice, engine_voice(tts, voice))
            except RequestError as failure:  # kept by a version that took it; it could never speak: left out
                log.warning("the stored voice %r is left out: %s", voice.name, failure)
        self.openai_voices = self._map_openai_voices(dict(openai_voices))

    def _map_openai_voices(self, chosen: dict[str, str]) -> dict[str, str | None]:
        """Each OpenAI voice name -> a voice id of this model: `chosen`, else OPENAI_VOICES' like speaker, else None:
        the default as it is when a request comes (a Base model's voices come and go); a chosen voice the model
        lacks stops the server at start-up."""
        mapped = {}
        for name, speaker in OPENAI_VOICES.items():
            voice = chosen.get(name)
            if voice is not None and not self.has(voice):
                raise ValueError(f"--openai-voice {name}={voice}: {self._unknown(voice)}")
            like = speaker if self.variant == "custom_voice" and speaker in self.builtin_ids else None
            mapped[name] = self._key(voice) if voice is not None else like
        return mapped

    def openai_names_of(self, voice_id: str) -> list[str]:
        """The OpenAI voice names that `--openai-voice` maps to this voice."""
        key = self._key(voice_id)
        return [name for name, voice in self.openai_voices.items() if voice == key]

    def openai_voice(self, voice_id: str | None) -> str | None:
        """The model's voice for one of OpenAI's voice names, in any case; any other id as it is (the model's own
        voices first: a clone named `alloy` stays itself, and `Alloy` is that clone too, as GET /v1/voices lists)."""
        if voice_id is None or self.has(voice_id):
            return voice_id
        name = voice_id.lower()
        if name in self.openai_voices and self.has(name):
            return name
        return self.openai_voices.get(name, voice_id)

    @property
    def ids(self) -> list[str]:
        return [*self.builtin_ids, *self._stored]

    @property
    def default(self) -> str | None:
        """A CustomVoice model's vivian, else the first voice (a Base model's first `--clone-voice`, else its oldest
        stored voice: an upload never takes the default over); None for a Base model with no voice yet."""
        ids = self.ids
        if self.variant == "custom_voice" and "vivian" in self.builtin_ids:
            return "vivian"
        return ids[0] if ids else None

    @property
    def _speakers_take_instructions(self) -> bool:
        """A CustomVoice model's speakers take instructions on the 1.7B model, not on the 0.6B one."""
        return self.variant == "custom_voice" and self.tts.config.tts_model_size != "0b6"

    def has(self, voice_id: str) -> bool:
        """A voice of that id exists (built in, given at start-up or stored); ids are case-sensitive, except the
        speakers of a CustomVoice model."""
        return voice_id in self._stored or self._key(voice_id) in self.builtin_ids

    def takes_instructions(self, voice_id: str | None) -> bool:
        """Instructions shape this voice (None: the default): the VoiceDesign model's voice or a 1.7B CustomVoice
        speaker; not a stored voice (it keeps what it was saved with), a clone, nor a 0.6B CustomVoice speaker."""
        voice_id = voice_id if voice_id is not None else self.default
        if voice_id in self._stored or self.variant == "base":
            return False
        return self._speakers_take_instructions or self.variant == "voice_design"

    def add_stored(self, stored: StoredVoice, voice: Voice) -> None:
        self._stored[stored.name] = (stored, voice)

    def remove_stored(self, name: str) -> None:
        """Gone for new contexts and requests; those already speaking with it keep their `Voice`."""
        self._stored.pop(name, None)

    def stored(self, name: str) -> StoredVoice | None:
        entry = self._stored.get(name)
        return entry[0] if entry is not None else None

    def stored_voices(self) -> list[StoredVoice]:
        return [stored for stored, _ in self._stored.values()]

    def warm_up_voice(self) -> Voice:
        """The default voice, or for a Base model with none yet a neutral (all-zero) speaker embedding: the warm-up
        only checks that synthesis runs, its audio goes nowhere."""
        if self.default is None:
            return Voice(xvector=torch.zeros(self.tts.config.speaker_encoder.enc_dim, dtype=self.tts.dtype,
                                             device=self.tts.device))
        return self.resolve(None, "a calm voice" if self.variant == "voice_design" else None)

    def describe(self) -> dict[str, Any]:
        """The body of GET /v1/voices."""
        instructions = self.variant == "voice_design" or self._speakers_take_instructions
        voices = [{"id": voice, "variant": self.variant, "languages": self.tts.config.languages,
                   "instructions": "required" if self.variant == "voice_design" else instructions}
                  for voice in self.builtin_ids]
        voices += [{"id": name, "variant": self.variant, "languages": self.tts.config.languages,
                    "instructions": False, "stored": True, "kind": stored.kind}
                   for name, (stored, _) in self._stored.items()]
        return {"voices": voices, "default": self.default,
                "openai_voices": {name: self.openai_voice(name) or self.default for name in self.openai_voices}}

    def check_voice(self, voice_id: str) -> str:
        """A session's default voice must exist (PROTOCOL.md: a bad session.start field is `invalid_config`); its id
        as the catalog names it."""
        if not self.has(voice_id):
            raise ProtocolError("invalid_config", self._unknown(voice_id))
        return self.canonical(voice_id)

    def canonical(self, voice_id: str) -> str:
        """The id as the catalog names it, which the server echoes: a CustomVoice model's speakers are matched in
        any case (`SERENA` is `serena`); other ids are case-sensitive."""
        return voice_id if voice_id in self._stored else self._key(voice_id)

    def check_language(self, language: str) -> None:
        """A session's default language must exist (`invalid_config`, as for a voice)."""
        try:
            self.resolve_language(language)
        except VoiceError as failure:
            raise ProtocolError("invalid_config", str(failure)) from None

    def resolve_language(self, language: str | None) -> str:
        """The model's name for `language` (a name, an ISO code or auto): the gateway's one language check, for
        sessions, contexts and the speech endpoint alike; raises VoiceError (`invalid_message`)."""
        try:
            return self.tts.resolve_language(language)
        except RequestError as failure:
            raise VoiceError("invalid_message", str(failure), "language") from None

    def _key(self, voice_id: str) -> str:
        return voice_id.lower() if self.variant == "custom_voice" else voice_id

    def _unknown(self, voice_id: str) -> str:
        if not self.ids:
            return f"unknown voice {voice_id[:64]!r}; this model has no voice now: POST /v1/audio/voices clones one"
        listed = f"{', '.join(self.ids[:12])}{', ...' if len(self.ids) > 12 else ''}"
        return f"unknown voice {voice_id[:64]!r}; GET /v1/voices lists them ({listed})"

    def resolve(self, voice_id: str | None, instructions: str | None) -> Voice:
        """The engine voice for `voice_id` (None: the default) with optional instructions; raises VoiceError."""
        voice_id = voice_id or self.default
        if voice_id is None:
            raise VoiceError("unknown_voice", "this Base model has no voice yet: POST /v1/audio/voices clones one",
                             "voice")
        key = self._key(voice_id)
        if not self.has(voice_id):
            raise VoiceError("unknown_voice", self._unknown(voice_id), "voice")
        instructions = (instructions or "").strip() or None
        if key in self._stored:
            if instructions is not None:
                raise VoiceError("invalid_message", f"the stored voice {key!r} does not take instructions (a "
                                                    "designed voice keeps the instruction it was saved with)",
                                 "instructions")
            return self._stored[key][1]
        if self.variant == "voice_design" and instructions is None:
            raise VoiceError("invalid_message", "the VoiceDesign model needs `instructions` describing the voice",
                             "instructions")
        if self.variant == "base":
            if instructions is not None:
                raise VoiceError("invalid_message", "a cloned voice does not take instructions", "instructions")
            return self._clones[key]
        cached = self._described.get((key, instructions))
        if cached is not None:
            return cached
        try:
            voice = self.tts.voice(VoiceRequest(speaker=key if self.variant == "custom_voice" else None,
                                                instruct=instructions))
        except RequestError as failure:
            raise VoiceError("invalid_message", str(failure), "instructions") from None
        self._described.put((key, instructions), voice)
        return voice


def engine_voice(tts: TTSModel, stored: StoredVoice) -> Voice:
    """A stored voice as the engine takes it: its tensors on the model's device, nothing encoded again (a transcript
    is tokenized, which takes microseconds). Raises RequestError when it does not fit the model."""
    if stored.kind == "design":
        return tts.voice(VoiceRequest(instruct=stored.instruction))
    return tts.voice_from_parts(stored.xvector, stored.ref_codes, stored.transcript)


class _VoiceCache:
    """Least recently used voices, bounded in bytes: instructions are free text, so entries are not all alike."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._voices: OrderedDict[tuple[str, str | None], Voice] = OrderedDict()

    def __len__(self) -> int:
        return len(self._voices)

    def get(self, key: tuple[str, str | None]) -> Voice | None:
        voice = self._voices.get(key)
        if voice is not None:
            self._voices.move_to_end(key)
        return voice

    def put(self, key: tuple[str, str | None], voice: Voice) -> None:
        if key in self._voices:
            return
        self._voices[key] = voice
        self.bytes += _cost(key)
        while self.bytes > self.max_bytes:
            evicted, _ = self._voices.popitem(last=False)
            self.bytes -= _cost(evicted)


def _cost(key: tuple[str, str | None]) -> int:
    speaker, instructions = key
    return VOICE_ENTRY_BYTES + sys.getsizeof(speaker) + sys.getsizeof(instructions or "")
