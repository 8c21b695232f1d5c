"""`POST /v1/audio/speech` as OpenAI's own SDK calls it, against a real server (the tiny model): `speed` (the duration
scales by 1 / speed, streamed or whole), OpenAI's voice names (the default mapping and `--openai-voice`) and the
SDK's `{"id": ...}` voice form, and OpenAI's model names, dated ones included; the new fields fuzzed at the parser."""
from __future__ import annotations

import asyncio
import base64
import json
import re
from types import SimpleNamespace

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tts import TTSModel
from realtime.cli import main
from realtime.errors import HTTPFailure
from realtime.gateway import Limits
from realtime.speech_http import client_owner, parse_speech_request, speech_body
from realtime.voices import OPENAI_VOICES, VoiceCatalog, parse_openai_voice
from realtime.ws.protocol import SessionConfig, configure
from tests.gateway_server import running_server

KEY = "k"
TEXT = "Hello there."
SEED = {"seed": 7}  # the same audio for the same body: durations and voices compare exactly
OPENAI_MODELS = ["tts-1", "tts-1-hd", "tts-1-1106", "tts-1-hd-1106", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15",
                 "gpt-4o-mini-tts-2025-03-20"]
OTHER_MODELS = ["whisper-1", "gpt-4o", "gpt-4o-mini-transcribe", "dall-e-3", "TTS-1", "tts-2",
                "Qwen/Qwen3-TTS-12Hz-0.6B-Base", "gpt-4o-mini-tts-latest"]


@pytest.fixture(scope="module")
def server():
    with running_server(Limits(api_keys=(KEY,)), openai_voices=(("alloy", "Ryan"),)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0, timeout=120)


def pcm(client: openai.OpenAI, voice: str | dict = "vivian", extra: dict | None = None, **fields) -> bytes:
    return client.audio.speech.create(model="gpt-4o-mini-tts-2025-12-15", voice=voice, input=TEXT,
                                      response_format="pcm", extra_body={**SEED, **(extra or {})}, **fields).content


# --- speed -------------------------------------------------------------------------------------------------------

def test_speed_half_doubles_the_duration_and_two_halves_it(client):
    normal = len(pcm(client)) // 2
    assert normal > 0
    for speed in (0.5, 2.0):
        samples = len(pcm(client, speed=speed)) // 2
        assert samples / normal == pytest.approx(1 / speed, rel=0.02), speed
        assert samples == round(normal / speed)  # what the time-stretch guarantees, exactly


def test_the_async_client_streams_the_same_audio_with_instructions_and_sse(server, client):
    """AsyncOpenAI, as LLM agent frameworks hold it: a streamed body equals the sync client's for the same seed,
    `instructions` are taken, and `stream_format="sse"` gives OpenAI's delta events whose audio is that body."""
    async def go() -> tuple[bytes, list[dict]]:
        async with openai.AsyncOpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0, timeout=120) as aio:
            async with aio.audio.speech.with_streaming_response.create(
                    model="gpt-4o-mini-tts", voice="vivian", input=TEXT, response_format="pcm",
                    instructions="Speak slowly.", extra_body=SEED) as response:
                body = b"".join([chunk async for chunk in response.iter_bytes()])
            async with aio.audio.speech.with_streaming_response.create(
                    model="gpt-4o-mini-tts", voice="vivian", input=TEXT, response_format="pcm",
                    instructions="Speak slowly.", stream_format="sse", extra_body=SEED) as response:
                lines = [line async for line in response.iter_lines()]
        return body, [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]

    body, events = asyncio.run(go())
    assert body and body == pcm(client, instructions="Speak slowly.")
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done" and set(events[-1]["usage"]) >= {"input_tokens", "output_tokens",
                                                                                       "total_tokens"}
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == body


def test_stretched_audio_streams_and_equals_the_whole_body(client):
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="vivian", input=TEXT, response_format="pcm", speed=0.5, extra_body=SEED) as response:
        assert response.headers["transfer-encoding"] == "chunked"
        streamed = b"".join(response.iter_bytes())
    whole = pcm(client, speed=0.5, extra={"stream": False})
    assert streamed == whole and len(whole) > 0


