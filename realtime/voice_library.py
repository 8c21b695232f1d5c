"""`/v1/audio/voices`: voices cloned (Base) or designed (VoiceDesign) while the server runs, stored on disk
(`voice_store.py`) and served like built-in voices (`voices.py`).

An upload is a multipart form: `name`, and either a reference `audio` file with an optional `transcript` (with it
the voice clones in context, without it from the speaker embedding alone), or a VoiceDesign `instruction`. The body
is read no further than the size limit; decoding and the encoders run on a worker thread, one upload at a time, and
their results (speaker embedding, reference codes) are stored, so that using the voice later encodes nothing."""
from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from engine.errors import (
    AudioInputError,
    ReferenceTooLong,
    ReferenceTooShort,
    RequestError,
    TextTooLong,
    UndecodableAudio,
    UnreadableAudio,
)
from engine.model.reference_encoder import decode_reference_audio
from engine.tts import TTSModel, VoiceRequest
from realtime.errors import voice_failure
from realtime.lexicon import control_character, has_visible_character
from realtime.voice_store import StoredVoice, VoiceNameTaken, VoiceStore
from realtime.voices import VoiceCatalog
from realtime.ws.protocol import MAX_INSTRUCTIONS_CHARS

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # safe in a URL path, a log line and a JSON key
MIN_AUDIO_SECONDS = 1.0
MAX_AUDIO_SECONDS = 30.0  # an in-context voice puts all of its reference codes in every prompt (12.5 a second)
SILENCE_DBFS = -50.0  # a reference whose loudest 20 ms window is quieter than this holds no voice
SILENCE_WINDOW_S = 0.02
MAX_TEXT_FIELD_BYTES = 16 * 1024  # a text field of the form (transcript, instruction) past this is malformed
MAX_FORM_FIELDS = 8
MAX_DELIMITERS = MAX_FORM_FIELDS + 2  # one a part (the fields and a file), and the closing one
FIELDS = ("name", "audio", "transcript", "instruction")
UPLOAD_VARIANTS = ("base", "voice_design")
# uploads in progress at once, from their body's first byte to their voice stored: each holds its body (up to
# --max-voice-upload-bytes, spooled to TMPDIR while it arrives, in memory while it waits for the one encoder), so
# their count bounds what uploads can take (a memory hostile try: ~26 MB each, unbounded, 20 waiting took 529 MB)
MAX_UPLOADS_IN_PROGRESS = 8


@dataclass(frozen=True)
class VoiceUpload:
    name: str
    audio: bytes | None = None
    transcript: str | None = None  # None: clone from the speaker embedding alone
    instruction: str | None = None


class UploadTooLarge(Exception):
    """The body passed the upload size limit while it was being read."""


class TooManyDelimiters(Exception):
    """The body's boundary came more often than a form the endpoint takes has parts."""


async def read_upload(request: Request, max_bytes: int) -> VoiceUpload:
    """The form of a POST /v1/audio/voices, read no further than `max_bytes`; raises HTTPFailure naming the problem
    (413 `upload_too_large` past the limit, 400 `invalid_message` for a malformed form or field)."""
    media_type, options = parse_options_header(request.headers.get("content-type", ""))
    if media_type.lower() != b"multipart/form-data":  # (a prefix was taken: multipart/form-data-not-really)
        raise voice_failure("invalid_message", "the body must be multipart/form-data with fields name, audio "
                                               "(a file) and transcript, or name and instruction")
    if options.get(b"charset", b"utf-8").lower() not in (b"utf-8", b"utf8"):  # starlette decoded fields in it
        raise voice_failure("invalid_message", "the form's text fields are UTF-8: leave the charset out of its "
                                               "Content-Type, or give utf-8")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = _delimited(_capped(request.stream(), max_bytes), options.get(b"boundary"))
    parser = _Utf8FormParser(request.headers, body, max_files=1, max_fields=MAX_FORM_FIELDS,
                             max_part_size=MAX_TEXT_FIELD_BYTES)
    try:
        form = await parser.parse()
    except UploadTooLarge:
        raise _too_large(max_bytes) from None
    except TooManyDelimiters:
        raise voice_failure("invalid_message", f"malformed multipart form: its boundary occurs more than "
                                               f"{MAX_DELIMITERS} times; a form takes at most {MAX_FORM_FIELDS} "
                                               "fields and a file") from None
    except MultiPartException as failure:
        raise voice_failure("invalid_message", f"malformed multipart form: {failure.message}") from None
    try:
        return await _upload_of(form)
    finally:
        await form.close()


