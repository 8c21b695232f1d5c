"""An example bridge from a Twilio Media Streams call to voxgate: Twilio connects here, and the bridge speaks the
text of a pluggable async text source (by default one fixed greeting, `--say`) into the call.

The voxgate session uses the `twilio` preset (mu-law 8 kHz, 20 ms, JSON transport), so each voxgate `audio` event's
`data` goes out unchanged as a Twilio `media` payload. Each text piece is followed by a voxgate `mark`, forwarded to
Twilio as a Twilio `mark` once its audio has been sent, so that Twilio echoes it when the caller has heard it.
A barge-in (`Call.barge_in()`, or a DTMF key from the caller) sends Twilio `clear` and cancels voxgate's contexts;
no audio of a cancelled context is forwarded after the `clear`. Caller audio (`media` from Twilio) would feed a
speech recognizer in a real agent; here it is ignored.
    python scripts/twilio_bridge.py --voxgate ws://127.0.0.1:8000/v1/tts/stream --port 8080 --say "Hello!"
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from voxgate_client.client import AudioFrame, ServerError, VoxgateClient  # noqa: E402

log = logging.getLogger("twilio_bridge")
TextSource = Callable[[], AsyncIterator[str]]  # called once per call; yields the text to speak, piece by piece


def fixed_text(*pieces: str) -> TextSource:
    async def source() -> AsyncIterator[str]:
        for piece in pieces:
            yield piece
    return source


class Call:
    """One Twilio stream and its voxgate session."""

    def __init__(self, twilio: ServerConnection, stream_sid: str, voxgate: VoxgateClient) -> None:
        self.twilio, self.stream_sid, self.voxgate = twilio, stream_sid, voxgate
        self.context_id: str | None = None  # where text goes now; a barge-in starts a new one
        self.opened: set[str] = set()
        self.muted: set[str] = set()  # barged-in contexts: their audio is dropped
        self.played: list[str] = []  # mark names Twilio reported as heard
        self._send_lock = asyncio.Lock()  # a clear is never overtaken by media checked before it
        self._numbers = itertools.count(1)

    async def speak(self, source: TextSource) -> None:
        async for text in source():
            context_id = self._current()
            await self.voxgate.append(context_id, text)
            await self.voxgate.mark(context_id, f"{context_id}:{next(self._numbers)}")
        if self.context_id is not None:
            await self.voxgate.end(self.context_id)

    def _current(self) -> str:
        if self.context_id is None:
            self.context_id = f"reply-{len(self.opened) + 1}"
            self.opened.add(self.context_id)
        return self.context_id

    async def forward(self) -> None:
        """voxgate audio -> Twilio media, voxgate marks -> Twilio marks."""
        async for item in self.voxgate.events():
            if isinstance(item, AudioFrame):
                if item.payload:
                    payload = base64.b64encode(item.payload).decode()  # the very string voxgate sent
                    await self._send_for(item.context_id, "media", media={"payload": payload})
            elif item.get("type") == "mark":
                await self._send_for(item["context_id"], "mark", mark={"name": item["name"]})
            elif item.get("type") == "error":
                log.warning("voxgate error on stream %s: %s", self.stream_sid, item)

    async def _send_for(self, context_id: str | None, event: str, **fields: Any) -> None:
        async with self._send_lock:
            if context_id not in self.muted:
                await self._send_twilio(event, **fields)

    async def barge_in(self) -> None:
        """The caller talks over the agent: Twilio drops its buffered audio, voxgate stops generating."""
        async with self._send_lock:
            self.muted |= self.opened
            self.context_id = None
            await self._send_twilio("clear")
        await self.voxgate.cancel("*")

    async def _send_twilio(self, event: str, **fields: Any) -> None:
        await self.twilio.send(json.dumps({"event": event, "streamSid": self.stream_sid, **fields}))


class TwilioBridge:
    def __init__(self, voxgate_url: str, text_source: TextSource, api_key: str | None = None,
                 voice: str | None = None) -> None:
        self.voxgate_url, self.text_source = voxgate_url, text_source
        self.api_key, self.voice = api_key, voice
        self.calls: dict[str, Call] = {}  # by streamSid, while connected

    async def handle(self, twilio: ServerConnection) -> None:
        """One Twilio connection: `connected`, `start`, then media / mark / dtmf until `stop`."""
        try:
            stream_sid = await _stream_start(twilio)
            if stream_sid is None:
                return
            async with VoxgateClient.connect(self.voxgate_url, api_key=self.api_key, preset="twilio",
                                             voice=self.voice) as voxgate:
                call = self.calls[stream_sid] = Call(twilio, stream_sid, voxgate)
                tasks = [asyncio.create_task(call.forward()), asyncio.create_task(call.speak(self.text_source))]
                try:
                    await _listen(twilio, call)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    del self.calls[stream_sid]
        except ConnectionClosed:
            pass
        except ServerError as failure:  # refused: the call stays silent
            log.error("voxgate refused the session: %s", failure)

    async def serve_forever(self, host: str, port: int) -> None:
        async with serve(self.handle, host, port) as server:
            await server.serve_forever()


async def _stream_start(twilio: ServerConnection) -> str | None:
    """The streamSid of the `start` event (after `connected`), or None when the stream stops first."""
    async for raw in twilio:
        message = json.loads(raw)
        if message.get("event") == "start":
            return message.get("streamSid") or message["start"]["streamSid"]
        if message.get("event") == "stop":
            return None
    return None


async def _listen(twilio: ServerConnection, call: Call) -> None:
    async for raw in twilio:
        message = json.loads(raw)
        event = message.get("event")
        if event == "dtmf":
            await call.barge_in()
        elif event == "mark":
            call.played.append(message["mark"]["name"])
        elif event == "stop":
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--voxgate", default="ws://127.0.0.1:8000/v1/tts/stream", help="voxgate socket URL")
    parser.add_argument("--api-key", help="voxgate API key")
    parser.add_argument("--voice")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--say", default="Hello! Thanks for calling. How can I help you today?")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bridge = TwilioBridge(args.voxgate, fixed_text(args.say), args.api_key, args.voice)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(bridge.serve_forever(args.host, args.port))


if __name__ == "__main__":
    main()