@pytest.mark.parametrize("speed", [0.2, 4.01, 0, -1, "fast", True, [1.0]])
def test_a_speed_outside_openais_range_is_refused(client, speed):
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.speech.create(model="tts-1", voice="vivian", input=TEXT, extra_body={"speed": speed})
    assert refused.value.code == "invalid_message" and "speed" in refused.value.message
    assert refused.value.param == "speed"  # the field at fault, as OpenAI's errors name it (hostile try 12)


# --- voices ------------------------------------------------------------------------------------------------------

def test_openai_voice_names_and_the_id_object_speak_with_the_mapped_voice(client, server):
    """alloy was mapped with --openai-voice alloy=Ryan; nova keeps the default mapping (sohee)."""
    mapping = json.loads(server.get("/v1/voices", KEY)[1])["openai_voices"]
    assert mapping["alloy"] == "ryan" and mapping["nova"] == OPENAI_VOICES["nova"] == "sohee"
    assert set(mapping) == set(OPENAI_VOICES)
    ryan, sohee = pcm(client, "ryan"), pcm(client, "sohee")
    assert ryan != sohee
    assert pcm(client, "alloy") == ryan and pcm(client, {"id": "alloy"}) == ryan
    assert pcm(client, {"id": "nova"}) == sohee and pcm(client, "Nova") == sohee


@pytest.mark.parametrize("voice, code", [("nobody", "unknown_voice"), ({"id": "nobody"}, "unknown_voice"),
                                         ({"id": 5}, "invalid_message"), ({"name": "alloy"}, "invalid_message"),
                                         (["alloy"], "invalid_message"), ("v" * 129, "invalid_message"),
                                         ("", "invalid_message"), ({"id": " "}, "invalid_message")])
def test_a_bad_voice_is_refused_by_name(client, voice, code):
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.speech.create(model="tts-1", voice=voice, input=TEXT)
    assert refused.value.code == code and "voice" in refused.value.message and refused.value.param == "voice"


