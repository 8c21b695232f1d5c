"""The voice library (`/v1/audio/voices`) against real servers (uvicorn, tiny random checkpoints on the CPU, a real
HTTP client and the voxgate.v1 client): upload, list, use from the socket and the speech endpoint, restart on the same
data directory, delete, every bad upload, hostile fields, API keys."""
from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import shutil
import socket
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from engine.checkpoint import checkpoint_fingerprint
from realtime import voice_library
from realtime.errors import VOICE_LIBRARY_STATUS, HTTPFailure
from realtime.gateway import Limits
from realtime.voice_library import MAX_AUDIO_SECONDS, MIN_AUDIO_SECONDS
from realtime.voice_store import StoredVoice, VoiceStore, check_data_dir, tensor_bytes, tensor_from_bytes
from tests.gateway_server import running_server
from voxgate_client.client import VoxgateClient

RATE = 24000
TRANSCRIPT = "Hello there, this is my voice."


def wav(seconds: float = 2.0, amplitude: float = 0.3, rate: int = RATE, fmt: str = "WAV") -> bytes:
    """A voiced-like test clip: a harmonic tone with a slow tremolo."""
    t = np.arange(int(seconds * rate)) / rate
    tone = amplitude * np.sin(2 * np.pi * 180 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    out = io.BytesIO()
    sf.write(out, tone.astype(np.float32), rate, format=fmt)
    return out.getvalue()


# a well-formed form (boundary "x"): a name and an audio file
FORM_BODY = (b'--x\r\nContent-Disposition: form-data; name="name"\r\n\r\ncaf\xc3\xa9\r\n--x\r\nContent-Disposition: '
             b'form-data; name="audio"; filename="r.wav"\r\nContent-Type: audio/wav\r\n\r\nRIFF\r\n--x--\r\n')


def upload(server, name: str | None, audio: bytes | None = None, token: str | None = None, **fields: str):
    data = {k: v for k, v in {"name": name, **fields}.items() if v is not None}
    files = {"audio": ("reference.wav", audio, "audio/wav")} if audio is not None else None
    if files is None:  # still a multipart body, as a form without a file
        files = {"unused": ("", b"", "application/octet-stream")}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(server.http + "/v1/audio/voices", data=data, files=files, headers=headers, timeout=120)


def error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "type", "param"}, body  # OpenAI's
    assert VOICE_LIBRARY_STATUS.get(body["error"]["code"], response.status_code) == response.status_code, body
    return body["error"]["code"]


def speech(server, voice: str, seed: int = 7, **fields) -> tuple[int, bytes]:
    status, _, body = server.post("/v1/audio/speech", {"input": "Stored voices speak.", "voice": voice,
                                                       "response_format": "pcm", "seed": seed, **fields})
    return status, body


async def speak_ws(server, voice: str):
    """A context spoken in a session whose voice is `voice`."""
    async with VoxgateClient.connect(server.ws, preset="pcm", voice=voice) as client:
        assert client.session["voice"] == voice
        return await client.speak("c1", ["Stored ", "voices speak."])


async def first_append_error(client: VoxgateClient, voice: str | None) -> str:
    """The error code a context's first append with `voice` (None: the session's) gets."""
    await client.append("refused", "Anyone there?", voice=voice)
    async for message in client.events():
        if isinstance(message, dict) and message["type"] in ("error", "context.started"):
            assert message.get("context_id") == "refused", message
            return message.get("code", message["type"])
    raise AssertionError("the socket closed")


async def designed_session_names_stored(server) -> str:
    """In a session whose instructions design its voice, a context naming a stored voice speaks that voice (the
    session's instructions are not its); one that names instructions of its own for it is refused."""
    async with VoxgateClient.connect(server.ws, preset="pcm") as client:
        await client.start(instructions="A bright, quick voice.")
        await client.append("stored", "Stored voices speak.", voice="narrator")
        await client.end("stored")
        seen = []
        async for message in client.events():
            seen.append(message if isinstance(message, dict) else "audio")
            if isinstance(message, dict) and message["type"] in ("context.done", "error"):
                break
        assert seen[-1]["type"] == "context.done" and "audio" in seen, seen
        await client.append("own", "Anyone there?", voice="narrator", instructions="Another voice.")
        async for message in client.events():
            if isinstance(message, dict) and message.get("context_id") == "own":
                return message.get("code", message["type"])
    raise AssertionError("the socket closed")


async def session_instructions(server, instructions: str = "An angry voice.", **query: str
                               ) -> tuple[list[str], str, bool]:
    """A session.start that gives `instructions` (`query` in the URL): the codes of the session's errors, the voice
    its next context speaks with and whether that context finished."""
    async with VoxgateClient.connect(server.ws, preset="pcm", **query) as client:
        await client.start(instructions=instructions)
        spoken = await client.speak("c1", ["Stored voices speak."])
        codes, events = [], client.events()
        while True:  # the session's own events (a context's go to `speak`)
            try:
                message = await asyncio.wait_for(anext(events), 0.5)
            except asyncio.TimeoutError:
                break
            if isinstance(message, dict) and message["type"] == "error":
                codes.append(message["code"])
        voice = next(e for e in spoken.events if e["type"] == "context.started")["voice"]
        return codes, voice, spoken.done is not None


