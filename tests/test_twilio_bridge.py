"""The example Twilio bridge (scripts/twilio_bridge.py) between a simulated Twilio Media Streams peer and a real
voxgate server (tiny model, CPU)."""
from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

from realtime.audio.mulaw import mulaw_decode
from scripts.twilio_bridge import TwilioBridge, fixed_text
from tests.gateway_server import running_server

SID = "MZ0123456789abcdef"
LONG = ("Thanks for calling the city library. Our opening hours are nine to five on weekdays, and ten to two on "
        "Saturdays. You can renew your books online, by phone, or at any branch.")


@pytest.fixture(scope="module")
def voxgate(one_thread):
    with running_server() as running:
        yield running


class TwilioPeer:
    """Twilio's side of a Media Streams socket: the events it sends, and what it gets back."""

    def __init__(self, ws) -> None:
        self.ws = ws

    async def send(self, event: str, **fields) -> None:
        await self.ws.send(json.dumps({"event": event, **fields}))

    async def open_stream(self) -> None:
        await self.send("connected", protocol="Call", version="1.0.0")
        await self.send("start", sequenceNumber="1", streamSid=SID,
                        start={"streamSid": SID, "callSid": "CA01", "tracks": ["inbound"],
                               "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}})

    async def next(self, timeout: float = 60.0) -> dict:
        message = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        assert message["streamSid"] == SID
        return message

    async def until(self, event: str) -> list[dict]:
        """Everything up to and including the first `event`."""
        seen = [await self.next()]
        while seen[-1]["event"] != event:
            seen.append(await self.next())
        return seen

    async def quiet_for(self, seconds: float) -> list[dict]:
        """What arrives within `seconds`."""
        seen = []
        try:
            while True:
                seen.append(await self.next(timeout=seconds))
        except asyncio.TimeoutError:
            return seen


async def call(voxgate_url: str, source, scenario):
    """Run `scenario(peer, bridge)` on a call through a fresh bridge; Twilio stops the stream afterwards."""
    bridge = TwilioBridge(voxgate_url, source)
    async with serve(bridge.handle, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}") as ws:
            peer = TwilioPeer(ws)
            await peer.open_stream()
            result = await scenario(peer, bridge)
            await peer.send("stop", sequenceNumber="99", streamSid=SID, stop={"callSid": "CA01"})
            return result


def payloads(messages: list[dict]) -> list[bytes]:
    return [base64.b64decode(m["media"]["payload"], validate=True) for m in messages if m["event"] == "media"]


def test_audio_reaches_twilio_as_mulaw_media_then_the_mark(voxgate):
    async def scenario(peer, bridge):
        seen = await peer.until("mark")
        after = await peer.quiet_for(1.0)
        await peer.send("mark", sequenceNumber="50", streamSid=SID, mark=seen[-1]["mark"])
        for _ in range(100):
            if bridge.calls[SID].played:
                break
            await asyncio.sleep(0.02)
        return seen, after, list(bridge.calls[SID].played)

    seen, after, played = asyncio.run(call(voxgate.ws, fixed_text("Hello there, thanks for calling."), scenario))
    chunks = payloads(seen[:-1])
    assert [m["event"] for m in seen] == ["media"] * len(chunks) + ["mark"]
    assert chunks and all(len(c) == 160 for c in chunks[:-1]) and 0 < len(chunks[-1]) <= 160
    audio = mulaw_decode(b"".join(chunks))
    assert audio.dtype == np.int16 and len(audio) == sum(map(len, chunks)) and np.any(audio != 0)
    assert seen[-1]["mark"]["name"] == "reply-1:1" and played == ["reply-1:1"]
    assert after == []  # the mark closed the only text: nothing follows it


def test_barge_in_clears_twilio_and_stops_the_audio(voxgate):
    async def scenario(peer, bridge):
        before = await peer.until("media")
        await peer.send("dtmf", sequenceNumber="7", streamSid=SID, dtmf={"track": "inbound_track", "digit": "1"})
        until_clear = await peer.until("clear")
        after = await peer.quiet_for(1.5)
        return before + until_clear, after, bridge.calls[SID].muted, voxgate.metric("voxgate_contexts_active")

    seen, after, muted, generating = asyncio.run(call(voxgate.ws, fixed_text(LONG), scenario))
    assert seen[-1] == {"event": "clear", "streamSid": SID}
    assert {m["event"] for m in seen[:-1]} <= {"media"}
    assert after == [] and muted == {"reply-1"}
    assert generating == 0  # voxgate cancelled the context (it had seconds of audio left to make)
