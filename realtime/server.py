"""Running the app under uvicorn: WebSocket compression off, the message size limit, pings for dead peers, and a
shutdown that lets sessions finish or cancel their contexts before uvicorn closes the sockets."""
from __future__ import annotations

import logging

import uvicorn

from realtime.app import create_app, drain_sessions
from realtime.gateway import Gateway, GatewayOptions

PING_INTERVAL_S = 20.0
PING_TIMEOUT_S = 20.0


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway

    async def shutdown(self, sockets=None) -> None:
        await drain_sessions(self.gateway)
        await super().shutdown(sockets)


def build_server(options: GatewayOptions, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "info") -> _Server:
    gateway = Gateway(options)
    config = uvicorn.Config(create_app(gateway), host=host, port=port, log_level=log_level, ws="websockets",
                            ws_max_size=options.limits.max_message_bytes, ws_per_message_deflate=False,
                            ws_ping_interval=PING_INTERVAL_S, ws_ping_timeout=PING_TIMEOUT_S,
                            timeout_graceful_shutdown=10)
    return _Server(config, gateway)


def serve(options: GatewayOptions, host: str, port: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm = f"answers from {options.llm.model}" if options.llm else "no --llm-url: it speaks what you type"
    logging.getLogger("voxgate").info("voice-chat demo: http://%s:%d/ (%s)", host, port, llm)
    build_server(options, host, port).run()