class _Utf8FormParser(MultiPartParser):
    """Starlette's parser reads a text field that is not valid UTF-8 as latin-1, silently (a transcript of
    surrogate bytes was stored and spoken as other text); the protocol's strings are valid Unicode, so such a field
    is a malformed form. And it returns the parts that ended when the body stops before the closing boundary,
    dropping the cut one (a voice was stored without the transcript cut off): a form cut short is malformed too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._closed = False  # the closing boundary has come

    async def parse(self) -> FormData:
        form = await super().parse()
        if not self._closed:
            await form.close()
            raise MultiPartException("the body ends before the form's closing boundary: it was cut short")
        return form

    def on_end(self) -> None:
        self._closed = True

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        """Starlette's message for a long text field names no field ("Part exceeded maximum size of 16KB"): a
        reference audio sent without a filename is such a field."""
        part = self._current_part
        if part.file is None and len(part.data) + end - start > self.max_part_size:
            raise MultiPartException(f"the field {part.field_name!r} takes at most {self.max_part_size} bytes; a "
                                     "reference audio is sent as a file part (with a filename)")
        super().on_part_data(data, start, end)

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                part.data.decode("utf-8")
            except UnicodeDecodeError:
                raise MultiPartException(f"the text field {part.field_name!r} is not valid UTF-8; a reference audio "
                                         "is sent as a file part (with a filename)") from None
        super().on_part_end()


async def _delimited(stream: AsyncIterator[bytes], boundary: bytes | None) -> AsyncIterator[bytes]:
    """The body, counting its delimiters as it passes (at C speed, across reads): past MAX_DELIMITERS it raises
    TooManyDelimiters before the parser reads on. The parser takes every delimiter not followed by a line end or
    "--" as data byte by byte, in Python, on the event loop: a body of them (`\r\n--a` + `x`, over and over, with
    boundary `a`) cost it 25x a plain body, 1.7 s for 16 MiB, and made another client's stream underrun (a hostile
    try)."""
    if not boundary:  # the parser names what is missing
        async for piece in stream:
            yield piece
        return
    delimiter, seen, tail = b"--" + boundary, 0, b""
    async for piece in stream:
        window = tail + piece  # the tail is too short to hold a delimiter: none is counted twice
        seen += window.count(delimiter)
        if seen > MAX_DELIMITERS:
            raise TooManyDelimiters()
        tail = window[1 - len(delimiter):]
        yield piece


async def _capped(stream: AsyncIterator[bytes], max_bytes: int) -> AsyncIterator[bytes]:
    read = 0
    async for piece in stream:
        read += len(piece)
        if read > max_bytes:
            raise UploadTooLarge()
        yield piece


def _too_large(max_bytes: int):
    return voice_failure("upload_too_large", f"an upload takes at most {max_bytes} bytes (--max-voice-upload-bytes)")


async def _upload_of(form: FormData) -> VoiceUpload:
    for field in FIELDS:
        if len(form.getlist(field)) > 1:
            raise voice_failure("invalid_message", f"{field} is given more than once", field)
    name, transcript, instruction = (_text_field(form, field) for field in ("name", "transcript", "instruction"))
    if name is None:
        raise voice_failure("invalid_message", "name is required: the voice's id, 1 to 64 letters, digits, '_', "
                                               "'-' or '.', starting with a letter or digit", "name")
    audio = form.get("audio")
    if audio is not None and not isinstance(audio, UploadFile):
        raise voice_failure("invalid_message", "audio must be a file part (a filename in its Content-Disposition)",
                            "audio")
    return VoiceUpload(name, await audio.read() if audio is not None else None, transcript, instruction)


def _text_field(form: FormData, field: str) -> str | None:
    """A text field, None when absent or blank (nothing visible: spaces, zero-width or other format characters)."""
    value = form.get(field)
    if isinstance(value, UploadFile):
        raise voice_failure("invalid_message", f"{field} must be a text field, not a file", field)
    return value if value is not None and has_visible_character(value) else None


class VoiceLibrary:
    """The stored voices of the served checkpoint: checks an upload against the model and the limits, encodes it
    off the event loop, stores it and adds it to the catalog; deletes."""

    def __init__(self, tts: TTSModel, catalog: VoiceCatalog, store: VoiceStore | None, max_voices: int) -> None:
        self.tts, self.catalog, self.store, self.max_voices = tts, catalog, store, max_voices
        self._encoding = asyncio.Lock()  # one upload's encoders at a time: they are heavy, and share the model
        self._uploads = 0  # in progress (MAX_UPLOADS_IN_PROGRESS)

    def voices(self) -> list[dict]:
        return [voice.describe() for voice in self.catalog.stored_voices()]

    def voice(self, voice_id: str) -> dict:
        stored = self.catalog.stored(voice_id)
        if stored is None:
            raise self._unknown(voice_id)
        return stored.describe()

    @contextlib.contextmanager
    def upload_turn(self) -> Iterator[None]:
        """One of MAX_UPLOADS_IN_PROGRESS uploads, held from before its body is read until its voice is stored;
        past them, 503 `overloaded` (with Retry-After) before the body is read."""
        if self._uploads >= MAX_UPLOADS_IN_PROGRESS:
            raise voice_failure("overloaded", f"{MAX_UPLOADS_IN_PROGRESS} voice uploads are in progress; try again "
                                              "shortly")
        self._uploads += 1
        try:
            yield
        finally:
            self._uploads -= 1

    async def create(self, upload: VoiceUpload) -> dict:
        """Check, encode, store and serve an uploaded voice; raises HTTPFailure."""
        self._check(upload)
        async with self._encoding:
            self._check_room(upload.name)  # again: other uploads may have finished meanwhile
            stored, voice = await asyncio.to_thread(self._make, upload)
        self.catalog.add_stored(stored, voice)
        return stored.describe()

    async def delete(self, voice_id: str) -> dict:
        """Remove a stored voice: new requests no longer find it, those speaking with it finish."""
        if self.catalog.stored(voice_id) is None:
            raise self._unknown(voice_id)
        mapped = self.catalog.openai_names_of(voice_id)
        if mapped:  # deleted, those names would speak no voice, and the server's next start with them would fail
            raise voice_failure("voice_in_use", f"the voice {voice_id!r} is what --openai-voice maps "
                                                f"{', '.join(mapped)} to: restart without that mapping to delete it")
        self.catalog.remove_stored(voice_id)
        await asyncio.to_thread(self.store.delete, voice_id)
        return {"id": voice_id, "deleted": True}

    def check_model(self) -> None:
        """Raises unsupported_model for a model that makes no voices: told before an upload's body is read."""
        variant = self.catalog.variant
        if variant not in UPLOAD_VARIANTS or self.store is None:
            raise voice_failure("unsupported_model", f"this {variant} model cannot make voices: uploads need a Base "
                                                     "model (cloning) or a VoiceDesign model (an instruction)")

    def _check(self, upload: VoiceUpload) -> None:
        """Everything that can be told before any decoding: the model, the name, the fields, the count."""
        self.check_model()
        variant = self.catalog.variant
        if not NAME_PATTERN.fullmatch(upload.name):
            raise voice_failure("invalid_message", f"name {upload.name[:64]!r} is not a voice id: 1 to 64 letters, "
                                                   "digits, '_', '-' or '.', starting with a letter or digit", "name")
        for field, value in (("transcript", upload.transcript), ("instruction", upload.instruction)):
            if value is not None and len(value) > MAX_INSTRUCTIONS_CHARS:
                raise voice_failure("text_too_long", f"{field} takes at most {MAX_INSTRUCTIONS_CHARS} characters",
                                    field)
            control = control_character(value or "")
            if control is not None:
                raise voice_failure("invalid_message", f"{field} holds the control character U+{ord(control):04X}; "
                                                       "text fields take none but tabs and line ends", field)
        if variant == "base":
            if upload.audio is None or upload.instruction is not None:
                raise voice_failure("invalid_message", "a Base model clones a voice: give a reference audio file "
                                                       "(audio) and, for in-context cloning, its transcript; not an "
                                                       "instruction")
        elif upload.instruction is None or upload.audio is not None or upload.transcript is not None:
            raise voice_failure("invalid_message", "a VoiceDesign model saves a designed voice: give an instruction "
                                                   "describing it, and no audio or transcript")
        self._check_room(upload.name)

    def _check_room(self, name: str) -> None:
        """The name is free and the library has room for one more."""
        if self.catalog.has(name):
            raise voice_failure("voice_exists", f"a voice named {name!r} exists already (GET /v1/voices lists them)",
                                "name")
        if len(self.catalog.stored_voices()) >= self.max_voices:
            raise voice_failure("voice_limit", f"the library holds its maximum of {self.max_voices} voices for this "
                                               "model (--max-stored-voices); delete one first")

    def _make(self, upload: VoiceUpload):
        """On a worker thread: decode and encode the upload, store it; returns the record and the engine voice."""
        try:
            if upload.instruction is not None:
                voice = self.tts.voice(VoiceRequest(instruct=upload.instruction))
                stored = StoredVoice(upload.name, "design", time.time(), instruction=upload.instruction)
            else:
                audio, rate = reference_audio(upload.audio)
                voice = self.tts.voice(VoiceRequest(ref_audio=(audio, rate), ref_text=upload.transcript,
                                                    x_vector_only=upload.transcript is None))
                if not torch.isfinite(voice.xvector).all():  # samples far out of range (a float WAV of 1e30)
                    raise voice_failure("invalid_audio", "the audio gives no usable voice: its speaker embedding is "
                                                         "not finite (are its samples within -1..1?)", "audio")
                ref_codes = voice.ref_codes.cpu() if voice.ref_codes is not None else None
                stored = StoredVoice(upload.name, "clone", time.time(), transcript=upload.transcript,
                                     audio_seconds=round(audio.size / rate, 3), xvector=voice.xvector.cpu(),
                                     ref_codes=ref_codes)
        except TextTooLong as failure:
            raise voice_failure("text_too_long", str(failure),
                                "instruction" if upload.instruction is not None else "transcript") from None
        except AudioInputError as failure:
            raise voice_failure("invalid_message", str(failure), "audio") from None
        except RequestError as failure:
            raise voice_failure("invalid_message", str(failure)) from None
        try:
            self.store.add(stored)
        except VoiceNameTaken:
            raise voice_failure("voice_exists", f"a voice named {upload.name!r} exists already", "name") from None
        return stored, voice

    @staticmethod
    def _unknown(voice_id: str):
        return voice_failure("unknown_voice", f"no stored voice {voice_id[:64]!r}; GET /v1/audio/voices lists them "
                                              "(built-in voices are not the library's)")


