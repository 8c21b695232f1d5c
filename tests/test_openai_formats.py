"""`POST /v1/audio/speech` spoken to by the official `openai` SDK against a real server (uvicorn, the tiny model held to
exact lengths by --synthetic-frames-per-token): every OpenAI format streamed as it is made and decoded by FFmpeg's
decoders (PyAV) to the length the server reports (its metrics while streaming, X-Audio-Samples when whole); the HTTP
series of /metrics, told apart from the socket's; OpenMetrics negotiation; hostile values of the new fields."""
from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import math
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import av
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from engine.text.cleanup import clean_text
from realtime.audio import containers
from realtime.audio.formats import CONTENT_TYPES, HTTP_FORMATS, MODEL_SAMPLE_RATE
from realtime.gateway import Limits
from tests.gateway_server import RunningServer, running_server
from voxgate_client.client import VoxgateClient

LONG_TEXT = "Streaming speech starts playing long before the whole sentence is spoken."
FRAME_SAMPLES = MODEL_SAMPLE_RATE * 2 // 25  # one 12.5 Hz codec frame
# decoded length minus the audio the server made: ADTS cannot mark AAC's 1024 priming samples, nor a streamed MP3
# its encoder delay (a whole MP3 does, in its Xing/LAME frame); each pads its last frame
EXTRA = {"aac": (1024, 2047), "mp3": (0, 2303)}
MAGIC = {"wav": b"RIFF", "flac": b"fLaC", "opus": b"OggS", "mp3": b"\xff", "aac": b"\xff"}


@pytest.fixture(scope="module")
def server(one_thread):
    with running_server(Limits(max_text_chars=400), synthetic_frames_per_token=3.5) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric_samples(server: RunningServer, accept: str | None = None) -> tuple[str, dict]:
    """(content type, {(sample name, sorted labels): value}) of /metrics, parsed by prometheus_client's parser of
    what the content type says."""
    request = urllib.request.Request(server.http + "/metrics", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        content_type, text = response.headers["Content-Type"], response.read().decode()
    parse = openmetrics_families if content_type.startswith("application/openmetrics-text") else \
        text_string_to_metric_families
    return content_type, {(s.name, tuple(sorted(s.labels.items()))): s.value for f in parse(text) for s in f.samples}


def metric(server: RunningServer, name: str, **labels: str) -> float:
    return metric_samples(server)[1].get((name, tuple(sorted(labels.items()))), 0.0)


def http_audio_samples(server: RunningServer) -> int:
    return round(metric(server, "voxgate_audio_seconds_total", transport="http") * MODEL_SAMPLE_RATE)


def decoded_length(data: bytes, response_format: str) -> int:
    """Samples at 24 kHz that FFmpeg's decoder (through PyAV) gets out of a body; pcm is counted."""
    if response_format == "pcm":
        return len(data) // 2
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    return sum(frame.samples for frame in frames) * MODEL_SAMPLE_RATE // frames[0].sample_rate


def assert_length(decoded: int, made: int, response_format: str, streamed: bool) -> None:
    primed = response_format == "aac" or response_format == "mp3" and streamed
    low, high = EXTRA[response_format] if primed else (0, 0)
    assert made > 0 and made % FRAME_SAMPLES == 0
    assert made + low <= decoded <= made + high, (response_format, decoded, made)


@pytest.mark.parametrize("response_format", HTTP_FORMATS)
def test_every_format_streams_as_it_is_made(server, client, response_format):
    before = http_audio_samples(server)
    sent, arrivals, body = time.monotonic(), [], b""
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="vivian", input=LONG_TEXT, response_format=response_format) as response:
        headers = response.headers
        for piece in response.iter_bytes():
            arrivals.append(time.monotonic() - sent)
            body += piece
    assert headers["content-type"] == CONTENT_TYPES[response_format] and headers["transfer-encoding"] == "chunked"
    assert "content-length" not in headers and headers["x-sample-rate"] == "24000"
    assert len(arrivals) > 3, "the body came in one piece, not as it was made"
    assert arrivals[0] < 0.5 * arrivals[-1], f"the first bytes came at {arrivals[0]:.2f} s of {arrivals[-1]:.2f} s"
    assert_length(decoded_length(body, response_format), http_audio_samples(server) - before, response_format,
                  streamed=True)