async def refused_voice(server, voice: str) -> str:
    async with VoxgateClient.connect(server.ws, preset="pcm") as client:
        return await first_append_error(client, voice)


@pytest.fixture(scope="module")
def base_model(tiny_checkpoints) -> Path:
    return tiny_checkpoints["base"]


def test_a_store_removed_under_the_server_gets_the_apis_json_500_and_the_server_goes_on(base_model, tmp_path):
    """A hostile try: the operator deleted the data directory's files while the server ran; the next upload failed
    inside the store (sqlite: a readonly database) and the client got starlette's plain-text 500 and a reset. Any
    fault of the server's own is the API's JSON error (`internal`, OpenAI's shape); the server goes on serving."""
    data_dir = tmp_path / "data"
    with running_server(model=base_model, data_dir=data_dir) as server:
        assert upload(server, "alice", wav()).status_code == 201
        for path in data_dir.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        failed = upload(server, "bob", wav())
        assert failed.status_code == 500 and failed.headers["content-type"] == "application/json"
        assert failed.json() == {"error": {"code": "internal", "message": "internal server error",
                                           "type": "server_error", "param": None}}
        assert server.get("/health")[0] == 200 and speech(server, "alice")[0] == 200


def test_upload_use_restart_delete(base_model, tmp_path, one_thread):
    """A voice uploaded once is listed, speaks from HTTP and the socket, survives a restart without being encoded
    again (the same audio for the same seed, and the encoders never load), and is gone after its delete."""
    data_dir = tmp_path / "data"
    with running_server(model=base_model, data_dir=data_dir) as server:
        created = upload(server, "alice", wav(), transcript=TRANSCRIPT)
        assert created.status_code == 201 and created.headers["location"] == "/v1/audio/voices/alice"
        assert created.json() | {"created_at": 0} == {"id": "alice", "kind": "clone", "mode": "icl",
                                                      "transcript": TRANSCRIPT, "audio_seconds": 2.0, "created_at": 0}
        assert upload(server, "bob", wav(1.5)).json()["mode"] == "x_vector"  # no transcript: the x-vector alone
        listed = json.loads(server.get("/v1/audio/voices")[1])["voices"]
        assert [voice["id"] for voice in listed] == ["alice", "bob"]
        assert json.loads(server.get("/v1/audio/voices/alice")[1]) == listed[0]
        catalog = json.loads(server.get("/v1/voices")[1])
        assert [(v["id"], v["stored"], v["kind"]) for v in catalog["voices"]] == [("alice", True, "clone"),
                                                                                   ("bob", True, "clone")]
        assert catalog["default"] == "alice"
        before = {voice: speech(server, voice) for voice in ("alice", "bob")}
        assert all(status == 200 and len(audio) > 0 for status, audio in before.values())
        assert before["alice"][1] != before["bob"][1]
        result = asyncio.run(speak_ws(server, "bob"))
        assert result.done is not None and result.done["audio_ms"] > 0, result.events
    with running_server(model=base_model, data_dir=data_dir) as server:
        assert [v["id"] for v in json.loads(server.get("/v1/audio/voices")[1])["voices"]] == ["alice", "bob"]
        assert {voice: speech(server, voice) for voice in ("alice", "bob")} == before
        assert server.gateway.tts._speaker_encoder is None and server.gateway.tts._reference_encoder is None
        result = asyncio.run(speak_ws(server, "alice"))
        assert result.done is not None and result.done["audio_ms"] > 0, result.events
        deleted = httpx.delete(server.http + "/v1/audio/voices/alice")
        assert deleted.status_code == 200 and deleted.json() == {"id": "alice", "deleted": True}
        assert server.get("/v1/audio/voices/alice")[0] == 404
        assert speech(server, "alice")[0] == 400
        assert asyncio.run(refused_voice(server, "alice")) == "unknown_voice"
    with running_server(model=base_model, data_dir=data_dir) as server:
        assert [v["id"] for v in json.loads(server.get("/v1/audio/voices")[1])["voices"]] == ["bob"]
        assert httpx.delete(server.http + "/v1/audio/voices/bob").status_code == 200
        status, body = speech(server, "bob")  # no voice left: the error says how to make one, not "lists them ()"
        refused = json.loads(body)["error"]
        assert status == 400 and refused["code"] == "unknown_voice" and "POST /v1/audio/voices" in refused["message"]


def test_a_voice_an_openai_name_maps_to_is_not_deleted(base_model, tmp_path, one_thread):
    """Deleting the stored voice `--openai-voice alloy=alice` names left `alloy` speaking no voice, and the server's
    next start with the same flags failed (a crash loop under a supervisor): 409 `voice_in_use`, the voice kept."""
    data_dir = tmp_path / "data"
    with running_server(model=base_model, data_dir=data_dir) as server:
        assert upload(server, "alice", wav()).status_code == 201
        assert upload(server, "bob", wav(1.5)).status_code == 201
    with running_server(model=base_model, data_dir=data_dir, openai_voices=(("alloy", "alice"),)) as server:
        refused = httpx.delete(server.http + "/v1/audio/voices/alice")
        assert refused.status_code == 409 and error_code(refused) == "voice_in_use", refused.text
        assert "alloy" in refused.json()["error"]["message"]
        assert speech(server, "alloy")[0] == 200 and server.get("/v1/audio/voices/alice")[0] == 200
        assert httpx.delete(server.http + "/v1/audio/voices/bob").status_code == 200  # one nothing maps to
    with running_server(model=base_model, data_dir=data_dir, openai_voices=(("alloy", "alice"),)) as server:
        assert speech(server, "alloy")[0] == 200


