"""The one table from the engine's error types to protocol codes and HTTP statuses: the socket and the speech
endpoint report a failure the same way, by its type (never by its message)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EmptyText, EngineFailed, EngineFull, RequestError, SynthesisFailed, TextTooLong, VoxgateError
from realtime.ws.protocol import ProtocolError
from realtime.ws.speech_context import ShuttingDown, SlowReader

# most specific first: the first type the error is an instance of gives its code and status
ENGINE_ERRORS: tuple[tuple[type[VoxgateError], str, int], ...] = (
    (EmptyText, "empty_text", 400),
    (TextTooLong, "text_too_long", 400),
    (RequestError, "invalid_message", 400),
    (EngineFull, "overloaded", 503),
    (EngineFailed, "synthesis_failed", 503),  # the engine restarts: retry later
    (SynthesisFailed, "synthesis_failed", 500),
    (SlowReader, "slow_consumer", 408),  # a streamed HTTP body whose client read too little (its status went out)
    (ShuttingDown, "overloaded", 503),  # the server stopped it (`app.drain`): another server, or this one later
)
PROTOCOL_STATUS = {"unauthorized": 401, "overloaded": 503, "synthesis_failed": 500, "internal": 500}


RETRY_AFTER_S = 1  # a refusal for load: slots and connections free up within seconds
RESTART_RETRY_AFTER_S = 10  # the engine is restarting (a 503 synthesis_failed): a new one loads in seconds to tens


@dataclass
class HTTPFailure(Exception):
    """A refused or failed speech request: its JSON body and status."""
    status: int
    code: str
    message: str
    param: str | None = None  # the body field at fault, where one is

    def headers(self) -> dict[str, str]:
        """`Retry-After` on a refusal for load or a restart (503, 429), which HTTP clients and OpenAI's SDKs wait
        out before they retry; none on the others."""
        if self.status not in (429, 503):
            return {}
        return {"Retry-After": str(RESTART_RETRY_AFTER_S if self.code == "synthesis_failed" else RETRY_AFTER_S)}

    def body(self) -> dict:
        """OpenAI's error shape (its SDKs read `type` and `param` too): our code, the message, OpenAI's type and the
        field at fault."""
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"code": self.code, "message": self.message, "type": kind, "param": self.param}}

    @classmethod
    def of(cls, failure: ProtocolError, status: int | None = None, param: str | None = None) -> "HTTPFailure":
        """A protocol error on HTTP: 400 unless its code says otherwise; `param` defaults to the field it names."""
        return cls(status or PROTOCOL_STATUS.get(failure.code, 400), failure.code, failure.message,
                   param or failure.field)


def engine_error(error: BaseException | None, context_id: str | None = None) -> ProtocolError:
    """The protocol error for what the engine reported (anything unexpected is a failed synthesis)."""
    code, _ = _classify(error)
    message = str(error) if isinstance(error, VoxgateError) and str(error) else "synthesis failed"
    return ProtocolError(code, message, context_id=context_id)


def engine_http_failure(error: BaseException | None) -> HTTPFailure:
    """The speech endpoint's failure for what the engine reported; a text found empty or too long only once spoken
    (a lexicon's replacements made it so) names the body's `input` as its `param`, as the same fault found at once
    does."""
    failure = engine_error(error)
    param = "input" if isinstance(error, (EmptyText, TextTooLong)) else None
    return HTTPFailure(_classify(error)[1], failure.code, failure.message, param)


def _classify(error: BaseException | None) -> tuple[str, int]:
    return next(((code, status) for kind, code, status in ENGINE_ERRORS if isinstance(error, kind)),
                ("synthesis_failed", 500))


# /v1/audio/voices: the codes of the voice library (docs/protocol.md) and their statuses; the socket never sends them
VOICE_LIBRARY_STATUS = {
    "invalid_message": 400, "text_too_long": 400, "invalid_audio": 400, "audio_too_short": 400,
    "audio_too_long": 400, "audio_silent": 400, "unsupported_model": 400, "unknown_voice": 404,
    "voice_exists": 409, "voice_limit": 409, "voice_in_use": 409, "upload_too_large": 413, "overloaded": 503}


def voice_failure(code: str, message: str, param: str | None = None) -> HTTPFailure:
    """A refused voice library request, its status by its code; `param`: the form field at fault, where one is."""
    return HTTPFailure(VOICE_LIBRARY_STATUS[code], code, message, param)