def reference_audio(data: bytes) -> tuple[np.ndarray, int]:
    """An uploaded reference decoded and checked: audio (`invalid_audio`), at least MIN_AUDIO_SECONDS
    (`audio_too_short`), at most MAX_AUDIO_SECONDS (`audio_too_long`, told before decoding, or as the decode
    passes it where the header does not record the length), not silent
    (`audio_silent`)."""
    try:
        audio, rate = decode_reference_audio(data, "the audio", MIN_AUDIO_SECONDS, MAX_AUDIO_SECONDS)
    except UndecodableAudio as failure:
        raise voice_failure("invalid_audio", f"{failure}; upload WAV, FLAC, OGG or MP3", "audio") from None
    except UnreadableAudio as failure:  # read, but not usable (its rate, channels or samples): the message says why
        raise voice_failure("invalid_audio", str(failure), "audio") from None
    except ReferenceTooShort as failure:
        raise voice_failure("audio_too_short", str(failure), "audio") from None
    except ReferenceTooLong as failure:
        raise voice_failure("audio_too_long", str(failure), "audio") from None
    loudest = loudest_window_dbfs(audio, rate)
    if loudest < SILENCE_DBFS:
        raise voice_failure("audio_silent", f"the audio is silent (its loudest 20 ms is {loudest:.0f} dBFS, under "
                                            f"{SILENCE_DBFS:.0f}): there is no voice to clone", "audio")
    return audio, rate


def loudest_window_dbfs(audio: np.ndarray, rate: int) -> float:
    """The RMS level of the loudest SILENCE_WINDOW_S window, in dB below full scale."""
    window = max(1, int(rate * SILENCE_WINDOW_S))
    usable = audio[: audio.size - audio.size % window].reshape(-1, window) if audio.size >= window else audio[None]
    rms = float(np.sqrt(np.mean(np.square(usable, dtype=np.float64), axis=1)).max())
    return 20 * np.log10(max(rms, 1e-12))
