"""The starlette application: thin routes over the gateway (`gateway.py`), the socket session (`session.py`), the
speech endpoint (`speech_http.py`), the demo's LLM chat socket (`chat.py`) and the browser demo (`web/`)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from engine.text.cleanup import clean_text
from realtime.auth import Auth, KeyRefused, OriginRefused
from realtime.chat import ChatSocket
from realtime.errors import HTTPFailure
from realtime.gateway import SHUTTING_DOWN, Gateway, Limits
from realtime.lexicons_http import delete_lexicon, list_lexicons, show_lexicon, store_lexicon
from realtime.speech_http import client_owner, read_speech_request, start_speech
from realtime.speech_response import CLIENT_GONE, CountedStream, Delivery, speech_response
from realtime.voice_library import read_upload
from realtime.ws.protocol import (
    CLOSE_OVERLOADED,
    CLOSE_POLICY,
    CLOSE_UNAUTHORIZED,
    ProtocolError,
    SessionConfig,
    configure,
    error_event,
    query_fields,
)
from realtime.ws.session import SHUTDOWN_GRACE_S, Session

log = logging.getLogger("voxgate")


def _web_dir() -> Path | None:
    """The demo's files: beside this package when installed from a wheel, at the repository's top in a checkout."""
    here = Path(__file__).resolve().parent
    return next((folder for folder in (here / "web", here.parent / "web") if (folder / "index.html").is_file()), None)


WEB_DIR = _web_dir()
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")  # a WebSocket path: 426 to each
SOCKET_PATHS = ("/v1/tts/stream", "/v1/chat")


def create_app(gateway: Gateway) -> Starlette:
    auth = Auth(gateway.limits.api_keys, gateway.limits.allowed_origins)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        loading = asyncio.create_task(gateway.start())
        yield
        loading.cancel()
        await drain(gateway)
        await gateway.stop()

    async def health(request: Request) -> Response:
        """ok while the process can serve or still become ready; 503 once it has failed for good (and exits)."""
        if not gateway.healthy():
            return JSONResponse({"status": "failed", "reason": gateway.readiness()[1]}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        is_ready, reason = gateway.readiness()
        return JSONResponse({"ready": is_ready, "status": reason, **gateway.capacity()},
                            status_code=200 if is_ready else 503)

    async def metrics(request: Request) -> Response:
        """Prometheus text, or OpenMetrics when the Accept header asks for it."""
        body, content_type = gateway.metrics.render(request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    async def voices(request: Request) -> Response:
        async def handle() -> Response:
            return JSONResponse(gateway.voices.describe())
        return await _http(request, gateway, auth, handle)

    async def models(request: Request) -> Response:
        """OpenAI's model list (`client.models.list()`): the served model by each name a request's `model` may use."""
        async def handle() -> Response:
            return JSONResponse({"object": "list", "data": [
                {"id": name, "object": "model", "created": gateway.loaded_at, "owned_by": "voxgate"}
                for name in gateway.model_names]})
        return await _http(request, gateway, auth, handle)

    async def speech(request: Request) -> Response:
        delivery = Delivery(gateway.metrics.http, gateway.metrics.http_requests, arrived=time.monotonic())

        async def handle() -> Response:
            spoken = await read_speech_request(await _body(request, gateway.limits.max_message_bytes), gateway)
            if spoken.sse:  # OpenAI's usage; a long input's tokens take milliseconds: off the event loop
                delivery.input_tokens = await asyncio.to_thread(_input_tokens, gateway, spoken.text)
            owner = client_owner(auth.key(request), request.client.host if request.client else None)
            return await speech_response(spoken, start_speech(spoken, gateway, owner), delivery,
                                         lambda: _client_gone(request))
        response = await _http(request, gateway, auth, handle)
        if not isinstance(response, CountedStream):  # counts itself once it has ended
            delivery.count(response.status_code)
        return response

    async def library_voices(request: Request) -> Response:
        """GET lists the stored voices, POST uploads one (multipart form: voice_library.py)."""
        async def handle() -> Response:
            if request.method != "POST":  # GET, and the HEAD that starlette adds to every GET route
                return JSONResponse({"voices": gateway.library.voices()})
            _check_plain_body(request)
            gateway.library.check_model()  # before the body (up to 16 MiB) is read
            with gateway.library.upload_turn():
                upload = await read_upload(request, gateway.limits.max_voice_upload_bytes)
                created = await gateway.library.create(upload)
            return JSONResponse(created, 201, headers={"Location": f"/v1/audio/voices/{created['id']}"})
        return await _http(request, gateway, auth, handle)

    async def library_voice(request: Request) -> Response:
        voice_id = request.path_params["voice_id"]

        async def handle() -> Response:
            if request.method != "DELETE":  # GET or HEAD: reading never deletes
                return JSONResponse(gateway.library.voice(voice_id))
            return JSONResponse(await gateway.library.delete(voice_id))
        return await _http(request, gateway, auth, handle)

    async def lexicons(request: Request) -> Response:
        """GET lists the stored lexicons, POST stores one (lexicons_http.py); no model needed."""
        async def handle() -> Response:
            if request.method != "POST":  # GET or HEAD: reading never stores
                return JSONResponse(list_lexicons(gateway.lexicons))
            body, status = await store_lexicon(await _body(request, gateway.limits.max_message_bytes), gateway.lexicons,
                                               gateway.http_lexicon_rules)
            return JSONResponse(body, status_code=status)
        return await _http(request, gateway, auth, handle, needs_model=False)

    async def lexicon(request: Request) -> Response:
        act = delete_lexicon if request.method == "DELETE" else show_lexicon

        async def handle() -> Response:
            return JSONResponse(act(request.path_params["name"], gateway.lexicons))
        return await _http(request, gateway, auth, handle, needs_model=False)

    async def tts_socket(websocket: WebSocket) -> None:
        await websocket.accept()
        refusal = _socket_refusal(websocket, gateway, auth)
        if refusal is not None:
            await _refuse(websocket, gateway, *refusal)
            return
        steps, errors = query_fields(websocket.query_params.multi_items())
        config = SessionConfig()
        for fields in steps:
            config, refused = configure(config, fields, gateway.voices)
            errors += refused
        await Session(websocket, gateway, config, owner=auth.key(websocket)).run(errors)

    async def chat(websocket: WebSocket) -> None:
        await websocket.accept()
        owner = auth.key(websocket)
        refusal = _access_refusal(websocket, auth) or _stopping_refusal(gateway) or _room_refusal(
            "chat sockets", len(gateway.chats), gateway.chat_sockets_of(owner), gateway.limits)  # one a page
        if refusal is not None:
            await _refuse(websocket, gateway, *refusal)
            return
        chat_socket = ChatSocket(websocket, gateway, gateway.options.llm, owner=owner)
        gateway.chats.add(chat_socket)
        try:
            await chat_socket.run()
        finally:
            gateway.chats.discard(chat_socket)

    async def demo_page(request: Request) -> Response:
        return FileResponse(WEB_DIR / "index.html")

    async def upgrade_required(request: Request) -> Response:
        """A plain HTTP request to a WebSocket endpoint (it matched no route: a 404 said the path does not exist)."""
        failure = HTTPFailure(426, "invalid_message", f"{request.url.path} is a WebSocket endpoint: open it with a "
                                                      "WebSocket client (Upgrade: websocket)")
        return JSONResponse(failure.body(), failure.status, headers={"Upgrade": "websocket"})

    async def no_socket(websocket: WebSocket) -> None:
        """A WebSocket opening where no WebSocket endpoint is (an HTTP route, an unknown path): the API's JSON 404,
        where starlette closed it with an empty 403 (and the static files' app asserted on it: a 500)."""
        failure = HTTPFailure(404, "invalid_message", f"no WebSocket endpoint at {websocket.url.path[:200]}; they are "
                                                      f"{' and '.join(SOCKET_PATHS)}")
        await websocket.send_denial_response(JSONResponse(failure.body(), failure.status))

    routes = [
        Route("/health", health), Route("/ready", ready), Route("/metrics", metrics),
        Route("/v1/voices", voices), Route("/v1/models", models), Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/audio/voices", library_voices, methods=["GET", "POST"]),
        Route("/v1/audio/voices/{voice_id}", library_voice, methods=["GET", "DELETE"]),
        Route("/v1/lexicons", lexicons, methods=["GET", "POST"]),
        Route("/v1/lexicons/{name}", lexicon, methods=["GET", "DELETE"]),
        WebSocketRoute("/v1/tts/stream", tts_socket), WebSocketRoute("/v1/chat", chat),
        *(Route(path, upgrade_required, methods=HTTP_METHODS) for path in SOCKET_PATHS),
        WebSocketRoute("/{path:path}", no_socket),  # every other WebSocket opening, before the static files' mount
    ]
    if WEB_DIR is not None:  # the browser demo: index at /, files under /static (other paths keep their 404 / 405)
        routes += [Route("/", demo_page),
                   Mount("/static", StaticFiles(directory=WEB_DIR))]
    cors = Middleware(_Cors, allow_origins=list(gateway.limits.allowed_origins) or ["*"], allow_methods=CORS_METHODS,
                      allow_headers=CORS_HEADERS, expose_headers=CORS_EXPOSED, max_age=600)
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(_AbsoluteFormTarget), cors],
                    exception_handlers={HTTPException: _routing_refusal, Exception: _internal_error})
    # a path that matches no route is the API's JSON 404, never a redirect: starlette's 307 to the path with its
    # trailing slash changed sent GET /v1/audio/voices/%2F (a voice id "/") to the voice list
    app.router.redirect_slashes = False
    return app