def test_voices_belong_to_their_checkpoint(base_model, tmp_path, one_thread):
    """Another checkpoint (here: other random weights of the same size) on the same data directory sees none of the
    first one's voices, and may store its own under the same name."""
    from engine.synthetic.checkpoints import write_random_checkpoint

    other = write_random_checkpoint(tmp_path / "other", "tiny", "base", seed=2)
    assert checkpoint_fingerprint(other) != checkpoint_fingerprint(base_model)
    assert checkpoint_fingerprint(base_model) == checkpoint_fingerprint(base_model)
    data_dir = tmp_path / "data"
    with running_server(model=base_model, data_dir=data_dir) as server:
        assert upload(server, "alice", wav()).status_code == 201
    with running_server(model=other, data_dir=data_dir) as server:
        assert json.loads(server.get("/v1/audio/voices")[1]) == {"voices": []}
        assert speech(server, "alice")[0] == 400
        assert upload(server, "alice", wav()).status_code == 201


def test_deleting_a_voice_a_context_speaks_with(base_model, tmp_path, one_thread):
    """The context keeps its voice to the end, new utterances included; new contexts no longer find it."""
    with running_server(model=base_model) as server:
        assert upload(server, "carol", wav(), transcript=TRANSCRIPT).status_code == 201

        async def pieces():
            yield "First sentence."
            deleted = await asyncio.to_thread(httpx.delete, server.http + "/v1/audio/voices/carol")
            assert deleted.status_code == 200
            yield "Second sentence, after the delete."

        async def run():
            async with VoxgateClient.connect(server.ws, preset="pcm", voice="carol") as client:
                kept = await client.speak("c1", pieces(), flush=True)
                return kept, await first_append_error(client, "carol")

        kept, refused = asyncio.run(run())
        assert kept.done is not None and not kept.errors, kept.events
        assert [e["flush_id"] for e in kept.events if e["type"] == "context.flushed"] == [1, 2]
        assert kept.done["audio_ms"] > 0 and refused == "unknown_voice"


def test_a_session_keeps_the_default_voice_it_was_told(base_model, tmp_path, one_thread):
    """A session that names no voice speaks the default its `session.started` named (a Base model's oldest stored
    voice). Deleted, it refuses the session's next context (`unknown_voice`): it did move to the next stored voice,
    another speaker, unsaid. A new session gets the new default."""
    with running_server(model=base_model, data_dir=tmp_path / "data") as server:
        for name in ("carol", "dave"):
            assert upload(server, name, wav(), transcript=TRANSCRIPT).status_code == 201

        async def run() -> tuple[str, str, str]:
            async with VoxgateClient.connect(server.ws, preset="pcm") as client:
                told = client.session["voice"]
                assert httpx.delete(server.http + "/v1/audio/voices/carol").status_code == 200
                refused = await first_append_error(client, None)
            async with VoxgateClient.connect(server.ws, preset="pcm") as client:
                return told, refused, client.session["voice"]

        assert asyncio.run(run()) == ("carol", "unknown_voice", "dave")


@pytest.mark.parametrize("data, says, hint", [
    (b"\xff\xfb\x90\x00" + bytes(range(256)) * 16, "none of the decoders can read it", True),  # an MP3 frame, then junk
    (b"not audio at all " * 100, "Format not recognised", True),
    (wav(2, rate=1), "a sample rate of 1 Hz", False),
    (wav(2, rate=400_000), "a sample rate of 400000 Hz", False),
])
def test_an_unusable_upload_is_told_why(data, says, hint):
    """A hostile try's find: a corrupt MP3 was told "File does not exist or is not a regular file (possibly a
    pipe?)", libsndfile's words for a stream none of its decoders starts on; and audio refused for its rate (read
    fine) was told to upload WAV, FLAC, OGG or MP3 all the same. The format hint is for data that did not decode."""
    with pytest.raises(HTTPFailure) as refused:
        voice_library.reference_audio(data)
    failure = refused.value
    assert (failure.status, failure.code, failure.param) == (400, "invalid_audio", "audio")
    assert says in failure.message and "pipe" not in failure.message
    assert ("upload WAV, FLAC, OGG or MP3" in failure.message) == hint