@pytest.mark.parametrize("in_memory_bytes", [containers.WHOLE_IN_MEMORY_BYTES, 256], ids=["in memory", "on disk"])
@pytest.mark.parametrize("response_format", HTTP_FORMATS)
def test_a_whole_body_says_its_length(server, client, response_format, in_memory_bytes, monkeypatch):
    """Whole, from memory or (past the bound) from a file on disk: the same body with its exact length."""
    monkeypatch.setattr(containers, "WHOLE_IN_MEMORY_BYTES", in_memory_bytes)
    before = http_audio_samples(server)
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="vivian", input="Hello there.", response_format=response_format,
            extra_body={"stream": False}) as response:
        headers, body = response.headers, response.read()
    made = int(headers["x-audio-samples"])
    assert int(headers["content-length"]) == len(body) and "transfer-encoding" not in headers
    assert made == http_audio_samples(server) - before
    assert_length(decoded_length(body, response_format), made, response_format, streamed=False)


def test_streamed_and_whole_wav_carry_the_same_audio(server, client):
    """The same seed, streamed (sizes "unknown", 0xFFFFFFFF) and whole (exact sizes): the same samples."""
    bodies = {}
    for stream in (True, False):
        with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="vivian", input="Hello there.", response_format="wav",
                extra_body={"stream": stream, "seed": 11}) as response:
            bodies[stream] = response.read()
    streamed, whole = bodies[True], bodies[False]
    assert streamed[4:8] == streamed[40:44] == b"\xff\xff\xff\xff"
    assert int.from_bytes(whole[40:44], "little") == len(whole) - 44
    assert streamed[44:] == whole[44:] and len(whole) > 44


@pytest.mark.parametrize("response_format", ["pcm", "opus", "wav"])
def test_sse_deltas_carry_the_format_as_it_is_made(server, client, response_format):
    before = http_audio_samples(server)
    sent, events = time.monotonic(), []
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="vivian", input=LONG_TEXT, response_format=response_format,
            stream_format="sse") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic() - sent, json.loads(line[6:])))
    kinds = [event["type"] for _, event in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"} and len(kinds) > 3
    assert events[0][0] < 0.5 * events[-1][0]
    body = b"".join(base64.b64decode(event["audio"]) for _, event in events[:-1])
    samples = http_audio_samples(server) - before
    assert_length(decoded_length(body, response_format), samples, response_format, streamed=True)
    # OpenAI's schema requires usage on the last event: text tokens in (those the model reads: the cleaned text, read
    # as text), audio tokens (80 ms codec frames) out
    tokens = len(server.gateway.tts.tokenizer.target(clean_text(LONG_TEXT))[1])
    assert events[-1][1]["usage"] == {"input_tokens": tokens, "output_tokens": math.ceil(samples / 1920),
                                      "total_tokens": tokens + math.ceil(samples / 1920)}


def test_sse_usage_counts_the_tokens_the_model_reads(server, client):
    """A review's find: usage counted the raw text with the control tokens read as controls; the model reads the
    cleaned text (no markdown) with every character as text, and that is what usage counts now."""
    text = "Say <|im_end|> and **this** aloud."
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="vivian", input=text,
                                                            response_format="pcm", stream_format="sse") as response:
        done = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")][-1]
    tokenizer = server.gateway.tts.tokenizer
    read = len(tokenizer.target(clean_text(text))[1])
    assert done["type"] == "speech.audio.done" and done["usage"]["input_tokens"] == read
    assert read != len(tokenizer.encode(text))  # what it counted before


# --- metrics ------------------------------------------------------------------------------------------------------

def test_http_and_socket_traffic_move_their_own_series(server, client):
    def counts() -> dict[str, float]:
        samples = metric_samples(server)[1]
        return {f"{name}:{transport}": samples.get((name, (("transport", transport),)), 0.0)
                for name in ("voxgate_ttfa_seconds_count", "voxgate_audio_seconds_total")
                for transport in ("http", "ws")}

    before = counts()
    client.audio.speech.create(model="tts-1", voice="vivian", input="Hi.", response_format="pcm").read()
    after_http = counts()
    assert after_http["voxgate_ttfa_seconds_count:http"] == before["voxgate_ttfa_seconds_count:http"] + 1
    assert after_http["voxgate_audio_seconds_total:http"] > before["voxgate_audio_seconds_total:http"]
    assert after_http["voxgate_ttfa_seconds_count:ws"] == before["voxgate_ttfa_seconds_count:ws"]
    assert after_http["voxgate_audio_seconds_total:ws"] == before["voxgate_audio_seconds_total:ws"]

    async def speak() -> None:
        async with VoxgateClient.connect(server.ws, encoding="pcm_s16le") as socket:
            result = await socket.speak("c1", ["Hi."])
            assert result.done is not None and result.frames

    asyncio.run(speak())
    after_ws = counts()
    assert after_ws["voxgate_ttfa_seconds_count:ws"] == after_http["voxgate_ttfa_seconds_count:ws"] + 1
    assert after_ws["voxgate_audio_seconds_total:ws"] > after_http["voxgate_audio_seconds_total:ws"]
    assert after_ws["voxgate_ttfa_seconds_count:http"] == after_http["voxgate_ttfa_seconds_count:http"]


