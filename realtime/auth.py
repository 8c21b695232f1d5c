"""Who may use the gateway: API keys (from flags, $VOXGATE_API_KEYS and a key file) and browser origins, checked
the same way for HTTP requests and WebSockets, so the two cannot drift apart."""
from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import HTTPConnection

KEYS_VARIABLE = "VOXGATE_API_KEYS"


class AccessDenied(Exception):
    """A connection the gateway refuses; the subclass says why (each transport words and codes it its own way)."""


class KeyRefused(AccessDenied):
    """No API key, or not one of the configured keys."""


class OriginRefused(AccessDenied):
    """A browser page from an origin that is not allowed."""


class KeyFileError(ValueError):
    """An API key file that cannot be read or holds no key; the message is one line naming the problem."""


@dataclass(frozen=True)
class Auth:
    api_keys: tuple[str, ...] = ()  # none: open
    allowed_origins: tuple[str, ...] = ()  # none: any

    def check(self, connection: HTTPConnection, origin: bool = True) -> None:
        """Raise KeyRefused without a valid key (`Authorization: Bearer KEY` or `?token=KEY`), and OriginRefused for
        a browser origin that is not allowed (when `origin`)."""
        if not self.key_accepted(_presented_key(connection)):
            raise KeyRefused()
        if origin and not self.origin_allowed(connection.headers.get("origin")):
            raise OriginRefused()

    def key(self, connection: HTTPConnection) -> str | None:
        """The key a connection presented, None on an open gateway: what its session belongs to (`same_key`)."""
        return _presented_key(connection) if self.api_keys else None

    def key_accepted(self, key: str | None) -> bool:
        """Compared in constant time against every key (no key configured: open)."""
        if not self.api_keys:
            return True
        given = (key or "").encode()
        return any(hmac.compare_digest(given, k.encode()) for k in self.api_keys) and bool(given)

    def origin_allowed(self, origin: str | None) -> bool:
        return not self.allowed_origins or origin is None or origin in self.allowed_origins


def same_key(a: str | None, b: str | None) -> bool:
    """Two connections presented the same key (or none, on an open gateway); compared in constant time."""
    if a is None or b is None:
        return a is None and b is None
    return hmac.compare_digest(a.encode(), b.encode())


def _presented_key(connection: HTTPConnection) -> str | None:
    """`Authorization: Bearer KEY`, else `?token=KEY` given once (given twice: none, as which one counts is a
    guess)."""
    tokens = connection.query_params.getlist("token")
    return _bearer(connection) or (tokens[0] if len(tokens) == 1 else None)


def _bearer(connection: HTTPConnection) -> str | None:
    value = connection.headers.get("authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else None


def load_api_keys(given: Iterable[str], key_file: Path | None = None) -> tuple[str, ...]:
    """Keys given on the command line, in $VOXGATE_API_KEYS (comma-separated) and in `key_file` (one a line),
    merged: the last two keep keys off the command line, where `ps` shows them. Raises KeyFileError."""
    given = list(given)
    if any(not key.strip() for key in given):  # `--api-key "$KEY"` with KEY unset would serve with no key at all
        raise KeyFileError("--api-key is empty; leave it out to serve without keys")
    variable = os.environ.get(KEYS_VARIABLE)
    if variable is not None and not variable.strip(", \t\n"):
        raise KeyFileError(f"${KEYS_VARIABLE} is set but holds no key; unset it to serve without keys")
    keys = given + (variable or "").split(",")
    if key_file is not None:
        keys += _key_file(key_file)
    keys = [key.strip() for key in keys if key.strip()]
    for key in keys:
        _check_sendable(key)
    return tuple(dict.fromkeys(keys))


def _check_sendable(key: str) -> None:
    """A key a client can present in `Authorization: Bearer KEY`: printable ASCII without spaces (a header's bytes
    are read as latin-1, so a key with other characters could only ever come by `?token=`). The key is not echoed."""
    bad = next((char for char in key if not "!" <= char <= "~"), None)
    if bad is not None:
        raise KeyFileError(f"an API key holds {bad!r} (U+{ord(bad):04X}); keys must be printable ASCII without "
                           f"spaces, as an Authorization header carries them")


def _key_file(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as failure:
        raise KeyFileError(f"cannot read --api-key-file {path}: {failure.strerror or failure}") from None
    except UnicodeDecodeError:
        raise KeyFileError(f"--api-key-file {path} is not UTF-8 text") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise KeyFileError(f"--api-key-file {path} holds no key")
    return keys