def test_bad_uploads_get_specific_errors(base_model, tmp_path, one_thread):
    limits = Limits(max_voice_upload_bytes=400_000, max_stored_voices=2)
    with running_server(limits, model=base_model, data_dir=tmp_path / "data") as server:
        assert upload(server, "taken", wav()).status_code == 201
        cases = {
            "too short": (upload(server, "a", wav(MIN_AUDIO_SECONDS - 0.1)), 400, "audio_too_short"),
            "too long": (upload(server, "a", wav(MAX_AUDIO_SECONDS + 1, rate=8000, fmt="FLAC")), 400,
                         "audio_too_long"),
            "a rate no voice has": (upload(server, "a", wav(2, rate=1)), 400, "invalid_audio"),  # was too long
            "silent": (upload(server, "a", wav(amplitude=0.0)), 400, "audio_silent"),
            "nearly silent": (upload(server, "a", wav(amplitude=0.002)), 400, "audio_silent"),
            "not audio": (upload(server, "a", b"RIFF, but not really a WAV file" * 20), 400, "invalid_audio"),
            "text, not audio": (upload(server, "a", "a transcript".encode() * 100), 400, "invalid_audio"),
            "over the size limit": (upload(server, "a", b"\0" * 500_000), 413, "upload_too_large"),
            "name taken": (upload(server, "taken", wav()), 409, "voice_exists"),
            "odd name": (upload(server, "../etc/passwd", wav()), 400, "invalid_message"),
            "name with a space": (upload(server, "my voice", wav()), 400, "invalid_message"),
            "name too long": (upload(server, "n" * 65, wav()), 400, "invalid_message"),
            "no name": (upload(server, None, wav()), 400, "invalid_message"),
            "no audio": (upload(server, "a", transcript=TRANSCRIPT), 400, "invalid_message"),
            "an instruction": (upload(server, "a", wav(), instruction="warm voice"), 400, "invalid_message"),
            "transcript too long": (upload(server, "a", wav(), transcript="x" * 2001), 400, "text_too_long"),
            "audio as a text field": (httpx.post(server.http + "/v1/audio/voices", data={"name": "a", "audio": "x"},
                                                 files={"f": ("", b"")}), 400, "invalid_message"),
            "two names": (httpx.post(server.http + "/v1/audio/voices", data={"name": ["a", "b"]},
                                     files={"audio": ("r.wav", wav())}), 400, "invalid_message"),
            "two files": (httpx.post(server.http + "/v1/audio/voices", data={"name": "a"},
                                     files=[("audio", ("r.wav", wav())), ("audio", ("s.wav", wav()))]),
                          400, "invalid_message"),
            "not multipart": (httpx.post(server.http + "/v1/audio/voices", json={"name": "a"}), 400,
                              "invalid_message"),
            "malformed multipart": (httpx.post(server.http + "/v1/audio/voices", content=b"--x\r\nnonsense",
                                               headers={"Content-Type": "multipart/form-data; boundary=x"}),
                                    400, "invalid_message"),
            # a media type that only starts like it was taken (a hostile try)
            "not quite multipart": (httpx.post(server.http + "/v1/audio/voices", content=FORM_BODY,
                                               headers={"Content-Type": "multipart/form-data-not-really; "
                                                                        "boundary=x"}), 400, "invalid_message"),
            # delimiters the parser takes byte by byte on the event loop (a hostile try: 1.7 s for 16 MiB)
            "near-boundaries": (httpx.post(server.http + "/v1/audio/voices", content=b"--x\r\n" + b"\r\n--xy" * 5000,
                                           headers={"Content-Type": "multipart/form-data; boundary=x"}),
                                400, "invalid_message"),
            # fields were decoded in the charset given, silently: a transcript stored as other text (a hostile try)
            "a charset other than UTF-8": (httpx.post(server.http + "/v1/audio/voices", content=FORM_BODY,
                                                      headers={"Content-Type": "multipart/form-data; boundary=x; "
                                                                               "charset=latin-1"}),
                                           400, "invalid_message"),
            "unknown id": (httpx.get(server.http + "/v1/audio/voices/nobody"), 404, "unknown_voice"),
            "delete an unknown id": (httpx.delete(server.http + "/v1/audio/voices/nobody"), 404, "unknown_voice"),
        }
        for case, (response, status, code) in cases.items():
            assert (response.status_code, error_code(response)) == (status, code), (case, response.text)
        # the form field at fault is named, as OpenAI's `param` (a hostile try: it was always null)
        audio = ("too short", "too long", "a rate no voice has", "silent", "nearly silent", "not audio",
                 "text, not audio", "audio as a text field")
        named = {**dict.fromkeys(audio, "audio"), "transcript too long": "transcript", "two names": "name",
                 **dict.fromkeys(("name taken", "odd name", "name with a space", "name too long", "no name"), "name")}
        for case, (response, _, _) in cases.items():
            assert response.json()["error"]["param"] == named.get(case), (case, response.text)
        assert "its boundary occurs more than 10 times" in cases["near-boundaries"][0].json()["error"]["message"]
        unreadable = cases["not audio"][0].json()["error"]["message"]
        assert "Format not recognised" in unreadable and " at 0x" not in unreadable  # libsndfile's words, no repr
        assert upload(server, "second", wav()).status_code == 201
        full = upload(server, "third", wav())
        assert (full.status_code, error_code(full)) == (409, "voice_limit")
        assert [v["id"] for v in json.loads(server.get("/v1/audio/voices")[1])["voices"]] == ["taken", "second"]
        assert speech(server, "taken")[0] == 200  # nothing above disturbed the library


def test_a_streamed_body_past_the_limit_is_not_read_whole(base_model, one_thread):
    """A chunked body (no Content-Length) that claims to go on for ever is answered 413 once it passes the limit,
    while the client has stopped sending: the server never waits for (or holds) the rest."""
    with running_server(Limits(max_voice_upload_bytes=1_000_000), model=base_model) as server:
        port = int(server.http.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
            connection.sendall(b"POST /v1/audio/voices HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n"
                               b"Content-Type: multipart/form-data; boundary=b\r\n\r\n")
            part = b'--b\r\nContent-Disposition: form-data; name="audio"; filename="r.wav"\r\n\r\n'
            connection.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            piece = b"\0" * 65536
            for _ in range(24):  # 1.5 MB, and then nothing more
                connection.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                answer += connection.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), answer[:300]
        assert json.loads(body)["error"]["code"] == "upload_too_large"
        assert server.get("/health")[0] == 200