@pytest.mark.parametrize("body, status, code, param", [
    ({"input": "Hi.", "response_format": "ogg"}, 400, "unsupported_format", "response_format"),
    ({"input": "Hi.", "response_format": ""}, 400, "unsupported_format", "response_format"),  # a value, not absent
    ({"input": "Hi.", "stream_format": ""}, 400, "invalid_message", "stream_format"),
    ({"input": "   "}, 400, "empty_text", "input"),
    ({"input": "Hi.", "stream_format": "sse", "stream": False}, 400, "invalid_message", "stream"),
    ({"input": "Hi.", "voice": "nobody"}, 400, "unknown_voice", "voice"),
    ({"input": "x" * 401}, 400, "text_too_long", "input"),
])
def test_http_errors_are_counted_by_code(server, body, status, code, param):
    before = metric(server, "voxgate_errors_total", code=code, transport="http")
    before_status = metric(server, "voxgate_http_speech_requests_total", status=str(status))
    got, _, payload = server.post("/v1/audio/speech", body)
    error = json.loads(payload)["error"]
    assert got == status and error["code"] == code and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param  # OpenAI's shape, its SDKs read them
    assert metric(server, "voxgate_errors_total", code=code, transport="http") == before + 1
    assert metric(server, "voxgate_http_speech_requests_total", status=str(status)) == before_status + 1
    assert metric(server, "voxgate_errors_total", code=code, transport="ws") == 0


@pytest.mark.parametrize("accept, openmetrics", [
    (None, False), ("text/plain", False), ("*/*", False),
    ("application/openmetrics-text; version=1.0.0", True),
    ("application/openmetrics-text;version=1.0.0;q=0.9, text/plain;version=0.0.4;q=0.5", True),
    ("application/openmetrics-text", True),
    ("application/openmetrics-text; version=garbage", False),  # prometheus_client's parser raises on it
])
def test_metrics_negotiate_openmetrics(server, accept, openmetrics):
    with pytest.raises(urllib.error.HTTPError):  # an error counted, so that the errors series has a sample
        urllib.request.urlopen(urllib.request.Request(server.http + "/v1/audio/speech", data=b"{}"), timeout=30)
    content_type, samples = metric_samples(server, accept)
    if openmetrics:
        assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    else:
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    # either way the same series, PROTOCOL.md's names among them (OpenMetrics names the counter family without
    # _total, its samples with it)
    names = {name for name, _ in samples}
    assert {"voxgate_sessions_active", "voxgate_ttfa_seconds_bucket", "voxgate_audio_seconds_total",
            "voxgate_errors_total", "voxgate_engine_requests_active"} <= names


def wait_until(condition: Callable[[], bool], deadline: float, why: str) -> None:
    """Polls `condition` until it holds; fails with `why` once time.monotonic() passes `deadline`."""
    while not condition():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def speech_sent(server: RunningServer, body: bytes) -> socket.socket:
    """A raw connection that has sent a whole speech request and reads nothing: closing it is the client leaving."""
    host, port = server.http.removeprefix("http://").split(":")
    raw = socket.create_connection((host, int(port)))
    raw.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return raw


@pytest.mark.parametrize("response_format, stream", [("mp3", True), ("opus", True), ("pcm", True), ("wav", False),
                                                     ("mp3", False)])