@pytest.mark.parametrize("language", ["", " ", "klingon", "xx"])
def test_a_bad_language_is_a_bad_field_of_the_body(client, language):
    """`invalid_message`, as every other bad field of the body (it came back as the socket's `invalid_config`)."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, extra_body={"language": language})
    assert refused.value.code == "invalid_message" and "language" in refused.value.message.lower()
    assert refused.value.param == "language"  # hostile try 14: null


@pytest.mark.parametrize("field", ["input", "voice", "instructions", "language", "response_format"])
def test_a_lone_surrogate_names_its_field(server, field):
    """A string that is not valid Unicode (JSON can carry one; OpenAI's SDK cannot send it) is refused naming the
    body field it is in (`param`), as every other bad field."""
    body = json.dumps({"model": "tts-1", "voice": "vivian", "input": TEXT, field: "ok \ud800"})
    response = httpx.post(server.http + "/v1/audio/speech", content=body,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "invalid_message", error
    assert "lone surrogate" in error["message"] and error["param"] == field, error


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain; charset=utf-8"])
def test_the_body_is_json_whatever_its_content_type(server, content_type):
    """`curl -d '{...}'` sends a form's Content-Type: the body is still the request (docs/protocol.md "HTTP")."""
    headers = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": content_type} if content_type else {})
    body = json.dumps({"input": TEXT, "response_format": "pcm", **SEED})
    response = httpx.post(server.http + "/v1/audio/speech", content=body, headers=headers, timeout=120)
    assert response.status_code == 200 and len(response.content) > 0, response.text
    refused = httpx.post(server.http + "/v1/audio/speech", content=b"input=Hello", headers=headers)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_json", refused.text


@pytest.mark.parametrize("field", ["input", "voice", "model"])
def test_a_field_given_twice_is_refused_by_name(server, field):
    """A body that gives a key twice means what its reader picks (a proxy may read the first, Python the last)."""
    body = f'{{"model": "tts-1", "voice": "vivian", "input": "{TEXT}", "{field}": "tts-1-hd"}}'
    response = httpx.post(server.http + "/v1/audio/speech", content=body,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "invalid_message", error
    assert "given twice" in error["message"] and error["param"] == field, error


def test_every_openai_voice_maps_onto_a_voice_the_model_has(server, tiny_checkpoints):
    tts = server.gateway.tts
    catalog = VoiceCatalog(tts)
    assert catalog.openai_voices == OPENAI_VOICES  # the tiny model has the official speakers
    design = VoiceCatalog(TTSModel.load(tiny_checkpoints["voice_design"]))
    assert set(design.describe()["openai_voices"].values()) == {"design"}  # no speakers: the model's one voice
    with pytest.raises(ValueError, match="unknown voice 'nobody'"):
        VoiceCatalog(tts, openai_voices=(("echo", "nobody"),))


@pytest.mark.parametrize("spec, problem", [("alloy", "NAME=VOICE"), ("alloy=", "NAME=VOICE"),
                                           ("robot=vivian", "not an OpenAI voice name")])
def test_the_openai_voice_option_is_checked_before_the_model_loads(spec, problem, capsys):
    with pytest.raises(ValueError, match=problem):
        parse_openai_voice(spec)
    assert main(["serve", "--openai-voice", spec]) == 2
    assert problem in capsys.readouterr().err
    assert parse_openai_voice(" Shimmer = serena ") == ("shimmer", "serena")


# --- models ------------------------------------------------------------------------------------------------------

def test_openai_model_names_are_taken_and_other_models_refused(client):
    assert len(pcm(client)) > 0  # a dated name, through the server
    for model in OTHER_MODELS:
        with pytest.raises(openai.BadRequestError) as refused:
            client.audio.speech.create(model=model, voice="vivian", input=TEXT)
        assert refused.value.code == "invalid_message" and "gpt-4o-mini-tts" in refused.value.message, model


# --- the parser, fuzzed ------------------------------------------------------------------------------------------

GATEWAY = SimpleNamespace(limits=Limits(), model_name="tiny", model_names=("tiny",))
NUMBERS = st.integers(-10**18, 10**18) | st.floats(allow_nan=False, allow_infinity=False)
JSON_VALUES = st.recursive(st.none() | st.booleans() | NUMBERS | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=6)


def parsed(**fields) -> object:
    """The parsed request, or the HTTPFailure it raised."""
    try:
        return parse_speech_request(speech_body(json.dumps({"input": "Hi.", **fields}).encode()), GATEWAY)
    except HTTPFailure as failure:
        return failure


@settings(max_examples=300, deadline=None)
@given(speed=NUMBERS | st.floats(0.25, 4.0) | JSON_VALUES)
def test_speed_is_a_number_from_a_quarter_to_four(speed):
    result = parsed(speed=speed)
    if speed is None:  # as if absent
        assert result.speed == 1.0
    elif not isinstance(speed, bool) and isinstance(speed, (int, float)) and 0.25 <= speed <= 4.0:
        assert result.speed == speed
    else:
        assert (result.status, result.code) == (400, "invalid_message") and "speed" in result.message


@settings(max_examples=300, deadline=None)
@given(voice=st.text(max_size=140) | st.fixed_dictionaries({"id": st.text(max_size=140)}) | JSON_VALUES)
def test_voice_is_a_string_or_an_id_object(voice):
    result = parsed(voice=voice)
    name = voice.get("id") if isinstance(voice, dict) else voice
    if voice is None:
        assert result.voice is None
    elif isinstance(name, str) and len(name) <= 128 and name.strip():
        assert result.voice == name
    else:  # a blank name too: a mistake, as on the socket, not the default
        assert (result.status, result.code) == (400, "invalid_message") and "voice" in result.message


@settings(max_examples=300, deadline=None)
@given(model=st.sampled_from(OPENAI_MODELS + OTHER_MODELS + ["tiny"]) | st.text(max_size=40)
       | st.from_regex(r"gpt-4o(-mini)?-tts-20[0-9]{2}-[01][0-9]-[0-3][0-9]", fullmatch=True))
def test_model_is_the_served_one_or_an_openai_speech_model(model):
    result = parsed(model=model)
    dated = model.startswith("gpt-4o") and model[-10:-6] == "-20"
    if isinstance(result, HTTPFailure):
        assert (result.status, result.code) == (400, "invalid_message") and "unknown model" in result.message
        assert model not in (*OPENAI_MODELS, "tiny") and not dated
    else:
        assert model in (*OPENAI_MODELS, "tiny") or dated or model.startswith(("tts-1", "gpt-")) and "tts" in model
        assert model not in OTHER_MODELS


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(-5, 2**64) | st.floats(-5.0, 2.0**64) | st.sampled_from([-0.0, 1.0, 7.5, 2.0**63])
       | JSON_VALUES)
def test_a_seed_means_the_same_over_http_as_on_the_socket(seed):
    """One rule for both doors: an integer from 0 to 2**63 - 1, also written as an integral float (`42.0`)."""
    result = parsed(seed=seed)
    config, refused = configure(SessionConfig(), {"sampling": {"seed": seed}})
    if refused:
        assert (result.status, result.code) == (400, "invalid_message") and "seed" in result.message
        assert [error.code for error in refused] == ["invalid_config"]
    else:
        assert result.seed == config.sampling.seed == seed  # None: as if absent
        assert seed is None or isinstance(result.seed, int)


@settings(max_examples=100, deadline=None)
@given(field=st.sampled_from(["seed", "speed", "voice", "model", "input", "temperature"]),
       digits=st.integers(21, 400), sign=st.sampled_from(["", "-"]))
def test_an_integer_too_long_for_any_field_is_refused_naming_its_field(field, digits, sign):
    """Refused while parsing (int() is quadratic in the digits), yet `param` still names the field it was given as,
    as for any other bad value (a hostile try: a seed of 2**70 came back with `param: null`)."""
    others = {name: value for name, value in {"input": "Hi.", "voice": "ryan"}.items() if name != field}  # once each
    body = json.dumps(others).replace("{", f'{{"{field}": {sign}{"7" * digits}, ', 1)
    with pytest.raises(HTTPFailure) as refused:
        parse_speech_request(speech_body(body.encode()), GATEWAY)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "invalid_message", field)
    assert f"of {digits} digits" in refused.value.message


