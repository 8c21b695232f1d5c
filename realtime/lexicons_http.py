"""`/v1/lexicons`: named pronunciation lexicons (realtime/lexicon.py) that a session, a context or a speech request
names instead of sending its rules each time. Each function is one route's work; errors are HTTPFailure."""
from __future__ import annotations

from typing import Any

from realtime.errors import HTTPFailure
from realtime.lexicon import (
    LexiconError,
    LexiconNotFound,
    LexiconsBusy,
    LexiconStore,
    StoreFull,
    compile_off_loop,
)
from realtime.ws.protocol import ProtocolError, load_json

# the store's own refusals (docs/protocol.md); a malformed lexicon is the protocol's `invalid_message`
STORE_ERRORS: tuple[tuple[type[LexiconError], int, str], ...] = (
    (LexiconNotFound, 404, "lexicon_not_found"),
    (StoreFull, 409, "lexicon_limit"),
    (LexiconsBusy, 503, "overloaded"),
    (LexiconError, 400, "invalid_message"),
)


async def store_lexicon(raw: bytes, store: LexiconStore) -> tuple[dict[str, Any], int]:
    """`POST /v1/lexicons` with `{"name", "rules"}`: the stored lexicon, 201 when new, 200 when it replaced one. The
    rules are compiled on the compiler thread (`compile_off_loop`), once the name is known good and has room."""
    try:
        body = load_json(raw or b"null")
    except ProtocolError as failure:
        raise HTTPFailure.of(failure) from None
    if not isinstance(body, dict):
        raise HTTPFailure(400, "invalid_message", "the body must be a JSON object {\"name\": ..., \"rules\": [...]}")
    name = body.get("name")
    try:
        store.check_room(name)
        lexicon, created = store.put(name, await compile_off_loop(body.get("rules"), name))
    except LexiconError as failure:
        raise refusal(failure) from None
    return lexicon.describe(), 201 if created else 200


def list_lexicons(store: LexiconStore) -> dict[str, Any]:
    return {"lexicons": [{"name": name, "rules": len(store.get(name).rules)} for name in store.names()]}


def show_lexicon(name: str, store: LexiconStore) -> dict[str, Any]:
    try:
        return store.get(name).describe()
    except LexiconError as failure:
        raise refusal(failure) from None


def delete_lexicon(name: str, store: LexiconStore) -> dict[str, Any]:
    try:
        store.delete(name)
    except LexiconError as failure:
        raise refusal(failure) from None
    return {"name": name, "deleted": True}


def refusal(failure: LexiconError) -> HTTPFailure:
    """The HTTP status and code of a refusal, by its type."""
    status, code = next((status, code) for kind, status, code in STORE_ERRORS if isinstance(failure, kind))
    return HTTPFailure(status, code, str(failure))