def test_a_client_that_leaves_frees_the_engine_at_once(server, response_format, stream):
    """A client that sends its request and closes the connection before any audio: its engine request ends within a
    second, streamed or whole (left to run, this one takes many seconds on the CPU); a whole body is not made for
    nobody; either way the request is counted as 499 (client gone), not as the 200 nobody got."""
    body = json.dumps({"input": "word " * 78, "response_format": response_format, "stream": stream}).encode()
    gone = metric(server, "voxgate_http_speech_requests_total", status="499")
    handled = sum(v for (name, _), v in metric_samples(server)[1].items()
                  if name == "voxgate_http_speech_requests_total")
    with speech_sent(server, body):
        pass  # closed at once, before any audio
    wait_until(lambda: sum(v for (name, _), v in metric_samples(server)[1].items()
                           if name == "voxgate_http_speech_requests_total") != handled,  # the handler counted it
               time.monotonic() + 30, "the handler never took the request")
    wait_until(lambda: metric(server, "voxgate_engine_requests_active") == 0, time.monotonic() + 1.0,
               "the engine request outlived its client")
    assert metric(server, "voxgate_http_speech_requests_total", status="499") == gone + 1


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_a_streamed_request_waiting_for_a_slot_is_dropped_when_its_client_leaves(stream_format):
    """A hostile try: streamed requests sent and abandoned while the engine was busy stayed queued for its slots
    (260 of them: everyone else got `overloaded`), since a streamed response waits for its first audio before it
    sends anything. With one slot held by a long request, an abandoned streamed request leaves the queue at once."""
    with running_server(Limits(), max_batch=1) as one_slot:
        long = threading.Thread(target=post_raw, args=(one_slot, {"input": "word " * 78, "response_format": "pcm",
                                                                  "stream": False}))
        long.start()
        deadline = time.monotonic() + 30

        def active() -> float:
            return metric(one_slot, "voxgate_engine_requests_active")

        wait_until(lambda: active() >= 1, deadline, "the long request never took the slot")
        body = json.dumps({"input": "Hello there.", "response_format": "pcm", "stream": True,
                           "stream_format": stream_format}).encode()
        with speech_sent(one_slot, body):
            wait_until(lambda: active() >= 2, deadline, "the streamed request never waited for the slot")
        wait_until(lambda: active() <= 1, time.monotonic() + 1.0, "the abandoned request kept its place in the queue")
        assert long.is_alive()  # the slot was still held: the request left the queue, not a finished slot
        long.join(timeout=300)


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_a_streamed_request_counts_200_once_sent_and_499_when_its_client_left_mid_way(server, stream_format):
    """A streamed response's status is counted when its body ends: 200 read to the end, 499 (client gone) for a
    client that read the first bytes and left, although its 200 status line had gone out."""
    body = {"input": "word " * 60, "response_format": "pcm", "stream": True, "stream_format": stream_format}

    def counts() -> tuple[float, float]:
        return tuple(metric(server, "voxgate_http_speech_requests_total", status=s) for s in ("200", "499"))

    ok, gone = counts()
    status, _, payload = server.post("/v1/audio/speech", {**body, "input": "Hello there."})
    assert status == 200 and payload and counts() == (ok + 1, gone)
    request = urllib.request.Request(server.http + "/v1/audio/speech", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200 and response.read(64)
    deadline = time.monotonic() + 10
    while counts() != (ok + 1, gone + 1):
        assert time.monotonic() < deadline, counts()
        time.sleep(0.05)


def test_unknown_routes_and_methods_get_the_apis_json_errors(server):
    for path, method, status in (("/v1/nothing/here", "GET", 404), ("/v1/audio/speech", "GET", 405),
                                 ("/v1/audio/voices/a%2Fb", "GET", 404)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(server.http + path, method=method), timeout=30)
        assert refused.value.code == status
        error = json.loads(refused.value.read())["error"]
        assert error["code"] == "invalid_message" and error["type"] == "invalid_request_error", error
        assert "param" in error and error["param"] is None and method in error["message"], error  # OpenAI's shape
        if status == 405:
            assert "POST" in refused.value.headers["Allow"]


# --- hostile values of the format fields --------------------------------------------------------------------------

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3), max_leaves=6)
FORMAT_FIELDS = {
    "response_format": st.sampled_from([*HTTP_FORMATS, "ogg", "mp4", "WAV", "pcm ", "", "opus\u0000"]) | JSON_VALUES,
    "stream_format": st.sampled_from(["audio", "sse", "SSE", "chunks", ""]) | JSON_VALUES,
    "stream": st.booleans() | JSON_VALUES,
}


