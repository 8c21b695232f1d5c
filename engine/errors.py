"""The engine's errors, by type: callers map a type to their own codes (the gateway: `realtime/errors.py`), never a
message to anything. Each message names the problem for the user, so no traceback is needed. They pickle, so the
engine process sends them to its parent as they are."""

import logging


class VoxgateError(Exception):
    """Base class: the message is meant for the user as it is."""


class CheckpointError(VoxgateError):
    """A checkpoint directory is missing a file, or a file is malformed."""


class BenchmarkOnlyError(VoxgateError, ValueError):
    """A benchmark-only setting with a value out of range, or asked of a checkpoint it could harm (one not marked
    as random weights): refused before anything runs."""


class RequestError(VoxgateError):
    """A synthesis request asks for something this model cannot do (bad voice, bad language, bad text, ...)."""


class AudioInputError(RequestError):
    """A reference audio cannot be read or is unusable."""


class UnreadableAudio(AudioInputError):
    """Not audio that libsndfile can decode, no samples, or samples that are not finite."""


class UndecodableAudio(UnreadableAudio):
    """Data that libsndfile cannot decode at all: not audio in a format it reads, or corrupt."""


class ReferenceTooShort(AudioInputError):
    """A reference audio shorter than the least a voice can be cloned from."""


class ReferenceTooLong(AudioInputError):
    """A reference audio longer than the caller allows (told from its header, before it is decoded)."""


class EmptyText(RequestError):
    """The request's text has nothing to speak."""

    def __init__(self, message: str = "text is empty: it has no letter or digit to speak") -> None:
        super().__init__(message)


class TextTooLong(RequestError):
    """The request's text (or instructions) does not fit: a documented limit, or the engine's context."""


class EngineFull(VoxgateError):
    """The engine's queue is full; the caller should retry later or shed load."""


class SynthesisFailed(VoxgateError):
    """This request failed inside the engine (its tokenization, prompt, prefill, step or decode raised); the engine
    and every other request go on."""


class EngineFailed(VoxgateError):
    """The engine as a whole failed (a device fault, a stalled step, its process died): every open request ends."""


def request_failure(error: Exception, stage: str) -> VoxgateError:
    """A request's failure as its typed error: a VoxgateError as it is; anything else is a bug, logged with its
    traceback for the operator, while the user hears which stage failed."""
    if isinstance(error, VoxgateError):
        return error
    logging.getLogger("voxgate").error("synthesis failed while %s", stage, exc_info=error)
    return SynthesisFailed(f"synthesis failed while {stage}")
