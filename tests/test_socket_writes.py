"""The gateway's WebSocket protocol writes the messages of one turn of the event loop (a chunk of audio: several
20 ms packets) to its socket together, in order, with control frames after what is held, whether they were sent
through starlette or past it as the session's sender does (`SEND_NOW_EXTENSION`); a real uvicorn server with the
gateway's protocol class and a real websockets client."""
from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedOK
from websockets.frames import Frame, Opcode

from realtime.server import MAX_HELD_BYTES, GatewayWebSocketProtocol, data_frame
from realtime.ws.protocol import SEND_NOW_EXTENSION
from tests.gateway_server import serve_in_thread

BURST = 20
CHUNK = 4  # messages an outbox item holds
WAYS = ["asgi", "now"]


async def send(websocket: WebSocket, messages: list[str | bytes], way: str,
               ways_taken: list[str] | None = None) -> None:
    """`asgi`: through starlette; `now`: as the session's sender, past the ASGI layers while nothing would wait (all
    of an outbox item's messages in one call)."""
    sent_now = way == "now" and websocket.scope["extensions"][SEND_NOW_EXTENSION](messages)
    if ways_taken is not None:
        ways_taken.append("now" if sent_now else "asgi")  # before a send that may wait for good
    if sent_now:
        return
    for message in messages:
        if isinstance(message, bytes):
            await websocket.send_bytes(message)
        else:
            await websocket.send_text(message)


class CountedTransport:
    """The server's real transport, each write's size recorded."""

    def __init__(self, transport: asyncio.Transport, writes: list[int]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append(len(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def served(app: Starlette, writes: list[int], protocols: list | None = None) -> tuple[uvicorn.Server, int]:
    class Counted(GatewayWebSocketProtocol):
        def connection_open(self) -> None:  # the handshake's response is out: count what follows
            super().connection_open()
            self.transport = CountedTransport(self.transport, writes)
            if protocols is not None:
                protocols.append(self)

    server = uvicorn.Server(uvicorn.Config(app, port=0, log_level="warning", ws=Counted,
                                           ws_per_message_deflate=False))
    return server, serve_in_thread(server)[1]


@pytest.mark.parametrize("way", WAYS)
def test_a_burst_of_messages_leaves_in_one_write_in_order_before_the_close(way):
    ways_taken: list[str] = []
    after_close: list[bool] = []

    async def endpoint(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.receive()
        for first in range(0, BURST, CHUNK):  # chunks of packets, as a context's audio
            await send(websocket, [index.to_bytes(2, "big") * 30 for index in range(first, first + CHUNK)], way,
                       ways_taken)
        await send(websocket, ["end of burst"], way, ways_taken)
        await asyncio.sleep(0.05)  # a later turn: its own write
        await send(websocket, ["later"], way, ways_taken)
        await websocket.close(1000)
        after_close.append(websocket.scope["extensions"][SEND_NOW_EXTENSION]([b"too late"]))

    writes: list[int] = []
    server, port = served(Starlette(routes=[WebSocketRoute("/", endpoint)]), writes)

    async def client() -> tuple[list[Any], int]:
        received = []
        async with connect(f"ws://127.0.0.1:{port}/") as ws:
            await ws.send("go")
            try:
                while True:
                    received.append(await ws.recv())
            except ConnectionClosedOK as closed:
                return received, closed.rcvd.code

    try:
        received, code = asyncio.run(client())
        deadline = time.monotonic() + 5
        while not after_close and time.monotonic() < deadline:  # the endpoint goes on after the client has closed
            time.sleep(0.01)
    finally:
        server.should_exit = True
    assert received == [index.to_bytes(2, "big") * 30 for index in range(BURST)] + ["end of burst", "later"]
    assert code == 1000
    burst_bytes = BURST * (2 + 60) + (2 + len("end of burst"))
    assert writes[0] == burst_bytes  # the burst and the text after it: one write
    assert writes[1] == 2 + len("later")
    assert len(writes) == 3  # then the close frame
    assert ways_taken == [way] * (BURST // CHUNK + 2)  # nothing made a send wait: none went the long way
    assert after_close == [False]  # once closed, nothing is written past the ASGI layers


@pytest.mark.parametrize("way", WAYS)
def test_a_peer_that_reads_nothing_still_pauses_the_sender(way):
    """Holding a turn's frames must not hide a slow peer from flow control: once the transport buffers, frames go to
    it at once and `send` waits at its high-water mark, so what waits stays in the session's send queue (where urgent
    events overtake it and a cancel drops it), not in the transport (a hostile try: 20,000 sends of 1 KB all went
    through, 17 MB in the transport buffer)."""
    sent, buffered, ways_taken = [], [], []
    protocols: list = []

    async def endpoint(websocket: WebSocket) -> None:
        await websocket.accept()

        async def flood() -> None:
            for _ in range(5_000):
                await send(websocket, [b"x" * 1_000], way, ways_taken)
                sent.append(1)
        task = asyncio.create_task(flood())
        await asyncio.sleep(1.5)
        buffered.append(protocols[0].transport.get_write_buffer_size())
        task.cancel()

    server, port = served(Starlette(routes=[WebSocketRoute("/", endpoint)]), [], protocols)
    peer = socket.socket()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        peer.connect(("127.0.0.1", port))
        peer.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        deadline = time.monotonic() + 10
        while not buffered and time.monotonic() < deadline:  # never reads
            time.sleep(0.05)
    finally:
        peer.close()
        server.should_exit = True
    assert buffered and buffered[0] <= 64 * 1024 + MAX_HELD_BYTES
    assert len(sent) < 5_000
    assert "asgi" in ways_taken  # the paused socket sent the long way, which waits


@settings(max_examples=200, deadline=None)
@given(message=st.one_of(st.text(max_size=300), st.binary(max_size=300),
                         st.integers(0, 70_000).map(lambda n: b"\x01" * n),
                         st.sampled_from([125, 126, 127, 65_535, 65_536]).map(
                             lambda n: "é" * (n // 2) + "a" * (n % 2))))
def test_a_data_frame_is_the_librarys_own_serialisation(message):
    """`data_frame` (the sender's fast path) builds the bytes the websockets library does for a server's unmasked,
    final data frame, at every length encoding (7, 16, 64 bits) and for text and binary."""
    opcode, data = (Opcode.TEXT, message.encode()) if isinstance(message, str) else (Opcode.BINARY, message)
    assert data_frame(message) == Frame(opcode, data).serialize(mask=False)
