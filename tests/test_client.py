"""The Python client (clients/python: voxgate_client.client) against a real voxgate server (tiny model, CPU)."""
from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.client import connect as ws_connect

from realtime.gateway import Limits
from tests.gateway_server import running_server
from voxgate_client.client import AudioFrame, VoxgateClient, decode_opus
from voxgate_client.protocol import ServerError, VoxgateRefused, auth_headers, handshake

PIECES = ["Hel", "lo the", "re, how ", "are you", " today?"]


@pytest.fixture(scope="module")
def server(one_thread):
    with running_server(Limits(api_keys=("k1",))) as running:
        yield running


def run(coroutine):
    return asyncio.run(coroutine)


def assert_one_context(frames: list[AudioFrame], context_id: str, samples_per_frame: int) -> None:
    """Its own stream, FIRST on the first frame only, LAST on the last only, pts one packet apart."""
    assert frames and {f.context_id for f in frames} == {context_id}
    assert len({f.stream_id for f in frames}) == 1
    assert [f.first for f in frames] == [True] + [False] * (len(frames) - 1)
    assert [f.last for f in frames] == [False] * (len(frames) - 1) + [True]
    assert [f.pts for f in frames] == [samples_per_frame * i for i in range(len(frames))]


def test_small_pieces_decode_to_the_announced_length(server):
    async def go():
        async with VoxgateClient.connect(server.ws, api_key="k1") as client:
            return client.session, await client.speak("a", PIECES, delay_s=0.02)

    session, result = run(go())
    rate, pre_skip = session["audio"]["sample_rate"], session["audio"]["pre_skip"]
    assert session["audio"]["encoding"] == "opus" and result.done is not None and not result.errors
    assert_one_context(result.frames, "a", rate * session["audio"]["frame_ms"] // 1000)
    samples = decode_opus(result.frames, rate, pre_skip)
    assert len(samples) + pre_skip == round(result.done["audio_ms"] * rate / 1000)
    assert 0 < result.ttfa_s < result.arrivals[-1] - result.started_at
    assert result.arrivals == sorted(result.arrivals)


def test_concurrent_contexts_on_one_session_each_get_their_own_frames(server):
    async def go():
        async with VoxgateClient.connect(server.ws, token="k1", encoding="pcm_s16le", sample_rate=16000) as client:
            results = await asyncio.gather(client.speak("x", PIECES), client.speak("y", ["Another one, ", "here."]))
            return client.session, results

    session, (x, y) = run(go())
    assert session["audio"]["encoding"] == "pcm_s16le" and session["audio"]["sample_rate"] == 16000
    for result, context_id in ((x, "x"), (y, "y")):
        assert result.done is not None and result.done["context_id"] == context_id
        assert_one_context(result.frames, context_id, 320)
        assert sum(len(f.payload) for f in result.frames) // 2 == round(result.done["audio_ms"] * 16)
    assert x.frames[0].stream_id != y.frames[0].stream_id


def test_start_returns_the_new_session_started_and_events_carry_the_rest(server):
    async def go():
        async with VoxgateClient.connect(server.ws, api_key="k1") as client:
            started = await client.start(preset="twilio", audio={"encoding": "nope"})
            await client.ping("p1")
            seen = []
            async for event in client.events():
                seen.append(event)
                if event.get("type") == "pong":
                    break
            return started, seen

    started, seen = run(go())
    assert started["audio"]["encoding"] == "mulaw" and started["transport"] == {"audio": "json"}
    assert [e["code"] for e in seen if e["type"] == "error"] == ["unsupported_format"]
    assert seen[-1]["id"] == "p1"


def test_json_transport_audio_becomes_frames(server):
    async def go():
        async with VoxgateClient.connect(server.ws, api_key="k1", preset="twilio") as client:
            return await client.speak("m", ["Hi there."])

    result = run(go())
    assert result.done is not None
    assert_one_context(result.frames, "m", 160)
    assert all(len(f.payload) == 160 for f in result.frames[:-1]) and len(result.frames[-1].payload) <= 160


def test_graceful_close_finishes_the_open_context_and_closes_normally(server):
    async def go():
        async with VoxgateClient.connect(server.ws, api_key="k1") as client:
            events = asyncio.create_task(collect(client))
            await client.append("g", "Goodbye now.")
            await client.close()
            return client.close_code, await events

    async def collect(client):
        return [event async for event in client.events()]

    close_code, events = run(go())
    kinds = [e["type"] if isinstance(e, dict) else "audio" for e in events]
    assert close_code == 1000 and kinds[-2:] == ["context.done", "session.closed"] and "audio" in kinds


@pytest.mark.parametrize("credentials", [{}, {"api_key": "wrong"}, {"token": "wrong"}])
def test_a_wrong_api_key_is_refused_with_4001(server, credentials):
    async def go():
        async with VoxgateClient.connect(server.ws, **credentials):
            pass

    with pytest.raises(VoxgateRefused) as refused:
        run(go())
    assert refused.value.code == "unauthorized" and refused.value.close_code == 4001


def test_handshake_waits_for_the_session_started_that_answers_its_session_start(server):
    """The server's first session.started carries the defaults (opus); the plugins need the second one, and a
    field the server refuses must stop them rather than leave them at a rate they did not ask for."""
    async def go():
        async with ws_connect(server.ws, additional_headers=auth_headers("k1")) as ws:
            started = await handshake(ws, audio={"encoding": "pcm_s16le", "sample_rate": 16000}, timestamps="word")
        async with ws_connect(server.ws, additional_headers=auth_headers("k1")) as ws:
            with pytest.raises(ServerError) as refused:
                await handshake(ws, audio={"encoding": "pcm_s16le", "sample_rate": 11025})
        return started, refused.value

    started, refused = run(go())
    assert started["audio"]["encoding"] == "pcm_s16le" and started["audio"]["sample_rate"] == 16000
    assert started["timestamps"] == "word" and refused.code == "unsupported_format"