def test_models_that_cannot_make_voices_and_voice_design(tiny_checkpoints, tmp_path, one_thread):
    with running_server(model=tiny_checkpoints["custom_voice"], data_dir=tmp_path / "cv") as server:
        refused = upload(server, "alice", wav())
        assert (refused.status_code, error_code(refused)) == (400, "unsupported_model")
        assert json.loads(server.get("/v1/audio/voices")[1]) == {"voices": []}
        port = int(server.http.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:  # told before the body is read
            connection.sendall(b"POST /v1/audio/voices HTTP/1.1\r\nHost: test\r\nContent-Length: 10000000\r\n"
                               b"Content-Type: multipart/form-data; boundary=b\r\n\r\n--b\r\n")
            answer = b""
            while not answer.rstrip().endswith(b"}"):
                answer += connection.recv(65536)
        assert answer.startswith(b"HTTP/1.1 400") and b"unsupported_model" in answer, answer[:300]
    data_dir = tmp_path / "vd"
    with running_server(model=tiny_checkpoints["voice_design"], data_dir=data_dir) as server:
        created = upload(server, "narrator", instruction="A calm, low narrator's voice.")
        assert created.status_code == 201, created.text
        assert created.json()["instruction"] == "A calm, low narrator's voice."
        for bad in (upload(server, "x", wav(), instruction="warm"), upload(server, "y"),
                    upload(server, "design", instruction="taken by the built-in voice")):
            assert bad.status_code in (400, 409) and error_code(bad) in ("invalid_message", "voice_exists")
        designed = speech(server, "narrator")
        assert designed[0] == 200 and designed == speech(server, "design", instructions="A calm, low narrator's voice.")
        assert speech(server, "narrator", instructions="Another voice.")[0] == 400
        assert asyncio.run(designed_session_names_stored(server)) == "invalid_message"
        # a session whose voice is the stored one refuses instructions as a context's first append does
        assert asyncio.run(session_instructions(server, voice="narrator")) == (["invalid_config"], "narrator", True)
        assert asyncio.run(session_instructions(server)) == ([], "design", True)
        invisible = upload(server, "blank", instruction=" \u200b\u2060 ")  # nothing visible: no instruction
        assert (invisible.status_code, error_code(invisible)) == (400, "invalid_message")
    with running_server(model=tiny_checkpoints["voice_design"], data_dir=data_dir) as server:
        assert speech(server, "narrator") == designed


def test_session_instructions_for_voices_that_take_none_are_refused(tiny_checkpoints, base_model, tmp_path,
                                                                    one_thread):
    """A 0.6B CustomVoice model's speakers and a Base model's voices take no instructions: a session.start giving
    some gets `invalid_config` (blank ones mean none), and its contexts speak; a 1.7B speaker takes them."""
    small = tmp_path / "0b6"
    shutil.copytree(tiny_checkpoints["custom_voice"], small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(config | {"tts_model_size": "0b6"}))
    with running_server(model=small, data_dir=tmp_path / "small") as server:
        assert asyncio.run(session_instructions(server)) == (["invalid_config"], "vivian", True)
        assert asyncio.run(session_instructions(server, instructions=" ")) == ([], "vivian", True)
    with running_server(model=tiny_checkpoints["custom_voice"], data_dir=tmp_path / "large") as server:
        assert asyncio.run(session_instructions(server)) == ([], "vivian", True)
    with running_server(model=base_model, data_dir=tmp_path / "base") as server:
        assert upload(server, "alice", wav()).status_code == 201
        assert asyncio.run(session_instructions(server)) == (["invalid_config"], "alice", True)


def test_concurrent_uploads_keep_the_library_within_its_limit(base_model, one_thread):
    """Uploads that all pass the first check while one encodes: the limit is checked again once each has its turn."""
    with running_server(Limits(max_stored_voices=2), model=base_model) as server:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            responses = list(pool.map(lambda i: upload(server, f"race{i}", wav()), range(5)))
        codes = sorted(r.status_code for r in responses)
        assert codes == [201, 201, 409, 409, 409]
        assert {error_code(r) for r in responses if r.status_code == 409} == {"voice_limit"}
        assert len(httpx.get(server.http + "/v1/audio/voices").json()["voices"]) == 2


def test_uploads_in_progress_are_bounded(base_model, tmp_path, one_thread):
    """A memory hostile try's find: every upload waiting for the one encoder held its whole body (~26 MB each, 20
    of them 529 MB), and as many could wait as connections are open. Past MAX_UPLOADS_IN_PROGRESS (from the body's
    first byte to the voice stored) the next is answered 503 `overloaded` with Retry-After before its body is read;
    once one ends, uploads are taken again."""
    with running_server(model=base_model, data_dir=tmp_path / "data") as server:
        port = int(server.http.rsplit(":", 1)[1])
        held = []
        for _ in range(voice_library.MAX_UPLOADS_IN_PROGRESS):  # each sends its head and part of its body, then waits
            connection = socket.create_connection(("127.0.0.1", port), timeout=30)
            connection.sendall(b"POST /v1/audio/voices HTTP/1.1\r\nHost: test\r\nContent-Length: 1000000\r\n"
                               b"Content-Type: multipart/form-data; boundary=b\r\n\r\n--b\r\nContent-Disposition: "
                               b'form-data; name="audio"; filename="r.wav"\r\n\r\n' + b"\0" * 1000)
            held.append(connection)
        deadline = time.monotonic() + 30
        while (refused := upload(server, "late", wav())).status_code != 503 and time.monotonic() < deadline:
            assert refused.status_code == 201, refused.text  # a held one's turn was not taken yet: try again
            httpx.delete(server.http + "/v1/audio/voices/late")
        assert refused.status_code == 503 and error_code(refused) == "overloaded" and "retry-after" in refused.headers
        for connection in held:
            connection.close()
        while (taken := upload(server, "later", wav())).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.1)  # the server sees the held ones gone
        assert taken.status_code == 201, taken.text