# A page on another origin (one `--allowed-origin` names; any without it, as the socket and the key checks take any)
# calls the HTTP API through CORS: its preflight is answered, and its responses carry the headers a script may read
CORS_METHODS = ["GET", "POST", "DELETE"]
CORS_HEADERS = ["Authorization", "Content-Type"]
CORS_EXPOSED = ["X-Sample-Rate", "X-Audio-Samples", "Location"]  # (Content-Type and -Length are always readable)
# what OpenAI's SDKs send besides (their generator's telemetry and OpenAI's own): a page calling the speech endpoint
# through the official JS SDK asks for them, and its preflight was refused
SDK_HEADER_PREFIX = "x-stainless-"
SDK_HEADERS = frozenset({"openai-organization", "openai-project", "openai-beta"})


# `scheme://authority` at the start of a request target
ABSOLUTE_FORM = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")


class _AbsoluteFormTarget:
    """A request target in absolute form (`GET http://host/v1/voices`, as a client behind a proxy may send it) is
    routed by its path: RFC 9112 says a server must accept it, and uvicorn passes the whole target on as the path,
    which matched no route (404). An origin-form target always starts with "/", so nothing else is touched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and (absolute := ABSOLUTE_FORM.match(scope["path"])):
            raw_path = scope.get("raw_path") or scope["path"].encode()
            raw_prefix = ABSOLUTE_FORM.match(raw_path.decode("latin-1"))
            scope = dict(scope, path=scope["path"][absolute.end():] or "/",
                         raw_path=raw_path[raw_prefix.end() if raw_prefix else 0:] or b"/")
        await self.app(scope, receive, send)


def _input_tokens(gateway: Gateway, text: str) -> int:
    """OpenAI's usage of a speech request: the text tokens the model reads (the cleaned text, read as text)."""
    return len(gateway.tts.tokenizer.target(clean_text(text) if gateway.options.clean_text else text)[1])


