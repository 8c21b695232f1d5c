"""`WS /v1/chat`: LLM chat beside voxgate.v1, for the browser demo (docs/protocol.md "/v1/chat").

The page keeps its voxgate.v1 session for audio and asks here for a reply: the server streams the request to the
configured OpenAI-compatible LLM, sends each piece of the reply to the page (`chat.delta`) and, in the same moment,
appends it to a context of the page's session (through the session's API, checked by the client's own rules), so
the speech starts while the LLM is still writing. A turn ends when the reply is complete (`context.end`), on
`chat.cancel` or a newer request, or when the session's context is cancelled (barge-in on the audio socket stops the
LLM too)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from realtime.auth import same_key
from realtime.gateway import SHUTTING_DOWN, Gateway
from realtime.llm import LLMConfig, LLMError, new_llm_client, stream_chat
from realtime.ws.protocol import CLOSE_GOING_AWAY, ProtocolError, event, parse_message
from realtime.ws.rate_limit import MessageBudget
from realtime.ws.session import Session

log = logging.getLogger("voxgate")
MAX_CHAT_MESSAGES = 200
BARGE_IN_POLL_S = 0.1  # how soon a turn whose context was cancelled stops an LLM that sends nothing meanwhile
ROLES = ("system", "user", "assistant")
_STR = (str,)
CHAT_MESSAGES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "chat.request": {"id": (_STR, True), "session_id": (_STR, True), "context_id": (_STR, True),
                     "messages": ((list,), True), "voice": (_STR, False), "language": (_STR, False),
                     "instructions": (_STR, False)},
    "chat.cancel": {"id": (_STR, True)},
}


@dataclass(frozen=True)
class ChatRequest:
    id: str
    session_id: str
    context_id: str
    messages: list[dict[str, str]]
    voice_fields: dict[str, str]  # voice / language / instructions for the context's first append


def parse_chat_request(message: dict[str, Any], max_chars: int) -> ChatRequest:
    messages = message["messages"]
    if not messages or len(messages) > MAX_CHAT_MESSAGES:
        raise ProtocolError("invalid_message", f"chat.request: messages must hold 1 to {MAX_CHAT_MESSAGES} messages")
    for item in messages:
        if not (isinstance(item, dict) and item.get("role") in ROLES and isinstance(item.get("content"), str)):
            raise ProtocolError("invalid_message", "chat.request: each message must be {\"role\": "
                                                   f"{' | '.join(ROLES)}, \"content\": string}}")
    if sum(len(item["content"]) for item in messages) > max_chars:
        raise ProtocolError("text_too_long", f"chat.request: the messages hold more than {max_chars} characters")
    return ChatRequest(message["id"], message["session_id"], message["context_id"],
                       [{"role": m["role"], "content": m["content"]} for m in messages],
                       {k: message[k] for k in ("voice", "language", "instructions") if message.get(k) is not None})


class ChatSocket:
    def __init__(self, websocket: WebSocket, gateway: Gateway, llm: LLMConfig | None, owner: str | None) -> None:
        """`owner`: the API key this socket presented; it speaks only into sessions opened with the same key."""
        self.ws, self.gateway, self.llm, self.owner = websocket, gateway, llm, owner
        self._turn: asyncio.Task | None = None
        self._turn_id: str | None = None
        self._disconnected = False  # the page went away: its context is cancelled, not finished
        self._stopping = False  # the server stops: no new turn starts
        self._budget = MessageBudget(gateway.limits.max_message_rate, gateway.limits.max_message_bytes)

    async def run(self) -> None:
        await self._send({"type": "chat.ready", "llm": {"model": self.llm.model} if self.llm else None})
        self._llm_client = new_llm_client(self.llm) if self.llm else None
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("text") is not None:
                    await self._handle(message["text"])
                else:  # within the same budget as text, as on the voxgate.v1 socket
                    await self._error(self._budget.frame_refusal(message.get("bytes") or b"") or ProtocolError(
                        "invalid_message", "send JSON text frames"))
        finally:
            await self._stop_turn(disconnected=True)
            if self._llm_client is not None:
                await self._llm_client.close()

    async def shutdown(self) -> None:
        """The server stops: the LLM stops (what it wrote is still spoken, within the sessions' grace) and the socket
        closes with 1001, as a voxgate.v1 session's does."""
        self._stopping = True
        await self._stop_turn()
        with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):  # closed meanwhile
            await self.ws.close(CLOSE_GOING_AWAY, "server shutting down")

    async def _handle(self, text: str) -> None:
        request_id = None  # a parsed request's, which its error names
        try:
            refusal = self._budget.refusal(text)
            if refusal is not None:
                raise refusal
            message = parse_message(text, CHAT_MESSAGES)
            request_id = message["id"]
            if message["type"] == "chat.cancel":
                if message["id"] == self._turn_id:
                    await self._stop_turn()
                return
            request = parse_chat_request(message, self.gateway.limits.max_text_chars)
            if self._stopping:
                raise ProtocolError("overloaded", SHUTTING_DOWN)
            if self.llm is None:
                raise ProtocolError("no_llm", "no LLM is configured: start voxgate serve with --llm-url and "
                                              "--llm-model (the page then speaks what you type)")
            session = self.gateway.session(request.session_id)
            if session is None or not same_key(session.owner, self.owner):  # another key's session is not found
                raise ProtocolError("session_not_found", "no open voxgate.v1 session with this session_id "
                                                         "(from its session.started) and this API key")
            finished = not session.takes_text_for(request.context_id)  # spoken to its end (or cancelled) before
            await self._stop_turn()  # a new request barges in on the last one
            self._turn_id = request.id
            self._turn = asyncio.get_running_loop().create_task(self._run_turn(request, session, finished))
        except ProtocolError as failure:
            await self._error(failure, request_id)

    async def _stop_turn(self, disconnected: bool = False) -> None:
        """Stop the LLM; what it wrote is still spoken (`context.end`), unless the page went away."""
        turn, turn_id, self._turn = self._turn, self._turn_id, None
        self._disconnected = self._disconnected or disconnected  # a page gone stays gone (a stop comes after)
        if turn is not None and not turn.done():
            turn.cancel()
            await asyncio.gather(turn, return_exceptions=True)
            if turn.cancelled() and not disconnected:  # cancelled before its body ran, which says chat.done itself
                await self._send(event("chat.done", id=turn_id, text="", reason="cancelled"))

    async def _run_turn(self, request: ChatRequest, session: Session, finished: bool) -> None:
        """`finished`: the context had finished before the request; its first piece is refused (context_closed on
        the audio socket) and the turn ends `error`, not `cancelled`."""
        reply, reason = "", "stop"
        context_id = request.context_id
        try:
            barge_in = asyncio.get_running_loop().create_task(_cancel_on_barge_in(session, context_id, finished,
                                                                                  asyncio.current_task()))
            try:
                async with contextlib.aclosing(stream_chat(self._llm_client, self.llm, request.messages)) as pieces:
                    async for piece in pieces:
                        if not (finished or session.takes_text_for(context_id)):
                            reason = "cancelled"  # cancelled on the audio socket (barge-in), or that socket closed
                            break
                        if not session.append_text(context_id, piece, None if reply else request.voice_fields):
                            reason = "error"  # refused (unknown voice, text too long): the error went to that socket
                            break
                        reply += piece
                        await self._send(event("chat.delta", id=request.id, text=piece))
                        await asyncio.sleep(0)  # deltas already buffered: the loop's other sockets get a turn
            finally:
                barge_in.cancel()
            if reason == "stop" and reply and not session.context_open(context_id):
                reason = "cancelled"  # barged in on after the last piece
        except asyncio.CancelledError:
            reason = "cancelled"
            if self._disconnected:  # nobody is listening: free the engine
                if session.context_open(context_id):
                    session.cancel_context(context_id)
                return
        except LLMError as failure:
            reason = "error"
            log.warning("chat %s: %s", request.id, failure)
            await self._error(ProtocolError("llm_error", str(failure)), request.id)
        except Exception:  # a bug must not leave the page waiting for a chat.done
            reason = "error"
            log.exception("chat %s: internal error", request.id)
            await self._error(ProtocolError("internal", "internal server error"), request.id)
        if session.context_open(context_id) and not session.context_ended(context_id):  # spoken to its end
            session.end_context(context_id)  # (one the client ended refused the turn's text: its error said so)
        await self._send(event("chat.done", id=request.id, text=reply, reason=reason))

    async def _error(self, failure: ProtocolError, request_id: str | None = None) -> None:
        self.gateway.metrics.socket.error(failure.code)  # counted as every error the server sends
        await self._send(event("error", code=failure.code, message=failure.message, id=request_id,
                               fatal=failure.fatal))

    async def _send(self, message: dict[str, Any]) -> None:
        try:
            await self.ws.send_text(json.dumps(message))
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the reader sees the disconnect and stops the turn


async def _cancel_on_barge_in(session: Session, context_id: str, finished: bool, turn: asyncio.Task) -> None:
    """A turn whose context the audio socket no longer takes (barge-in, or that socket closed) stops even while the
    LLM sends nothing: checking between deltas alone left a stalled LLM request open."""
    while (not session.closed) if finished else session.takes_text_for(context_id):  # finished: a close is news
        await asyncio.sleep(BARGE_IN_POLL_S)
    turn.cancel()
