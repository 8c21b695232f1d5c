"""The floor of the gateway's audio path per WebSocket message: one binary message sent by a starlette endpoint
through uvicorn with the gateway's own protocol (`realtime.server.GatewayWebSocketProtocol`), nothing else, read
by a websockets client in another process. An Opus stream at 20 ms frames is 50 such messages a second, all sent from
the gateway's one event loop, so this says how far the gateway's own per-message work (framing, the outbox, the
metrics, the engine and encoder pipes) is above what the web stack alone costs (docs/benchmarks.md).
    python scripts/bench_ws_send.py
    python scripts/bench_ws_send.py --messages 500 --bytes 68 --burst 16 --send now
`--send now` sends as the gateway's sender does while the socket keeps up (`SEND_NOW_EXTENSION`, past the ASGI
layers); `--send asgi` (the default) through starlette's `send_bytes`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from realtime.server import GatewayWebSocketProtocol
from realtime.ws.protocol import SEND_NOW_EXTENSION


def sender_app(messages: int, payload: bytes, burst: int, send: str, result: dict[str, float]) -> Starlette:
    async def endpoint(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.receive()  # the client is ready
        send_now = websocket.scope["extensions"][SEND_NOW_EXTENSION] if send == "now" else None
        cpu, wall = time.thread_time(), time.perf_counter()
        for sent in range(0, messages, burst):  # a burst is an outbox item: a chunk's packets
            chunk = [payload] * min(burst, messages - sent)
            if send_now is None or not send_now(chunk):
                for message in chunk:
                    await websocket.send_bytes(message)
            await asyncio.sleep(0)  # the end of a burst: the loop's turn ends, as the gateway's sender's does
        result["cpu_us_per_message"] = (time.thread_time() - cpu) / messages * 1e6
        result["wall_us_per_message"] = (time.perf_counter() - wall) / messages * 1e6
        await websocket.close()
    return Starlette(routes=[WebSocketRoute("/send", endpoint)])


def receive_all(url: str) -> int:
    """In a process of its own: start the sender and count what arrives until it closes."""
    async def go() -> int:
        received = 0
        async with connect(url, max_size=None) as ws:
            await ws.send("go")
            try:
                while True:
                    await ws.recv()
                    received += 1
            except ConnectionClosed:
                return received
    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--bytes", type=int, default=68, help="payload: 8 header bytes + a 60-byte Opus packet")
    parser.add_argument("--burst", type=int, default=1,
                        help="messages sent in one turn of the event loop (a 320 ms chunk of 20 ms packets: 16)")
    parser.add_argument("--send", choices=["asgi", "now"], default="asgi")
    args = parser.parse_args()
    result: dict[str, float] = {}
    app = sender_app(args.messages, b"\x01" * args.bytes, args.burst, args.send, result)
    config = uvicorn.Config(app, port=0, log_level="warning",
                            ws=GatewayWebSocketProtocol, ws_per_message_deflate=False)
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        received = pool.apply(receive_all, (f"ws://127.0.0.1:{port}/send",))
    server.should_exit = True
    print(json.dumps({"messages": args.messages, "received": received, "bytes": args.bytes, "burst": args.burst,
                      "send": args.send,
                      **{k: round(v, 2) for k, v in result.items()}}))


if __name__ == "__main__":
    main()