def test_uploads_and_deletes_need_the_api_key(base_model, one_thread):
    with running_server(Limits(api_keys=("secret",)), model=base_model) as server:
        for response in (upload(server, "alice", wav()), httpx.get(server.http + "/v1/audio/voices"),
                         upload(server, "alice", wav(), token="wrong"),
                         httpx.delete(server.http + "/v1/audio/voices/alice")):
            assert (response.status_code, response.json()["error"]["code"]) == (401, "unauthorized")
        assert upload(server, "alice", wav(), token="secret").status_code == 201
        assert httpx.get(server.http + "/v1/audio/voices?token=secret").status_code == 200
        assert httpx.delete(server.http + "/v1/audio/voices/alice", headers={"Authorization": "Bearer nope"}
                            ).status_code == 401
        assert httpx.delete(server.http + "/v1/audio/voices/alice",
                            headers={"Authorization": "Bearer secret"}).status_code == 200


@pytest.fixture(scope="module")
def hostile_server(base_model, tmp_path_factory):
    with running_server(Limits(max_voice_upload_bytes=200_000), model=base_model,
                        data_dir=tmp_path_factory.mktemp("hostile")) as server:
        assert upload(server, "keeper", wav()).status_code == 201
        yield server


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)
AUDIO = st.one_of(st.binary(max_size=4096), st.sampled_from([wav(), wav(0.2), wav(amplitude=0.0)]), st.none())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.one_of(TEXT, st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,70}", fullmatch=True), st.none()),
       transcript=st.one_of(TEXT, st.none()), instruction=st.one_of(TEXT, st.none()), audio=AUDIO)
def test_hostile_fields_get_specific_errors(hostile_server, name, transcript, instruction, audio, one_thread):
    """Whatever the fields, the answer is 201 or a specific error, the server stays up and the library intact."""
    response = upload(hostile_server, name, audio, transcript=transcript, instruction=instruction)
    if response.status_code == 201:
        assert response.json()["id"] == name
        assert httpx.delete(f"{hostile_server.http}/v1/audio/voices/{name}").status_code == 200
    else:
        assert 400 <= response.status_code < 500 and error_code(response) in VOICE_LIBRARY_STATUS, response.text
        assert response.json()["error"]["param"] in (None, "name", "audio", "transcript", "instruction")
    assert speech(hostile_server, "keeper")[0] == 200


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=2048), boundary=st.from_regex(r"[A-Za-z0-9'()+_,./:=?-]{1,70}", fullmatch=True),
       voice_id=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=80))
@example(body=b"", boundary="0", voice_id="/")  # once answered 307, starlette's redirect to the voice list
@example(body=b"", boundary="0", voice_id="..%")
def test_hostile_bodies_and_ids(hostile_server, body, boundary, voice_id, one_thread):
    response = httpx.post(hostile_server.http + "/v1/audio/voices", content=f"--{boundary}\r\n".encode() + body,
                          headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert response.status_code == 400 and error_code(response) == "invalid_message", response.text
    if voice_id not in ("keeper", ".", ".."):  # a client removes the dot segments (RFC 3986): the list's path
        answered = httpx.get(f"{hostile_server.http}/v1/audio/voices/{quote(voice_id, safe='')}")
        assert answered.status_code == 404, answered.text
    assert hostile_server.get("/health")[0] == 200


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["name", "transcript", "instruction"]),
       bad=st.sampled_from([b"\xed\xa0\x80", b"\xff", b"\xc3", b"caf\xe9", b"\xf4\x90\x80\x80"]),
       around=st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=8))
def test_a_text_field_that_is_not_utf8_is_a_malformed_form(hostile_server, field, bad, around, one_thread):
    """Not read as latin-1 (what starlette's parser falls back to): a surrogate's bytes, a lone byte, an unfinished
    sequence, latin-1 text, a code point past U+10FFFF."""
    form = httpx.Request("POST", hostile_server.http + "/v1/audio/voices",
                         data={"name": "strict", "transcript": "What I say in it."} | {field: "FIELD"},
                         files={"audio": ("reference.wav", wav(), "audio/wav")})
    body = form.read().replace(b"FIELD", around.encode() + bad + around.encode())
    response = httpx.post(hostile_server.http + "/v1/audio/voices", content=body,
                          headers={"Content-Type": form.headers["Content-Type"]}, timeout=120)
    assert response.status_code == 400 and error_code(response) == "invalid_message", response.text
    assert f"text field {field!r} is not valid UTF-8" in response.json()["error"]["message"]
    assert httpx.get(hostile_server.http + "/v1/audio/voices/strict").status_code == 404


