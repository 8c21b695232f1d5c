"""A local OpenAI-compatible chat server that streams a fixed reply token by token (server-sent events), on a free
port in a thread, recording each request and whether its client went away before the reply was complete."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.routing import Route

from tests.gateway_server import serve_in_thread


@dataclass
class Call:
    body: dict
    authorization: str | None
    outcome: str = "streaming"  # then "complete" or "cancelled"


@dataclass
class FakeLLM:
    url: str  # the API base, as --llm-url takes it
    reply: list[str]
    token_delay_s: float
    calls: list[Call] = field(default_factory=list)
    stall_after: int | None = None  # tokens sent before the reply stops coming (the connection stays open)
    web_page: bool = False  # answer 200 with an HTML page, as a wrong --llm-url may


def create_app(llm: FakeLLM) -> Starlette:
    async def completions(request: Request):
        body = await request.json()
        if not body.get("stream") or not body.get("messages"):
            return JSONResponse({"error": {"message": "stream and messages are required"}}, status_code=400)
        call = Call(body, request.headers.get("authorization"))
        llm.calls.append(call)
        if llm.web_page:
            return HTMLResponse("<html><body>Welcome</body></html>")

        async def events():
            try:
                for sent, token in enumerate(llm.reply):
                    await asyncio.sleep(llm.token_delay_s if sent != llm.stall_after else 3600)
                    chunk = {"object": "chat.completion.chunk", "model": body["model"],
                             "choices": [{"index": 0, "delta": {"content": token}, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                call.outcome = "complete"  # before [DONE], after which the client may close at once
                yield "data: [DONE]\n\n"
            finally:
                if call.outcome == "streaming":
                    call.outcome = "cancelled"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


@contextlib.contextmanager
def running_fake_llm(reply: list[str], token_delay_s: float = 0.05) -> Iterator[FakeLLM]:
    llm = FakeLLM("", reply, token_delay_s)
    server = uvicorn.Server(uvicorn.Config(create_app(llm), host="127.0.0.1", port=0, log_level="warning"))
    thread, port = serve_in_thread(server, timeout_s=30)
    llm.url = f"http://127.0.0.1:{port}/v1"
    try:
        yield llm
    finally:
        server.should_exit = True
        thread.join(timeout=10)
