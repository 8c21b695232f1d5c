"""`/v1/lexicons`: named pronunciation lexicons (realtime/lexicon.py) that a session, a context or a speech request
names instead of sending its rules each time. Each function is one route's work; errors are HTTPFailure."""
from __future__ import annotations

from typing import Any

from realtime.errors import HTTPFailure
from realtime.lexicon import (
    MAX_RULES,
    Lexicon,
    LexiconError,
    LexiconNotFound,
    LexiconsBusy,
    LexiconStore,
    StoreFull,
    compile_off_loop,
)
from realtime.ws.protocol import ProtocolError, load_json
from realtime.ws.rate_limit import RateLimiter

# lexicon rules compiled for HTTP requests a second, all clients together (bursts of twice that): a compile holds the
# GIL (~0.2 s for 1,000 rules), and three clients posting 1,000-rule lexicons in a loop took a healthy session's first
# audio from 87 to 766 ms (a hostile try). A socket has its own budget, per session (`INLINE_RULES_RATE`).
HTTP_RULES_RATE = 1000

# the store's own refusals (docs/protocol.md); a malformed lexicon is the protocol's `invalid_message`
STORE_ERRORS: tuple[tuple[type[LexiconError], int, str], ...] = (
    (LexiconNotFound, 404, "lexicon_not_found"),
    (StoreFull, 409, "lexicon_limit"),
    (LexiconsBusy, 503, "overloaded"),
    (LexiconError, 400, "invalid_message"),
)


async def compile_within(budget: RateLimiter, rules: Any, name: str | None = None) -> Lexicon | LexiconError:
    """`compile_off_loop` within the HTTP requests' budget of rules a second; past it HTTPFailure 429 `rate_limited`
    (rules past MAX_RULES are refused for their size, at no cost)."""
    count = len(rules) if isinstance(rules, list) and len(rules) <= MAX_RULES else 0
    if not budget.allow(count):
        raise HTTPFailure(429, "rate_limited", f"lexicons over HTTP are compiled at most {HTTP_RULES_RATE} rules a "
                                               "second, for all clients; retry shortly (a stored lexicon costs "
                                               "nothing to name)")
    return await compile_off_loop(rules, name)


async def store_lexicon(raw: bytes, store: LexiconStore, budget: RateLimiter) -> tuple[dict[str, Any], int]:
    """`POST /v1/lexicons` with `{"name", "rules"}`: the stored lexicon, 201 when new, 200 when it replaced one. The
    rules are compiled on the compiler thread (`compile_within` the HTTP budget), once the name is known good and has
    room."""
    try:
        body = load_json(raw or b"null")
    except ProtocolError as failure:
        raise HTTPFailure.of(failure) from None
    if not isinstance(body, dict):
        raise HTTPFailure(400, "invalid_message", "the body must be a JSON object {\"name\": ..., \"rules\": [...]}")
    name = body.get("name")
    try:
        store.check_room(name)
        lexicon, created = store.put(name, await compile_within(budget, body.get("rules"), name))
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