class _Cors(CORSMiddleware):
    """starlette's CORS, its refused preflight (an origin, method or header it does not allow) the API's JSON
    error (starlette answers plain text)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        asked = [name.strip().lower() for name in request_headers.get("access-control-request-headers", "").split(",")]
        sdk = [name for name in asked if name.startswith(SDK_HEADER_PREFIX) or name in SDK_HEADERS]
        # starlette checks the others (an empty list's "" it refused); the SDK's are allowed by name in the answer
        rest = ", ".join(name for name in asked if name and name not in sdk)
        request_headers = Headers(raw=[(key, value) for key, value in request_headers.raw
                                       if key != b"access-control-request-headers"]
                                  + ([(b"access-control-request-headers", rest.encode())] if rest else []))
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            if sdk:
                response.headers["access-control-allow-headers"] += ", " + ", ".join(sdk)
            return response
        if not self.is_allowed_origin(origin=request_headers["origin"]):
            failure = HTTPFailure(403, "unauthorized", "this origin is not allowed (--allowed-origin)")
        else:
            failure = HTTPFailure(400, "invalid_message", f"a CORS preflight for a method or header the API does not "
                                                          f"take (methods {', '.join(CORS_METHODS)}; headers "
                                                          f"{', '.join(CORS_HEADERS)})")
        return JSONResponse(failure.body(), failure.status)


async def _routing_refusal(request: Request, failure: HTTPException) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take) as the API's JSON errors."""
    refusal = HTTPFailure(failure.status_code, "invalid_message",
                          f"{failure.detail}: {request.method} {request.url.path[:200]}")
    return JSONResponse(refusal.body(), failure.status_code, headers=failure.headers)


async def _internal_error(request: Request, failure: Exception) -> Response:
    """A fault of the server's own (a bug; a voice store whose files the operator removed) as the API's JSON 500,
    where starlette answers plain text; starlette still raises it on, so the server logs its traceback."""
    refusal = HTTPFailure(500, "internal", "internal server error")
    return JSONResponse(refusal.body(), refusal.status)


async def _http(request: Request, gateway: Gateway, auth: Auth, handle: Callable[[], Awaitable[Response]],
                needs_model: bool = True) -> Response:
    """An API request after the key and readiness checks; a refusal (HTTPFailure) as its JSON, counted by code. A
    client that leaves before its body has arrived gets nothing (there is no one to answer), counted as 499."""
    try:
        _check_access(request, gateway, auth, needs_model)
        return await handle()
    except HTTPFailure as failure:
        gateway.metrics.http.error(failure.code)
        return JSONResponse(failure.body(), status_code=failure.status, headers=failure.headers())
    except ClientDisconnect:
        return Response(status_code=CLIENT_GONE)