@st.composite
def format_bodies(draw) -> dict:
    body = {"input": "Hi.", "voice": "vivian"}
    for name, values in FORMAT_FIELDS.items():
        if draw(st.booleans()):
            body[name] = draw(values)
    return body


def post_raw(server: RunningServer, body: dict | bytes) -> tuple[int, dict[str, str], bytes]:
    status, headers, payload = server.post("/v1/audio/speech", body)
    return status, {k.lower(): v for k, v in headers.items()}, payload


@pytest.fixture(scope="module")
def bystander(server):
    """Another user's long stream, running while the hostile bodies arrive: (thread, its result)."""
    result: dict = {}

    def listen() -> None:
        result["status"], _, result["body"] = post_raw(server, {"input": LONG_TEXT * 3, "response_format": "pcm"})

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    return thread, result


def _infinite(value: object) -> bool:
    """An infinite float anywhere in a JSON value: json.dumps writes it as `Infinity`, which is not JSON."""
    if isinstance(value, float):
        return math.isinf(value)
    if isinstance(value, (list, dict)):
        return any(map(_infinite, value.values() if isinstance(value, dict) else value))
    return False


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=format_bodies())
@example(body={"input": "Hi.", "voice": "vivian", "stream_format": "Infinity"})  # a string: valid JSON, a bad value
def test_hostile_format_fields_get_a_valid_file_or_a_specific_error(server, bystander, body):
    wire = json.dumps(body)
    status, headers, payload = post_raw(server, wire.encode())
    if status != 200:
        error = json.loads(payload)["error"]
        codes = ("invalid_json",) if _infinite(body) else ("unsupported_format", "invalid_message")
        assert status == 400 and error["code"] in codes, (body, error)
        return
    response_format = body.get("response_format") or "wav"
    assert response_format in HTTP_FORMATS, body
    if body.get("stream_format") == "sse":
        events = [json.loads(line[6:]) for line in payload.decode().splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done", events[-1]
        payload = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
    else:
        assert headers["content-type"] == CONTENT_TYPES[response_format]
        assert ("content-length" in headers) is (body.get("stream") is False)
    assert payload.startswith(MAGIC.get(response_format, b"")) and decoded_length(payload, response_format) > 0


def test_the_bystander_stream_was_not_disturbed(server, bystander):
    """After the hostile bodies: the long stream ended whole, as long as the same request alone makes."""
    thread, result = bystander
    thread.join(timeout=300)
    status, _, alone = post_raw(server, {"input": LONG_TEXT * 3, "response_format": "pcm"})
    assert result["status"] == status == 200 and len(result["body"]) == len(alone) > 0


@pytest.mark.parametrize("response_format, stream, speed", [
    ("flac", False, 1.0), ("mp3", False, 1.0), ("mp3", True, 1.0), ("aac", True, 1.0), ("pcm", True, 0.5)])
def test_bodies_cut_short_free_their_codecs_at_once(server, response_format, stream, speed):
    """A request whose client leaves before its body is made (whole) or sent (streamed, after its first bytes)
    leaves no FFmpeg threads behind (the collector is off here, as it would be for a while on a busy server). Its
    codec, muxer and tempo filter sit in reference cycles until a collection: they ran a thread pool each, sized by
    the CPUs, and a streamed body kept two threads here until a full collection; now FFmpeg counts one CPU
    (realtime/audio/ffmpeg.py). What they hold until a collection is bounded in test_heap.py."""
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    fields = {"model": "tts-1", "voice": "vivian", "input": "Hello world. " * 20, "response_format": response_format,
              "stream": stream, "speed": speed}
    body = json.dumps(fields).encode()
    request = urllib.request.Request(server.http + "/v1/audio/speech", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as whole:  # one made to the end: the worker threads exist
        assert whole.status == 200 and whole.read()
    gc.collect()
    gc.disable()
    try:
        before = threads()
        for _ in range(4):
            if stream:
                with socket.create_connection(("127.0.0.1", int(server.http.rsplit(":", 1)[1]))) as client:
                    client.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                    assert client.recv(100)  # the status line and the first bytes, then it leaves
            else:
                with pytest.raises((TimeoutError, urllib.error.URLError)):
                    urllib.request.urlopen(request, timeout=0.5)
        deadline = time.monotonic() + 20
        while threads() > before + 1:
            assert time.monotonic() < deadline, (before, threads())
            time.sleep(0.1)
    finally:
        gc.enable()
