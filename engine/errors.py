"""Errors a user can cause and fix; each message names the problem so no traceback is needed."""


class VoxgateError(Exception):
    """Base class: the message is meant for the user as it is."""


class CheckpointError(VoxgateError):
    """A checkpoint directory is missing a file, or a file is malformed."""


class RequestError(VoxgateError):
    """A synthesis request asks for something this model cannot do (bad voice, empty text, ...)."""


class AudioInputError(RequestError):
    """A reference audio cannot be read or is unusable."""
