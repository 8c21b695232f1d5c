"""`POST /v1/audio/speech` takes what tools written for the official Qwen3-TTS server send (nari-labs' tts_bench and
others): the model's hub id, `stream`, `non_streaming_mode`. The server runs as a process of its own, serving a hub
id found in an offline hub cache (which holds the embedded tiny model), and is spoken to with a real HTTP client."""
from __future__ import annotations

import http.client
import json
import shutil
import time
from types import SimpleNamespace

import pytest

from engine.config import parse_model_config, parse_speech_tokenizer_config
from engine.model_source import official_hub_id
from engine.synthetic.checkpoints import default_model_dir
from engine.synthetic.configs import model_config, speech_tokenizer_config
from realtime.errors import HTTPFailure
from realtime.gateway import Limits
from realtime.speech_http import parse_speech_request, speech_body
from tests.server_process import ServerProcess, server_process

HUB_ID = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
TEXT = "Hello there, this is a longer sentence so that synthesis takes a while."


# --- the hub id of a checkpoint directory ------------------------------------------------------------------------

@pytest.mark.parametrize("size, variant, hub_id", [
    ("1b7", "custom_voice", "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"), ("1b7", "base", "Qwen/Qwen3-TTS-12Hz-1.7B-Base"),
    ("1b7", "voice_design", "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign"), ("0b6", "base", "Qwen/Qwen3-TTS-12Hz-0.6B-Base"),
    ("0b6", "custom_voice", "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"),
    ("0b6", "voice_design", None),  # never released
    ("tiny", "custom_voice", None),  # its config says 1b7, its dimensions do not
])
def test_official_configs_have_their_hub_id_and_test_models_none(size, variant, hub_id):
    config = parse_model_config(model_config(size, variant))
    assert official_hub_id(config, parse_speech_tokenizer_config(speech_tokenizer_config(size))) == hub_id


# --- the request the handler builds ------------------------------------------------------------------------------

GATEWAY = SimpleNamespace(limits=Limits(), model_name="Qwen3-TTS-12Hz-1.7B-CustomVoice",
                          model_names=("Qwen3-TTS-12Hz-1.7B-CustomVoice", HUB_ID))


def parse(**body):
    return parse_speech_request(speech_body(json.dumps({"input": "Hi.", **body}).encode()), GATEWAY)


@pytest.mark.parametrize("body, layout", [({}, "streaming"), ({"non_streaming_mode": True}, "prefill"),
                                          ({"non_streaming_mode": False}, "streaming")])
def test_non_streaming_mode_picks_the_text_layout(body, layout):
    assert parse(**body).layout == layout


@pytest.mark.parametrize("body, stream", [
    ({"response_format": "pcm"}, True), ({"response_format": "wav"}, True), ({"response_format": "aac"}, True),
    ({"response_format": "opus", "stream": True}, True), ({"response_format": "mp3", "stream_format": "sse"}, True),
    ({"response_format": "pcm", "stream": True}, True), ({"response_format": "pcm", "stream": False}, False),
    ({"response_format": "flac", "stream": False}, False),
    ({"response_format": "pcm", "stream_format": "sse", "stream": True}, True),
])
def test_stream_says_whether_the_audio_goes_out_as_it_is_made(body, stream):
    assert parse(**body).stream is stream


@pytest.mark.parametrize("body, code, named", [
    ({"stream": "true"}, "invalid_message", "stream"), ({"stream": 1}, "invalid_message", "stream"),
    ({"non_streaming_mode": "false"}, "invalid_message", "non_streaming_mode"),
    ({"non_streaming_mode": 0}, "invalid_message", "non_streaming_mode"),
    ({"stream": False, "response_format": "pcm", "stream_format": "sse"}, "invalid_message", "sse"),
    ({"response_format": "ogg"}, "unsupported_format", "aac"),
    ({"model": "Qwen/Qwen3-TTS-12Hz-0.6B-Base"}, "invalid_message", HUB_ID),
])
def test_bad_values_are_refused_naming_the_field(body, code, named):
    with pytest.raises(HTTPFailure) as refused:
        parse(**body)
    assert refused.value.status == 400 and refused.value.code == code and named in refused.value.message