CONTROLS = st.characters(categories=["Cc"]).filter(lambda ch: ch not in "\t\n\r")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["transcript", "instruction"]), control=CONTROLS,
       before=st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=8))
def test_a_control_character_in_a_text_field_is_refused_naming_it(hostile_server, field, control, before, one_thread):
    """A transcript is stored and listed back, as a lexicon's rules are, which take no NUL, escape or bell either (a
    hostile try: a transcript holding them was stored). Form feeds, vertical tabs and NEL are controls too."""
    response = upload(hostile_server, "controlled", wav(), **{field: before + control + "What I say in it."})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "invalid_message", response.text
    assert f"U+{ord(control):04X}" in error["message"] and error["param"] == field, response.text
    assert httpx.get(hostile_server.http + "/v1/audio/voices/controlled").status_code == 404


def test_head_reads_and_never_deletes_or_uploads(hostile_server, one_thread):
    """Starlette answers HEAD on every GET route: on a voice it is a GET without a body, never the DELETE the route
    also takes, and on the list never an upload, whatever body it carries."""
    head = httpx.head(hostile_server.http + "/v1/audio/voices/keeper")
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(hostile_server.http + "/v1/audio/voices/keeper").status_code == 200  # still stored
    assert httpx.head(hostile_server.http + "/v1/audio/voices/nobody").status_code == 404
    form = httpx.Request("POST", hostile_server.http + "/v1/audio/voices", data={"name": "by-head"},
                         files={"audio": ("reference.wav", wav(), "audio/wav")})
    form.read()
    assert httpx.request("HEAD", hostile_server.http + "/v1/audio/voices", content=form.content,
                         headers={"Content-Type": form.headers["Content-Type"]}, timeout=120).status_code == 200
    assert httpx.get(hostile_server.http + "/v1/audio/voices/by-head").status_code == 404  # nothing uploaded
    assert speech(hostile_server, "keeper")[0] == 200


def test_store_round_trips_tensors_of_any_dtype(tmp_path):
    path = tmp_path / "voices.sqlite3"
    xvector = torch.randn(64).to(torch.bfloat16)
    codes = torch.randint(0, 2048, (25, 16))
    assert torch.equal(tensor_from_bytes(tensor_bytes(xvector), "bfloat16", [64]), xvector)
    store = VoiceStore(path, "model-a")
    store.add(StoredVoice("v", "clone", 1.0, transcript="hi", audio_seconds=2.0, xvector=xvector, ref_codes=codes))
    store.close()
    (stored,) = VoiceStore(path, "model-a").voices()
    assert torch.equal(stored.xvector, xvector) and torch.equal(stored.ref_codes, codes)
    assert stored.transcript == "hi" and VoiceStore(path, "model-b").voices() == []


def test_an_unwritable_data_dir_is_refused_at_once(tmp_path):
    from engine.errors import VoxgateError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(VoxgateError, match="--data-dir"):
        check_data_dir(blocker / "voxgate")


def test_a_voice_that_could_never_speak_is_refused_at_upload(hostile_server, one_thread):
    """Stored voices must work: a transcript with more tokens than its audio has frames (every use failed with
    invalid_message) and audio whose speaker embedding is not finite (a float WAV sample of 1e30) are refused."""
    long_transcript = upload(hostile_server, "wordy", wav(1.0), transcript=" ".join(["word"] * 390))
    assert long_transcript.status_code == 400 and error_code(long_transcript) == "text_too_long"
    assert "frames" in long_transcript.json()["error"]["message"]
    tone = np.frombuffer(sf.read(io.BytesIO(wav()), dtype="float32")[0].tobytes(), np.float32).copy()
    tone[100] = 1e30
    out = io.BytesIO()
    sf.write(out, tone, RATE, format="WAV", subtype="FLOAT")
    huge = upload(hostile_server, "huge", out.getvalue(), transcript=TRANSCRIPT)
    assert huge.status_code == 400 and error_code(huge) == "invalid_audio", huge.json()
    listed = [voice["id"] for voice in json.loads(hostile_server.get("/v1/audio/voices")[1])["voices"]]
    assert "wordy" not in listed and "huge" not in listed


def test_a_stored_voice_that_can_no_longer_load_is_left_out_and_the_server_starts(base_model, tmp_path, one_thread):
    """A voice an earlier version stored although it could never speak (its transcript longer than its audio's
    frames), or whose codes lie past the codebooks (on a GPU each use would fault the device, failing every request),
    must not stop the server at start-up: it is left out, the other voices serve."""
    data_dir = tmp_path / "data"
    with running_server(model=base_model, data_dir=data_dir) as server:
        assert upload(server, "good", wav(), transcript=TRANSCRIPT).status_code == 201
    store = VoiceStore.in_data_dir(data_dir, checkpoint_fingerprint(base_model))
    good = next(voice for voice in store.voices() if voice.name == "good")
    store.add(replace(good, name="wordy", transcript=" ".join(["word"] * 390), ref_codes=good.ref_codes[:2]))
    store.add(replace(good, name="beyond", ref_codes=good.ref_codes + 4096))
    store.add(replace(good, name="below", ref_codes=good.ref_codes - 4096))
    with running_server(model=base_model, data_dir=data_dir) as server:
        catalog = json.loads(server.get("/v1/voices")[1])
        assert [v["id"] for v in catalog["voices"]] == ["good"]
        assert speech(server, "good")[0] == 200


