"""The LiveKit Agents plugin (voxgate_client.livekit) driven through LiveKit's own `tts.TTS` API against a real server
(tiny model, CPU): streams and HTTP requests give the server's audio as frames at the TTS's rate, words come with
their times, closing a stream mid-speech cancels it with no audio after, and pooled sockets outlive the idle timeout."""
from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import numpy as np
import pytest
from livekit.agents import APIConnectionError, APIError, APIStatusError, APITimeoutError
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT, APIConnectOptions

from realtime.gateway import Limits
from tests.gateway_server import running_server, short_speech_server
from voxgate_client.client import VoxgateClient
from voxgate_client.livekit import TTS, SynthesizeStream, VoiceOptions

SEED = 5
TEXT = "Hello there, how are you today?"
LONG_TEXT = " ".join(f"Sentence number {i} goes on for a while, so that speaking it takes time." for i in range(12))

@pytest.fixture(scope="module")
def server(one_thread):
    with short_speech_server() as running:
        yield running


async def reference_pcm(server, text: str, sample_rate: int) -> bytes:
    """The same text, voice and seed through the plain client: the audio the plugin must pass on."""
    async with VoxgateClient.connect(server.ws, encoding="pcm_s16le", sample_rate=sample_rate) as client:
        await client.start(sampling={"seed": SEED})
        result = await client.speak("reference", [text])
    assert result.done is not None and not result.errors
    return b"".join(f.payload for f in result.frames)


def speech_pcm(frames, sample_rate: int) -> bytes:
    """The frames' samples, less the 10 ms of silence LiveKit's emitter adds as a segment's final marker when the
    last audio had already gone out (a flush for slow generation): that marker is LiveKit's, not the server's."""
    pcm = b"".join(bytes(f.data) for f in frames)
    marker = sample_rate // 100
    if frames[-1].samples_per_channel == marker and not any(bytes(frames[-1].data)):
        return pcm[:-2 * marker]
    return pcm


def test_a_stream_is_the_servers_audio_at_the_tts_rate(server):
    async def go():
        async with TTS(base_url=server.http, voice=VoiceOptions(seed=SEED), sample_rate=16000) as voxgate:
            stream = voxgate.stream()
            for token in ["Hello", " there,", " how are", " you today?"]:
                stream.push_text(token)
            stream.end_input()
            events = [event async for event in stream]
            await stream.aclose()
        return stream, events, await reference_pcm(server, TEXT, 16000)

    stream, events, reference = asyncio.run(go())
    frames = [e.frame for e in events]
    assert {f.sample_rate for f in frames} == {16000} and {f.num_channels for f in frames} == {1}
    assert stream.closing_event["type"] == "context.done" and events[-1].is_final
    assert speech_pcm(frames, 16000) == reference
    assert len(reference) // 2 == round(stream.closing_event["audio_ms"] * 16)