# --- a real server on a hub id -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    """`voxgate serve --model Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice`, found (offline) in a hub cache that holds the
    tiny model under that id."""
    cache = tmp_path_factory.mktemp("hub")
    repo, commit = cache / ("models--" + HUB_ID.replace("/", "--")), "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(default_model_dir(), repo / "snapshots" / commit)
    with server_process(["--model", HUB_ID], cache / "server.log",
                        env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}) as running:
        yield running


def post(server: ServerProcess, body: dict | bytes) -> tuple[int, dict[str, str], list[tuple[float, bytes]]]:
    """Status, headers and the body as it arrived: (seconds since the request went out, bytes) per read."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        sent = time.monotonic()
        connection.request("POST", "/v1/audio/speech", body if isinstance(body, bytes) else json.dumps(body),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        pieces = []
        while piece := response.read1(65536):
            pieces.append((time.monotonic() - sent, piece))
        return response.status, {k.lower(): v for k, v in response.getheaders()}, pieces
    finally:
        connection.close()


def audio(pieces: list[tuple[float, bytes]]) -> bytes:
    return b"".join(piece for _, piece in pieces)


def error_of(pieces: list[tuple[float, bytes]]) -> dict:
    return json.loads(audio(pieces))["error"]


def test_the_hub_id_is_accepted_and_served(server):
    for model in (HUB_ID, "Qwen3-TTS-12Hz-1.7B-CustomVoice", "tts-1"):
        status, headers, pieces = post(server, {"model": model, "input": "Hello.", "voice": "vivian",
                                                "response_format": "pcm", "stream": True})
        assert status == 200 and headers["content-type"] == "audio/pcm" and len(audio(pieces)) > 0, model


def test_an_unknown_model_is_refused_naming_what_is_accepted(server):
    status, _, pieces = post(server, {"model": "Qwen/Qwen3-TTS-12Hz-0.6B-Base", "input": "Hello."})
    error = error_of(pieces)
    assert status == 400 and error["code"] == "invalid_message"
    assert HUB_ID in error["message"] and "tts-1" in error["message"]


def test_stream_true_streams_pcm_and_false_sends_the_same_audio_whole(server):
    body = {"model": HUB_ID, "input": TEXT, "voice": "vivian", "response_format": "pcm", "seed": 7}
    status, headers, streamed = post(server, {**body, "stream": True})
    assert status == 200 and headers.get("transfer-encoding") == "chunked" and "content-length" not in headers
    assert len(streamed) > 1 and streamed[0][0] < streamed[-1][0], "the audio came in one piece, not as made"
    status, headers, whole = post(server, {**body, "stream": False})
    assert status == 200 and int(headers["content-length"]) == len(audio(whole))
    assert headers["x-sample-rate"] == "24000" and "transfer-encoding" not in headers
    assert len(audio(streamed)) == len(audio(whole)) > 0 and len(audio(whole)) % (2 * 1920) == 0
    status, headers, wav = post(server, {**body, "response_format": "wav", "stream": False})
    assert status == 200 and audio(wav)[:4] == b"RIFF"


def test_non_streaming_mode_true_and_false_both_speak_in_their_own_layout(server):
    body = {"model": HUB_ID, "input": TEXT, "voice": "vivian", "response_format": "pcm", "stream": False, "seed": 3}
    spoken = {mode: post(server, {**body, "non_streaming_mode": mode} if mode is not None else body)
              for mode in (True, False, None)}
    assert all(status == 200 and len(audio(pieces)) > 0 for status, _, pieces in spoken.values())
    prefill, streaming, default = (audio(spoken[mode][2]) for mode in (True, False, None))
    assert streaming == default, "absent non_streaming_mode keeps the streaming layout"
    assert prefill != streaming, "the same seed gave the same audio in both layouts"


@pytest.mark.parametrize("body, code, named", [
    ({"stream": "yes"}, "invalid_message", "stream"), ({"stream": None, "non_streaming_mode": "no"},
                                                        "invalid_message", "non_streaming_mode"),
    ({"stream": [True]}, "invalid_message", "stream"),
])
def test_bad_types_are_refused_with_400(server, body, code, named):
    status, _, pieces = post(server, {"model": HUB_ID, "input": "Hello.", **body})
    error = error_of(pieces)
    assert status == 400 and error["code"] == code and named in error["message"]


@pytest.mark.parametrize("text, code, words", [("", "empty_text", "input is empty"),
                                               ("  ...  ", "empty_text", "no letter or digit"),
                                               (None, "invalid_message", "input is required"),
                                               (7, "invalid_message", "input must be a string")])
def test_a_missing_or_empty_input_says_which(text, code, words):
    body = {} if text is None else {"input": text}
    with pytest.raises(HTTPFailure) as failure:
        parse_speech_request(speech_body(json.dumps(body).encode()), GATEWAY)
    assert failure.value.code == code and words in failure.value.message, failure.value.message