def test_openai_voice_names_follow_the_default_as_voices_come_and_go(base_model, tmp_path, one_thread):
    """A Base model has no speakers: OpenAI's names speak with its default voice, the one it has when the request
    comes, not the one it had at start-up (deleted since, it made every `alloy` request unknown_voice). A voice
    stored as `alloy` is itself, and the catalog's mapping says so (it named the default: a hostile try)."""
    with running_server(model=base_model, data_dir=tmp_path / "data") as server:
        for name in ("first", "second"):
            assert upload(server, name, wav(), transcript=TRANSCRIPT).status_code == 201
    with running_server(model=base_model, data_dir=tmp_path / "data") as server:  # starts with a default
        assert speech(server, "alloy") == speech(server, "first")  # the default: the oldest stored voice
        assert httpx.delete(server.http + "/v1/audio/voices/first").status_code == 200
        assert speech(server, "alloy") == speech(server, "second") and speech(server, "alloy")[0] == 200
        assert json.loads(server.get("/v1/voices")[1])["openai_voices"]["alloy"] == "second"
        assert upload(server, "alloy", wav(seconds=3.0, amplitude=0.5), transcript=TRANSCRIPT).status_code == 201
        assert speech(server, "alloy") != speech(server, "second")
        assert json.loads(server.get("/v1/voices")[1])["openai_voices"]["alloy"] == "alloy"
        assert speech(server, "Alloy") == speech(server, "alloy")  # OpenAI's names in any case, as listed


def test_an_upload_never_takes_a_base_models_default_over(base_model, tmp_path, one_thread):
    """A Base model's default is its oldest voice (no --clone-voice here): an upload named like a CustomVoice
    speaker ('vivian') took the default of every session and request that named no voice. With no voice at all,
    `session.started` says `voice: null`."""

    async def started_voice(server):
        async with connect(server.ws) as ws:
            return json.loads(await ws.recv())

    with running_server(model=base_model, data_dir=tmp_path / "data") as server:
        started = asyncio.run(started_voice(server))
        assert started["type"] == "session.started" and "voice" in started and started["voice"] is None
        for name in ("zed", "vivian"):
            assert upload(server, name, wav(), transcript=TRANSCRIPT).status_code == 201
        voices = json.loads(server.get("/v1/voices")[1])
        assert voices["default"] == "zed" and voices["openai_voices"]["alloy"] == "zed"
        assert asyncio.run(started_voice(server))["voice"] == "zed"
        assert speech(server, "alloy") == speech(server, "zed")


def test_a_reference_audio_sent_without_a_filename_is_named_in_its_error(hostile_server, one_thread):
    """Starlette refused it as "Part exceeded maximum size of 16KB", naming neither the field nor the fix."""
    response = httpx.post(hostile_server.http + "/v1/audio/voices", data={"name": "nofile"},
                          files={"audio": (None, wav(), "audio/wav")}, timeout=60)
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and error_code(response) == "invalid_message"
    assert "'audio'" in message and "file part" in message, message


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(3, 400))
def test_a_form_cut_short_is_malformed_not_stored_without_its_last_part(hostile_server, cut, one_thread):
    """A body that stops before the form's closing boundary (wherever the cut falls in the last parts) was stored
    from the parts that had ended: a clone voice without the transcript that was cut off. It is a malformed form.
    (Its last 2 bytes, the CRLF after the closing `--`, are not part of the boundary: without them it is whole.)"""
    form = httpx.Request("POST", hostile_server.http + "/v1/audio/voices",
                         data={"name": "cut", "transcript": "What I say in it, every word of it."},
                         files={"audio": ("reference.wav", wav(), "audio/wav")})
    body = form.read()
    response = httpx.post(hostile_server.http + "/v1/audio/voices", content=body[:len(body) - cut],
                          headers={"Content-Type": form.headers["Content-Type"]}, timeout=120)
    assert response.status_code == 400 and error_code(response) == "invalid_message", response.text
    assert httpx.get(hostile_server.http + "/v1/audio/voices/cut").status_code == 404


async def _read(stream) -> bytes:
    return b"".join([piece async for piece in stream])


async def _pieces(body: bytes, cuts: list[int]):
    bounds = [0, *sorted(min(cut, len(body)) for cut in cuts), len(body)]
    for start, end in zip(bounds, bounds[1:]):
        yield body[start:end]


@settings(max_examples=60, deadline=None)
@given(parts=st.integers(1, 11), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_a_forms_delimiters_are_counted_however_its_body_is_read(parts, cuts):
    """A form of up to 8 fields and a file (10 delimiters with the closing one) passes unchanged, one part more is
    refused, wherever the reads cut a delimiter."""
    body = b"".join(b"--bnd\r\n" + b"x" * 20 + b"\r\n" for _ in range(parts)) + b"--bnd--\r\n"
    counted = voice_library._delimited(_pieces(body, cuts), b"bnd")
    if parts + 1 <= voice_library.MAX_DELIMITERS:
        assert asyncio.run(_read(counted)) == body
    else:
        with pytest.raises(voice_library.TooManyDelimiters):
            asyncio.run(_read(counted))