def test_a_burst_of_tokens_is_all_spoken():
    """Hostile try 12: 600 tokens pushed at once went as 600 appends; past the server's message rate 193 were dropped
    and the stream hung. Against a server allowing 20 messages a second (bursts of 40), 240 tokens at once: every
    word is in the transcript, in order. (Text pushed after a mid-stream `flush()` is dropped by LiveKit itself,
    which no longer takes several segments a stream.)"""
    words = [f"w{i}" for i in range(240)]

    async def go():
        with running_server(Limits(max_message_rate=20.0), synthetic_frames_per_token=1.0) as server:
            async with TTS(base_url=server.http) as voxgate:
                stream = voxgate.stream()
                for index, word in enumerate(words):
                    stream.push_text((" " if index else "") + word)
                stream.end_input()
                async with asyncio.timeout(120):
                    events = [event async for event in stream]
                await stream.aclose()
                return stream, events

    stream, events = asyncio.run(go())
    spoken_words = [w for e in events for w in e.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert stream.closing_event["type"] == "context.done"
    assert "".join(spoken_words).split() == words


async def spoken(voxgate: TTS, **options) -> tuple[SynthesizeStream, list]:
    """One stream of TEXT run to its end: the stream (its `closing_event`) and its events."""
    stream = voxgate.stream(**options)
    stream.push_text(TEXT)
    stream.end_input()
    events = [event async for event in stream]
    await stream.aclose()
    return stream, events


def test_a_stream_carries_the_words_with_their_times(server):
    async def go():
        async with TTS(base_url=server.http) as voxgate:
            return (await spoken(voxgate))[1]

    events = asyncio.run(go())
    words = [w for e in events for w in e.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert "".join(words).split() == TEXT.split()
    starts = [w.start_time for w in words]
    assert starts == sorted(starts) and all(w.start_time < w.end_time for w in words)
    assert 0 <= starts[0]  # times are the server's estimates (`estimated: true`), in seconds of the context


def test_closing_a_stream_mid_speech_cancels_it_and_the_socket_serves_the_next(server):
    async def go():
        async with TTS(base_url=server.http) as voxgate:
            stream = voxgate.stream()
            stream.push_text(LONG_TEXT)
            stream.end_input()
            heard = [await anext(stream)]
            await stream.aclose()  # what LiveKit does on barge-in
            sessions = server.metric("voxgate_sessions_active")
            nxt = voxgate.stream()
            nxt.push_text(TEXT)
            nxt.end_input()
            events = [event async for event in nxt]
            await nxt.aclose()
        return stream, heard, sessions, nxt, events

    stream, heard, sessions, nxt, events = asyncio.run(go())
    cancelled = stream.closing_event
    assert cancelled["type"] == "context.cancelled" and cancelled["reason"] == "client"
    assert sum(e.frame.samples_per_channel for e in heard) <= round(cancelled["audio_sent_ms"] * 24)
    assert sessions == 1  # the socket went back to the pool
    done = nxt.closing_event  # the next stream on it hears its own audio only: nothing of the cancelled context
    assert done["type"] == "context.done"
    assert len(speech_pcm([e.frame for e in events], 24000)) // 2 == round(done["audio_ms"] * 24)


def test_a_pooled_socket_outlives_the_idle_timeout(server):
    """The server closes a session idle for 1 s here; the pooled socket's keepalives (every 0.25 s) keep it."""
    async def go():
        async with TTS(base_url=server.http) as voxgate:
            voxgate.prewarm()
            await asyncio.sleep(2.5)
            sessions = server.metric("voxgate_sessions_active")
            stream = voxgate.stream()
            stream.push_text(TEXT)
            stream.end_input()
            events = [event async for event in stream]
            await stream.aclose()
        return sessions, stream, events

    sessions, stream, events = asyncio.run(go())
    assert sessions == 1 and stream.closing_event["type"] == "context.done" and events


@pytest.mark.parametrize("sample_rate", [24000, 16000])
def test_synthesize_is_the_speech_endpoints_pcm(server, sample_rate):
    async def go():
        async with aiohttp.ClientSession() as http, TTS(base_url=server.http, http_session=http,
                                                        voice=VoiceOptions(seed=SEED),
                                                        sample_rate=sample_rate) as voxgate:
            frames = [event.frame async for event in voxgate.synthesize(TEXT)]
        return frames, await reference_pcm(server, TEXT, 24000)

    frames, reference = asyncio.run(go())
    assert {f.sample_rate for f in frames} == {sample_rate}
    pcm = speech_pcm(frames, sample_rate)
    if sample_rate == 24000:
        assert pcm == reference  # the socket's audio, sample for sample, for the same seed
    else:  # LiveKit's resampler: the same duration within a few ms of its filter's delay
        assert abs(len(pcm) / 2 / sample_rate - len(reference) / 2 / 24000) < 0.01
        assert np.abs(np.frombuffer(pcm, "<i2")).max() > 0


def test_synthesize_passes_the_servers_error_on(server):
    async def go():
        async with aiohttp.ClientSession() as http, TTS(base_url=server.http, http_session=http,
                                                        voice=VoiceOptions(voice="no-such-voice")) as voxgate:
            await voxgate.synthesize(TEXT, conn_options=APIConnectOptions(max_retry=0)).collect()

    with pytest.raises(APIStatusError) as failure:
        asyncio.run(go())
    assert failure.value.status_code == 400 and not failure.value.retryable
    assert failure.value.body["code"] == "unknown_voice"


def test_a_rate_the_server_does_not_send_is_refused():
    with pytest.raises(ValueError, match="not 11025"):
        TTS(base_url="http://127.0.0.1:1", sample_rate=11025)


def test_text_the_server_refuses_fails_the_stream_with_its_code(server):
    """A lone surrogate (broken LLM output) is refused on the context's first append: no context, a specific error."""
    async def go():
        async with TTS(base_url=server.http) as voxgate:
            stream = voxgate.stream(conn_options=APIConnectOptions(max_retry=0))
            stream.push_text("Broken \ud800 text.")
            stream.end_input()
            return [event async for event in stream]

    with pytest.raises(APIError) as failure:
        asyncio.run(go())
    assert failure.value.body["code"] == "invalid_message" and not failure.value.retryable


def test_text_with_nothing_to_say_fails_the_stream_at_once_without_retries(server):
    """Hostile try 12: emoji alone get `empty_text` and then `context.done` with no audio; LiveKit took the silent
    stream for a failure worth retrying (three retries, 4 s). It fails at once, with the server's code, not retried."""
    async def go():
        async with TTS(base_url=server.http) as voxgate:
            stream = voxgate.stream(conn_options=APIConnectOptions(max_retry=3, retry_interval=2.0))
            stream.push_text("\U0001f600\U0001f389")
            stream.end_input()
            return [event async for event in stream]

    started = time.monotonic()
    with pytest.raises(APIError) as failure:
        asyncio.run(go())
    assert failure.value.body["code"] == "empty_text" and not failure.value.retryable
    assert time.monotonic() - started < 1.5  # no retry waited out


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def failed_stream(voxgate: TTS, retries: int) -> tuple[BaseException, list]:
    """A stream that cannot get a session: what it raises, and the `error` events LiveKit emitted."""
    reported = []
    voxgate.on("error", reported.append)
    stream = voxgate.stream(conn_options=APIConnectOptions(max_retry=retries, retry_interval=0.01, timeout=5))
    stream.push_text(TEXT)
    stream.end_input()
    with pytest.raises(APIError) as failure:
        async for _ in stream:
            pass
    await stream.aclose()
    return failure.value, reported


def test_a_server_that_cannot_be_reached_is_a_retried_connection_error():
    """LiveKit retries and reports only its own API errors: an unreachable server must be one."""
    async def go():
        async with TTS(base_url=f"http://127.0.0.1:{free_port()}") as voxgate:
            return await failed_stream(voxgate, retries=1)

    error, reported = asyncio.run(go())
    assert isinstance(error, APIConnectionError) and error.retryable
    assert all(isinstance(event.error, APIConnectionError) for event in reported)
    assert [event.recoverable for event in reported] == [True, False]  # one retry, then given up


@pytest.mark.parametrize("api_key, status", [("wrong", 401), ("k", 400)])
def test_a_refused_session_is_a_status_error_that_is_not_retried(api_key, status):
    """A wrong key (401) and a voice the server does not have (400) fail at once: retrying cannot help."""
    async def go():
        with running_server(Limits(api_keys=("k",))) as keyed:
            async with TTS(base_url=keyed.http, api_key=api_key, voice=VoiceOptions(voice="nobody")) as voxgate:
                return await failed_stream(voxgate, retries=2)

    error, reported = asyncio.run(go())
    assert isinstance(error, APIStatusError) and error.status_code == status and not error.retryable
    assert len(reported) == 1 and not reported[0].recoverable


def test_a_pooled_socket_that_closed_meanwhile_is_replaced(server):
    """A server restart closes the idle pooled sockets: the next stream takes a new one instead of failing."""
    async def go():
        async with TTS(base_url=server.http) as voxgate:
            await spoken(voxgate)
            pooled = await voxgate._pool.get(timeout=5)
            voxgate._pool.put(pooled)
            await pooled.ws.close(1001)  # as a stopping server closes it
            return await spoken(voxgate, conn_options=APIConnectOptions(max_retry=0))

    stream, events = asyncio.run(go())
    assert stream.closing_event["type"] == "context.done" and events


def test_synthesize_of_blank_text_is_no_audio_and_no_error(server):
    async def go():
        async with aiohttp.ClientSession() as http, TTS(base_url=server.http, http_session=http) as voxgate:
            return [event async for event in voxgate.synthesize("  ")]

    assert asyncio.run(go()) == []


@pytest.mark.parametrize("blank", [" ", "\n\n", " \t "])
def test_a_stream_of_blank_text_is_no_audio_and_no_error(server, blank):
    """A clients' check found `stream()` failing blank text with the server's `empty_text` where `synthesize()` and
    LiveKit's base take it as nothing to say; ended by `end_input` or by a flush alone."""
    async def go(end_input: bool):
        async with TTS(base_url=server.http) as voxgate:
            stream = voxgate.stream(conn_options=APIConnectOptions(max_retry=0))
            for token in blank:
                stream.push_text(token)
            stream.end_input() if end_input else stream.flush()
            async with asyncio.timeout(20):
                events = [event async for event in stream]
            await stream.aclose()
            return events

    assert asyncio.run(go(True)) == [] and asyncio.run(go(False)) == []


def test_a_flush_ends_the_streams_segment(server):
    """LiveKit's `flush()` ends the segment, and LiveKit drops text pushed after it: a clients' check found the
    stream waiting for an `end_input` that an application calling `flush()` never sends. Now its audio ends with a
    final frame, all of the text's."""
    async def go():
        async with TTS(base_url=server.http, voice=VoiceOptions(seed=SEED)) as voxgate:
            stream = voxgate.stream()
            for token in ["Hello", " there,", " how are", " you today?"]:
                stream.push_text(token)
            stream.flush()
            async with asyncio.timeout(60):
                events = [event async for event in stream]
            await stream.aclose()
        return stream, events, await reference_pcm(server, TEXT, 24000)

    stream, events, reference = asyncio.run(go())
    assert stream.closing_event["type"] == "context.done" and events[-1].is_final
    assert speech_pcm([e.frame for e in events], 24000) == reference


def test_a_regional_language_tag_is_sent_as_its_language(server):
    """LiveKit writes languages as regional tags ("en-US"); the server takes "en" (a clients' check found both
    `stream()` and `synthesize()` refused)."""
    async def go():
        options = VoiceOptions(language="en-US", seed=SEED)
        async with aiohttp.ClientSession() as http, TTS(base_url=server.http, http_session=http,
                                                        voice=options) as voxgate:
            streamed = (await spoken(voxgate, conn_options=APIConnectOptions(max_retry=0)))[1]
            whole = [event async for event in voxgate.synthesize(TEXT, conn_options=APIConnectOptions(max_retry=0))]
        return streamed, whole

    streamed, whole = asyncio.run(go())
    assert streamed and whole


def test_a_chinese_transcript_keeps_its_words_together(server):
    """The server's CJK words are a character and its punctuation each: LiveKit's transcript joins its timed words
    as they are, so only the other words carry a space after them."""
    async def go():
        async with TTS(base_url=server.http) as voxgate:
            stream = voxgate.stream()
            stream.push_text("你好。今天天气很好。")
            stream.end_input()
            events = [event async for event in stream]
            await stream.aclose()
        return events

    words = [w for e in asyncio.run(go()) for w in e.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert "".join(words) == "你好。今天天气很好。"


def test_synthesize_from_a_server_that_stalls_mid_body_times_out():
    """A response whose headers came and whose body stops: the read times out into LiveKit's retry rules (with a
    timeout on the connection alone the stream waited forever)."""
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: audio/pcm\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n\0\0\0\0\r\n")
        await writer.drain()
        await asyncio.sleep(60)

    async def go():
        server = await asyncio.start_server(stall, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, aiohttp.ClientSession() as http, TTS(base_url=f"http://127.0.0.1:{port}",
                                                                http_session=http) as voxgate:
            options = APIConnectOptions(max_retry=0, timeout=0.5)
            await asyncio.wait_for(voxgate.synthesize(TEXT, conn_options=options).collect(), 20)

    with pytest.raises(APIError) as failure:
        asyncio.run(go())
    assert isinstance(failure.value, (APITimeoutError, APIConnectionError)) and failure.value.retryable
