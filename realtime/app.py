"""The starlette application: thin routes over the gateway (`gateway.py`), the socket session (`session.py`), the
speech endpoint (`speech_http.py`), the demo's LLM chat socket (`chat.py`) and the browser demo (`web/`)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from realtime.audio.formats import MODEL_SAMPLE_RATE, pcm_s16le
from realtime.auth import Auth, KeyRefused, OriginRefused
from realtime.chat import ChatSocket
from realtime.errors import HTTPFailure
from realtime.gateway import Gateway
from realtime.lexicons_http import delete_lexicon, list_lexicons, show_lexicon, store_lexicon
from realtime.speech_http import SpeechRequest, parse_speech_request, sse_events, start_speech, whole_file
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
from realtime.ws.session import Session

log = logging.getLogger("voxgate")


def _web_dir() -> Path | None:
    """The demo's files: beside this package when installed from a wheel, at the repository's top in a checkout."""
    here = Path(__file__).resolve().parent
    return next((folder for folder in (here / "web", here.parent / "web") if (folder / "index.html").is_file()), None)


WEB_DIR = _web_dir()


def create_app(gateway: Gateway) -> Starlette:
    auth = Auth(gateway.limits.api_keys, gateway.limits.allowed_origins)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        loading = asyncio.create_task(gateway.start())
        yield
        loading.cancel()
        await drain_sessions(gateway)
        await gateway.stop()

    async def health(request: Request) -> Response:
        """ok while the process can serve or still become ready; 503 once it has failed for good (and exits)."""
        if not gateway.healthy():
            return JSONResponse({"status": "failed", "reason": gateway.readiness()[1]}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        is_ready, reason = gateway.readiness()
        return JSONResponse({"ready": is_ready, "status": reason}, status_code=200 if is_ready else 503)

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    async def voices(request: Request) -> Response:
        refused = _refusal(request, gateway, auth)
        if refused is not None:
            return refused
        return JSONResponse(gateway.voices.describe())

    async def speech(request: Request) -> Response:
        refused = _refusal(request, gateway, auth)
        if refused is not None:
            return refused
        try:
            spoken = parse_speech_request(await _body(request, gateway.limits.max_message_bytes), gateway)
            response = await _speech_response(spoken, start_speech(spoken, gateway))
        except HTTPFailure as failure:
            gateway.metrics.http_requests.labels(status=str(failure.status)).inc()
            gateway.metrics.errors.labels(code=failure.code).inc()
            return JSONResponse(failure.body(), status_code=failure.status)
        gateway.metrics.http_requests.labels(status="200").inc()
        return response

    async def lexicons(request: Request) -> Response:
        refused = _key_refusal(request, auth)
        if refused is not None:
            return refused
        try:
            if request.method == "GET":
                return JSONResponse(list_lexicons(gateway.lexicons))
            body, status = store_lexicon(await _body(request, gateway.limits.max_message_bytes), gateway.lexicons)
        except HTTPFailure as failure:
            return failed(failure)
        return JSONResponse(body, status_code=status)

    async def lexicon(request: Request) -> Response:
        refused = _key_refusal(request, auth)
        if refused is not None:
            return refused
        act = delete_lexicon if request.method == "DELETE" else show_lexicon
        try:
            return JSONResponse(act(request.path_params["name"], gateway.lexicons))
        except HTTPFailure as failure:
            return failed(failure)

    def failed(failure: HTTPFailure) -> Response:
        gateway.metrics.errors.labels(code=failure.code).inc()
        return JSONResponse(failure.body(), status_code=failure.status)

    async def tts_socket(websocket: WebSocket) -> None:
        await websocket.accept()
        refusal = _socket_refusal(websocket, gateway, auth)
        if refusal is not None:
            await _refuse(websocket, gateway, *refusal)
            return
        fields, errors = query_fields(dict(websocket.query_params))
        config, config_errors = configure(SessionConfig(), fields, gateway.voices)
        await Session(websocket, gateway, config).run(errors + config_errors)

    async def chat(websocket: WebSocket) -> None:
        await websocket.accept()
        refusal = _access_refusal(websocket, auth)
        if refusal is not None:
            await _refuse(websocket, gateway, *refusal)
            return
        await ChatSocket(websocket, gateway, gateway.options.llm).run()

    async def demo_page(request: Request) -> Response:
        return FileResponse(WEB_DIR / "index.html")

    routes = [
        Route("/health", health), Route("/ready", ready), Route("/metrics", metrics),
        Route("/v1/voices", voices), Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/lexicons", lexicons, methods=["GET", "POST"]),
        Route("/v1/lexicons/{name}", lexicon, methods=["GET", "DELETE"]),
        WebSocketRoute("/v1/tts/stream", tts_socket), WebSocketRoute("/v1/chat", chat),
    ]
    if WEB_DIR is not None:  # the browser demo (index at /, files under /static, so that other paths keep their 404 / 405)
        routes += [Route("/", demo_page),
                   Mount("/static", StaticFiles(directory=WEB_DIR))]
    return Starlette(routes=routes, lifespan=lifespan)


async def _body(request: Request, max_bytes: int) -> bytes:
    """The request body, read no further than `max_bytes` (413 past it)."""
    too_large = HTTPFailure(413, "text_too_long", f"the body takes at most {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise too_large
    return bytes(body)


async def _speech_response(spoken: SpeechRequest, chunks: AsyncIterator[np.ndarray]) -> Response:
    """Streamed formats start once the first audio is made, so that a request failing before any audio gets its
    error status instead of an empty 200."""
    if not spoken.stream:
        body, media_type = await whole_file(chunks, spoken.response_format)
        pcm_rate = {"X-Sample-Rate": str(MODEL_SAMPLE_RATE)} if spoken.response_format == "pcm" else None
        return Response(body, media_type=media_type, headers=pcm_rate)
    first = await anext(chunks, None)
    if spoken.sse:
        return StreamingResponse(sse_events(_prepend(first, chunks)), media_type="text/event-stream")
    return StreamingResponse(_pcm_body(_prepend(first, chunks)), media_type="audio/pcm",
                             headers={"X-Sample-Rate": str(MODEL_SAMPLE_RATE)})


async def _prepend(first: np.ndarray | None, chunks: AsyncIterator[np.ndarray]) -> AsyncIterator[np.ndarray]:
    if first is not None:
        yield first
    async for samples in chunks:
        yield samples


async def _pcm_body(chunks: AsyncIterator[np.ndarray]) -> AsyncIterator[bytes]:
    """Raw PCM has no way to say that a response failed after its status went out: it ends early (and the log says
    why)."""
    try:
        async for samples in chunks:
            yield pcm_s16le(samples)
    except HTTPFailure as failure:
        log.warning("a streamed speech response ended early: %s", failure.code)


def _key_refusal(request: Request, auth: Auth) -> Response | None:
    """401 without a valid key."""
    try:
        auth.check(request, origin=False)
    except KeyRefused:
        return JSONResponse({"error": {"code": "unauthorized", "message": "a valid API key is required"}}, 401)
    return None


def _refusal(request: Request, gateway: Gateway, auth: Auth) -> Response | None:
    """401 without a valid key, 503 before the model is ready."""
    refused = _key_refusal(request, auth)
    if refused is not None:
        return refused
    if gateway.readiness()[0] is False:
        reason = gateway.readiness()[1]
        return JSONResponse({"error": {"code": "overloaded", "message": f"not ready: {reason}"}}, 503)
    return None


async def _refuse(websocket: WebSocket, gateway: Gateway, failure: ProtocolError, code: int) -> None:
    gateway.metrics.errors.labels(code=failure.code).inc()
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
    if len(gateway.sessions) >= gateway.limits.max_sessions:
        return ProtocolError("overloaded", f"the server has its maximum of {gateway.limits.max_sessions} "
                                           "sessions; retry later", fatal=True), CLOSE_OVERLOADED
    return None


async def drain_sessions(gateway: Gateway) -> None:
    """Graceful shutdown: every session finishes or cancels its contexts and closes with 1001."""
    gateway.shutting_down = True
    await asyncio.gather(*(session.shutdown() for session in list(gateway.sessions)), return_exceptions=True)