async def _client_gone(request: Request) -> None:
    """Returns once the client has closed the connection (the body already read, the next message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _check_plain_body(request: Request) -> None:
    """415 for a body sent compressed (`Content-Encoding` other than identity): it would be read as it is, and a
    gzip body is not the JSON or form it claims to be."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise HTTPFailure(415, "invalid_message", f"Content-Encoding {encoding[:40]!r} is not supported: send the "
                                                  "body uncompressed")


async def _body(request: Request, max_bytes: int) -> bytes:
    """The request body, read no further than `max_bytes` (413 past it); 415 for a compressed one."""
    _check_plain_body(request)
    too_large = HTTPFailure(413, "text_too_long", f"the body takes at most {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise too_large
    return bytes(body)


def _check_access(request: Request, gateway: Gateway, auth: Auth, needs_model: bool = True) -> None:
    """Raises HTTPFailure: 401 without a valid key, 403 for a browser origin `--allowed-origin` does not list (as
    the socket refuses it: a cross-site form post must not store a lexicon or run a synthesis), 503 once the server
    is shutting down, or before the model is ready (when the route needs it)."""
    try:
        auth.check(request)
    except KeyRefused:
        raise HTTPFailure(401, "unauthorized", "a valid API key is required") from None
    except OriginRefused:
        raise HTTPFailure(403, "unauthorized", "this origin is not allowed (--allowed-origin)") from None
    if gateway.shutting_down:  # every route, the model's or not: what it stored would be lost with the process
        raise HTTPFailure(503, "overloaded", SHUTTING_DOWN)
    is_ready, reason = gateway.readiness()
    if needs_model and not is_ready:
        raise HTTPFailure(503, "overloaded", f"not ready: {reason}")


async def _refuse(websocket: WebSocket, gateway: Gateway, failure: ProtocolError, code: int) -> None:
    gateway.metrics.socket.error(failure.code)
    await websocket.send_text(json.dumps(error_event(failure)))
    await websocket.close(code)


def _access_refusal(websocket: WebSocket, auth: Auth) -> tuple[ProtocolError, int] | None:
    try:
        auth.check(websocket)
    except KeyRefused:
        return ProtocolError("unauthorized", "a valid API key is required (Authorization: Bearer KEY or "
                                             "?token=KEY)", fatal=True), CLOSE_UNAUTHORIZED
    except OriginRefused:
        return ProtocolError("unauthorized", "this origin is not allowed", fatal=True), CLOSE_POLICY
    return None


def _socket_refusal(websocket: WebSocket, gateway: Gateway, auth: Auth) -> tuple[ProtocolError, int] | None:
    refusal = _access_refusal(websocket, auth)
    if refusal is not None:
        return refusal
    is_ready, reason = gateway.readiness()
    if not is_ready:
        return ProtocolError("overloaded", f"not ready ({reason}); retry later", fatal=True), CLOSE_OVERLOADED
    return _room_refusal("sessions", len(gateway.sessions), gateway.sessions_of(auth.key(websocket)), gateway.limits)


def _stopping_refusal(gateway: Gateway) -> tuple[ProtocolError, int] | None:
    """A socket opened once the drain has begun (it would miss it): refused as a session is (`readiness`)."""
    if gateway.shutting_down:
        return ProtocolError("overloaded", SHUTTING_DOWN, fatal=True), CLOSE_OVERLOADED
    return None


def _room_refusal(kind: str, open_: int, of_key: int, limits: Limits) -> tuple[ProtocolError, int] | None:
    """`kind` (sessions, chat sockets) are capped at `--max-sessions` open, and `--max-sessions-per-key` of one
    key's (`of_key` of the `open_` are the connecting key's)."""
    if open_ >= limits.max_sessions:
        return ProtocolError("overloaded", f"the server has its maximum of {limits.max_sessions} {kind}; retry "
                                           "later", fatal=True), CLOSE_OVERLOADED
    per_key = limits.max_sessions_per_key
    if per_key is not None and of_key >= per_key:
        return ProtocolError("overloaded", f"this API key has its maximum of {per_key} open {kind} "
                                           "(--max-sessions-per-key); close one or retry later",
                             fatal=True), CLOSE_OVERLOADED
    return None


async def drain(gateway: Gateway) -> None:
    """Graceful shutdown: the sessions and the speech requests get SHUTDOWN_GRACE_S to finish, together; then every
    session cancels its open contexts and closes with 1001, and a speech request still being made ends with
    `overloaded` (`Gateway.end_speech`). A chat socket's LLM stops at once (what it wrote is still spoken, within
    the sessions' grace) and it closes with 1001."""
    gateway.shutting_down = True
    await asyncio.gather(*(session.shutdown() for session in list(gateway.sessions)),
                         *(chat.shutdown() for chat in list(gateway.chats)),
                         gateway.end_speech(SHUTDOWN_GRACE_S), return_exceptions=True)