def test_openai_sdk_lists_the_served_model_by_every_name_a_request_may_use(server, client):
    """`client.models.list()` (GET /v1/models, OpenAI's shape): the served model by its names, each of which a speech
    request takes; behind the API key like the other routes."""
    listed = client.models.list()
    names = [model.id for model in listed.data]
    assert names == list(server.gateway.model_names) and names
    assert all(model.object == "model" and model.owned_by == "voxgate" and model.created > 0 for model in listed.data)
    for name in names:
        assert client.audio.speech.create(model=name, voice="vivian", input=TEXT, response_format="pcm",
                                          extra_body=SEED).content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.http + "/v1", api_key="wrong", max_retries=0).models.list()


@given(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=64),
       st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=64))
def test_a_speech_requests_owner_is_its_key_or_its_address(key, other):
    """Clients take turns for the engine's slots (docs/protocol.md): an HTTP request speaks for its API key, never
    carried in the clear past the gateway, and on an open gateway for its peer address."""
    owner = client_owner(key, "10.0.0.1")
    assert re.fullmatch(r"key:[0-9a-f]{16}", owner)  # a digest of it, whatever the key
    assert owner == client_owner(key, "10.0.0.2")  # the key, wherever it comes from
    assert (owner == client_owner(other, "10.0.0.1")) == (key == other)
    assert client_owner(None, "10.0.0.1") == "address:10.0.0.1" != client_owner(None, "10.0.0.2")
    assert client_owner(None, None) is None
