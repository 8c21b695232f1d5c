"""`WS /v1/chat` on a real server (tiny model) with a local fake OpenAI-compatible LLM: the reply streams to the chat
socket and is spoken into a context of the page's voxgate.v1 session as it arrives; barge-in stops the LLM."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from realtime.gateway import Limits
from realtime import llm as llm_module
from realtime.llm import LLMConfig, LLMError, new_llm_client, stream_chat
from tests.fake_llm import running_fake_llm
from tests.gateway_server import events_until_closed, running_server

REPLY = ["Hello", " there", ",", " nice", " to", " meet", " you", "."]
LONG_REPLY = ["Word "] * 200


@pytest.fixture(scope="module")
def llm():
    with running_fake_llm(REPLY, token_delay_s=0.02) as fake:
        yield fake


@pytest.fixture(scope="module")
def server(llm):
    keys = Limits(api_keys=("k", "other-tenant"))
    with running_server(keys, llm=LLMConfig(llm.url, "fake-model", "llm-key", "Be brief.")) as running:
        yield running


def chat_url(server) -> str:
    return server.ws.replace("/v1/tts/stream", "/v1/chat") + "?token=k"


async def receive(ws, timeout: float = 60.0) -> dict:
    while True:
        raw = await asyncio.wait_for(ws.recv(), timeout)
        if isinstance(raw, str):
            return json.loads(raw)


async def until(ws, predicate, timeout: float = 60.0) -> list[dict]:
    seen = []
    while not seen or not predicate(seen[-1]):
        seen.append(await receive(ws, timeout))
    return seen


async def ask(chat, session_id: str, request_id: str, context_id: str, content: str = "Talk.", **fields) -> None:
    await chat.send(json.dumps({"type": "chat.request", "id": request_id, "session_id": session_id,
                                "context_id": context_id, "messages": [{"role": "user", "content": content}],
                                **fields}))


@pytest.mark.parametrize("reply, spoken, reason", [
    (["Look ", "\ud83d", "\ude00", " there."], "Look \U0001F600 there.", "stop"),  # an emoji's halves apart
    (["Odd ", "\ude00", " half."], "Odd \ufffd half.", "stop"),  # a half with no other: a replacement character
    (["Cut ", "\ud83d"], "Cut \ufffd", "stop"),  # the reply ends inside a character
    (["Hi ", 5], "Hi ", "error"),  # content that is not text: llm_error, after speaking what came
])
def test_an_llm_that_splits_a_character_or_sends_no_text_is_handled(server, llm, reply, spoken, reason):
    llm.reply = reply
    try:
        events, done = asyncio.run(one_turn(server))
    finally:
        llm.reply = REPLY
    assert "".join(e["text"] for e in events if e["type"] == "chat.delta") == spoken
    assert events[-1]["reason"] == reason and events[-1]["text"] == spoken
    assert [e["code"] for e in events if e["type"] == "error"] == (["llm_error"] if reason == "error" else [])
    assert done["metrics"]["text_chars"] == len(spoken)  # spoken as it came, nothing refused


def test_an_llm_address_that_answers_a_web_page_is_an_llm_error(server, llm):
    """A 200 that is no event stream (a wrong --llm-url reaching a web page) is an llm_error, not an empty reply."""
    llm.web_page = True
    try:
        events, _ = asyncio.run(one_turn(server, spoken=False))
    finally:
        llm.web_page = False
    (error,) = [e for e in events if e["type"] == "error"]
    assert error["code"] == "llm_error" and "no chat completion events" in error["message"]
    assert events[-1] == {"type": "chat.done", "id": "r", "text": "", "reason": "error"}


async def one_turn(server, spoken: bool = True) -> tuple[list[dict], dict | None]:
    """One chat turn on a fresh pair of sockets: the chat socket's events to its chat.done, and (`spoken`: the reply
    had text, so a context was opened) its context.done."""
    tts, session_id, chat, _ = await open_pair(server)
    await ask(chat, session_id, "r", "c")
    events = await until(chat, lambda e: e["type"] == "chat.done")
    done = (await until(tts, lambda e: e["type"] == "context.done"))[-1] if spoken else None
    await tts.close()
    await chat.close()
    return events, done


@pytest.fixture
def long_reply(llm):
    llm.reply = LONG_REPLY
    yield llm
    llm.reply = REPLY


async def open_pair(server):
    tts = await connect(server.ws + "?token=k", max_size=None)
    started = json.loads(await tts.recv())
    chat = await connect(chat_url(server))
    ready = json.loads(await chat.recv())
    return tts, started["session_id"], chat, ready


def test_the_reply_streams_to_the_page_and_is_spoken_as_it_arrives(server, llm):
    async def go():
        tts, session_id, chat, ready = await open_pair(server)
        assert ready == {"type": "chat.ready", "llm": {"model": "fake-model"}}
        await ask(chat, session_id, "r1", "c1", "Hi!", voice="vivian")
        chat_events = await until(chat, lambda e: e["type"] == "chat.done")
        deltas = [e["text"] for e in chat_events if e["type"] == "chat.delta"]
        assert deltas == REPLY and chat_events[-1] == {"type": "chat.done", "id": "r1", "text": "".join(REPLY),
                                                       "reason": "stop"}
        spoken = await until(tts, lambda e: e["type"] == "context.done")
        assert spoken[0]["type"] == "context.started" and spoken[0]["voice"] == "vivian"
        assert spoken[-1]["metrics"]["text_chars"] == len("".join(REPLY)) and spoken[-1]["audio_ms"] > 0
        body = llm.calls[-1].body
        assert body["model"] == "fake-model" and body["stream"] is True
        assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
        assert llm.calls[-1].authorization == "Bearer llm-key"
        await tts.close()
        await chat.close()
    asyncio.run(go())


def test_a_turn_for_a_context_the_client_ended_is_refused_once_and_leaves_it_speaking(server, llm):
    """A chat.request naming a context the audio socket has ended (still speaking): the turn's text is refused with
    one context_closed on the audio socket (its end was a second one), the turn ends `error`, and the client's
    context speaks to its own end."""
    async def go():
        tts, session_id, chat, _ = await open_pair(server)
        await tts.send(json.dumps({"type": "text.append", "context_id": "c", "text": "The client's own words."}))
        await tts.send(json.dumps({"type": "context.end", "context_id": "c"}))
        await ask(chat, session_id, "r1", "c")
        done = (await until(chat, lambda e: e["type"] == "chat.done"))[-1]
        spoken = await until(tts, lambda e: e["type"] == "context.done")
        await asyncio.sleep(0.5)  # a second error would follow the first at once
        await tts.send(json.dumps({"type": "ping", "id": 1}))
        spoken += await until(tts, lambda e: e["type"] == "pong")
        await tts.close()
        await chat.close()
        return done, spoken

    done, spoken = asyncio.run(go())
    assert done["reason"] == "error"
    assert [(e["code"], e.get("context_id")) for e in spoken if e["type"] == "error"] == [("context_closed", "c")]
    assert [e for e in spoken if e["type"] == "context.done"][0]["audio_ms"] > 0


def test_cancelling_the_context_on_the_audio_socket_stops_the_llm(server, long_reply):
    async def go():
        tts, session_id, chat, _ = await open_pair(server)
        await ask(chat, session_id, "r2", "c2")
        await until(chat, lambda e: e["type"] == "chat.delta")
        await tts.send(json.dumps({"type": "context.cancel", "context_id": "c2", "played_ms": 0}))
        cancelled = await until(tts, lambda e: e["type"] == "context.cancelled")
        assert cancelled[-1]["heard_text"] == ""
        done = (await until(chat, lambda e: e["type"] == "chat.done"))[-1]
        assert done["reason"] == "cancelled" and len(done["text"]) < len("".join(LONG_REPLY))
        for _ in range(100):
            if long_reply.calls[-1].outcome != "streaming":
                break
            await asyncio.sleep(0.05)
        assert long_reply.calls[-1].outcome == "cancelled"
        await tts.send(json.dumps({"type": "ping", "id": 1}))
        after = await until(tts, lambda e: e["type"] == "pong")
        assert [e["type"] for e in after] == ["pong"]  # nothing more was appended to the cancelled context
        await tts.close()
        await chat.close()
    asyncio.run(go())


def test_barge_in_stops_an_llm_that_has_gone_silent(server, llm):
    """The context cancelled on the audio socket while the LLM sends nothing: the turn still ends (chat.done) and the
    LLM request is closed, not left open until a next delta that never comes."""
    async def go():
        llm.stall_after = 2
        try:
            tts, session_id, chat, _ = await open_pair(server)
            await ask(chat, session_id, "r-stall", "c-stall")
            await until(chat, lambda e: e["type"] == "chat.delta" and e["text"] == REPLY[1])
            await tts.send(json.dumps({"type": "context.cancel", "context_id": "c-stall"}))
            done = (await until(chat, lambda e: e["type"] == "chat.done", timeout=10))[-1]
            assert done["reason"] == "cancelled" and done["text"] == "".join(REPLY[:2])
            for _ in range(100):
                if llm.calls[-1].outcome != "streaming":
                    break
                await asyncio.sleep(0.05)
            assert llm.calls[-1].outcome == "cancelled"
            await tts.close()
            await chat.close()
        finally:
            llm.stall_after = None
    asyncio.run(go())


@pytest.mark.parametrize("how", ["chat.cancel", "a newer request"])
def test_a_turn_stopped_before_it_began_still_gets_its_chat_done(server, how):
    async def go():
        tts, session_id, chat, _ = await open_pair(server)
        await ask(chat, session_id, "r-early", "c-early")
        if how == "chat.cancel":
            await chat.send(json.dumps({"type": "chat.cancel", "id": "r-early"}))
        else:
            await ask(chat, session_id, "r-next", "c-next")
        done = (await until(chat, lambda e: e["type"] == "chat.done" and e["id"] == "r-early", timeout=10))[-1]
        assert done["reason"] == "cancelled"
        await tts.close()
        await chat.close()
    asyncio.run(go())


def test_chat_cancel_stops_the_llm_and_speaks_what_it_wrote(server, long_reply):
    async def go():
        tts, session_id, chat, _ = await open_pair(server)
        await ask(chat, session_id, "r3", "c3")
        await until(chat, lambda e: e["type"] == "chat.delta")
        await chat.send(json.dumps({"type": "chat.cancel", "id": "r3"}))
        done = (await until(chat, lambda e: e["type"] == "chat.done"))[-1]
        assert done["reason"] == "cancelled"
        spoken = (await until(tts, lambda e: e["type"] == "context.done", timeout=120))[-1]
        assert spoken["metrics"]["text_chars"] == len(done["text"])
        await tts.close()
        await chat.close()
    asyncio.run(go())


def test_a_request_into_the_running_turns_context_ends_that_turn_and_is_refused(server, long_reply):
    """The running turn's context_id again: the new request barges in (the turn stops, its context is spoken to its
    end), and its own text is refused (context_closed on the audio socket, the turn ends `error`)."""
    async def go():
        tts, session_id, chat, _ = await open_pair(server)
        await ask(chat, session_id, "r1", "live")
        await until(chat, lambda e: e["type"] == "chat.delta")
        await ask(chat, session_id, "r2", "live")
        events = await until(chat, lambda e: e["type"] == "chat.done" and e["id"] == "r2")
        assert [(e["id"], e["reason"]) for e in events if e["type"] == "chat.done"] == [("r1", "cancelled"),
                                                                                       ("r2", "error")]
        spoken = await until(tts, lambda e: e["type"] == "context.done", timeout=120)
        assert [(e["code"], e["context_id"]) for e in spoken if e["type"] == "error"] == [("context_closed", "live")]
        await tts.close()
        await chat.close()
    asyncio.run(go())


@pytest.mark.parametrize("message,code,request_id", [
    ("not json", "invalid_json", None),
    ('{"type": "chat.hello"}', "unknown_type", None),
    ('{"type": "chat.request", "id": "x"}', "invalid_message", None),  # not a request yet: no id to name
    ('{"type": "chat.request", "id": "x", "session_id": "s", "context_id": "c", "messages": []}', "invalid_message",
     "x"),
    ('{"type": "chat.request", "id": "x", "session_id": "s", "context_id": "c", '
     '"messages": [{"role": "robot", "content": "hi"}]}', "invalid_message", "x"),
    ('{"type": "chat.request", "id": "x", "session_id": "nope", "context_id": "c", '
     '"messages": [{"role": "user", "content": "hi"}]}', "session_not_found", "x"),
])
def test_bad_chat_messages_get_their_error_and_the_socket_goes_on(server, message, code, request_id):
    """Each bad message gets its error, naming the request it refuses once the message is a well-formed request;
    each is counted in voxgate_errors_total, as every error the server sends (they were not)."""
    counted_before = _errors_counted(server, code)

    async def go():
        async with connect(chat_url(server)) as chat:
            await chat.recv()
            await chat.send(message)
            error = json.loads(await chat.recv())
            assert error["type"] == "error" and error["code"] == code and error["fatal"] is False
            assert error.get("id") == request_id
            await chat.send('{"type": "chat.cancel", "id": "none"}')  # nothing to cancel: no answer, no close
            await chat.send("{}")
            assert json.loads(await chat.recv())["code"] == "invalid_message"
    asyncio.run(go())
    assert _errors_counted(server, code) == counted_before + (2 if code == "invalid_message" else 1)


def _errors_counted(server, code: str) -> float:
    exposition = server.get("/metrics")[1].decode()
    counted = re.search(r'voxgate_errors_total\{code="%s",transport="ws"\} (\S+)' % code, exposition)
    return float(counted[1]) if counted else 0.0


def test_a_chat_socket_speaks_only_into_sessions_of_its_own_key(server):
    """Another key's session is not found, though its id is right, and hears nothing; the same key given the other
    way (a header instead of ?token=) reaches it."""
    async def go():
        tts, session_id, own, _ = await open_pair(server)
        async with connect(server.ws.replace("/v1/tts/stream", "/v1/chat") + "?token=other-tenant") as other:
            await other.recv()
            await ask(other, session_id, "x1", "c1", "Say something rude.")
            error = json.loads(await other.recv())
            assert (error["type"], error["code"], error["id"], error["fatal"]) == ("error", "session_not_found", "x1",
                                                                                 False)
        with pytest.raises(TimeoutError):
            await receive(tts, timeout=0.5)  # no context was opened
        header = {"Authorization": "Bearer k"}
        async with connect(server.ws.replace("/v1/tts/stream", "/v1/chat"), additional_headers=header) as chat:
            await chat.recv()
            await ask(chat, session_id, "r1", "c2")
            assert (await until(chat, lambda e: e["type"] == "chat.done"))[-1]["reason"] == "stop"
        assert (await until(tts, lambda e: e["type"] == "context.done"))[-1]["context_id"] == "c2"
        await own.close()
        await tts.close()
    asyncio.run(go())


def test_a_reply_into_a_context_that_has_finished_is_refused(server):
    """A chat.request naming a context already spoken to its end: its first piece is refused with context_closed on
    the audio socket and the turn ends `error`, as for a context the client has ended (it was a silent chat.done
    {reason: cancelled}); a new context_id is spoken."""
    async def go():
        tts, session_id, chat, _ = await open_pair(server)
        await ask(chat, session_id, "r1", "done-ctx")
        await until(chat, lambda e: e["type"] == "chat.done")
        await until(tts, lambda e: e["type"] == "context.done")
        await ask(chat, session_id, "r2", "done-ctx")
        assert (await until(chat, lambda e: e["type"] == "chat.done"))[-1]["reason"] == "error"
        error = (await until(tts, lambda e: e["type"] == "error"))[-1]
        assert (error["code"], error["context_id"]) == ("context_closed", "done-ctx")
        await ask(chat, session_id, "r3", "next-ctx")
        assert (await until(chat, lambda e: e["type"] == "chat.done"))[-1]["reason"] == "stop"
        await chat.close()
        await tts.close()
    asyncio.run(go())


def test_a_wrong_key_is_refused(server):
    async def go():
        async with connect(server.ws.replace("/v1/tts/stream", "/v1/chat") + "?token=bad") as chat:
            error = json.loads(await chat.recv())
            assert error["code"] == "unauthorized" and error["fatal"] is True
            with pytest.raises(ConnectionClosed) as closed:
                await chat.recv()
            assert closed.value.rcvd.code == 4001
    asyncio.run(go())


def test_without_an_llm_or_with_an_llm_that_fails():
    async def go(server):
        tts, session_id, chat, ready = await open_pair(server)
        await ask(chat, session_id, "r", "c", "Hi")
        answers = await until(chat, lambda e: e["type"] in ("chat.done", "error") and e.get("code") != "llm_error")
        await tts.close()
        await chat.close()
        return ready, answers

    with running_server(Limits(api_keys=("k",))) as plain:
        ready, answers = asyncio.run(go(plain))
        assert ready["llm"] is None and answers[-1]["code"] == "no_llm"
    with running_server(Limits(api_keys=("k",)), llm=LLMConfig("http://127.0.0.1:9/v1", "m")) as broken:
        ready, answers = asyncio.run(go(broken))
        assert answers[0]["code"] == "llm_error" and "127.0.0.1:9" in answers[0]["message"]
        assert answers[-1] == {"type": "chat.done", "id": "r", "text": "", "reason": "error"}


def test_barge_in_before_the_first_token_an_overlong_reply_and_a_closed_audio_socket():
    async def early_cancel(server, llm):
        tts, session_id, chat, _ = await open_pair(server)
        llm.token_delay_s = 0.5
        await ask(chat, session_id, "a", "ca", "Hi")
        await tts.send(json.dumps({"type": "context.cancel", "context_id": "ca", "played_ms": 0}))
        assert (await receive(tts))["type"] == "context.cancelled"
        done = (await until(chat, lambda e: e["type"] == "chat.done"))[-1]
        assert done["reason"] == "cancelled" and done["text"] == ""
        await tts.send(json.dumps({"type": "ping", "id": 1}))
        assert [e["type"] for e in await until(tts, lambda e: e["type"] == "pong")] == ["pong"]  # never started
        await tts.close()
        await chat.close()

    async def overlong(server, llm):
        tts, session_id, chat, _ = await open_pair(server)
        llm.token_delay_s = 0.01
        await ask(chat, session_id, "b", "cb", "Hi")
        done = (await until(chat, lambda e: e["type"] == "chat.done"))[-1]
        assert done["reason"] == "error" and 0 < len(done["text"]) <= 40
        spoken = await until(tts, lambda e: e["type"] == "context.done")
        assert [e["code"] for e in spoken if e["type"] == "error"] == ["text_too_long"]  # one error, not one a token
        await tts.close()
        await chat.close()

    async def audio_socket_closes(server, llm):
        tts, session_id, chat, _ = await open_pair(server)
        llm.token_delay_s = 0.05
        await ask(chat, session_id, "c", "cc", "Hi")
        await until(chat, lambda e: e["type"] == "chat.delta")
        await tts.close()
        done = (await until(chat, lambda e: e["type"] == "chat.done"))[-1]
        assert done["reason"] == "cancelled"
        for _ in range(100):
            if server.metric("voxgate_contexts_active") == 0 and llm.calls[-1].outcome == "cancelled":
                break
            await asyncio.sleep(0.05)
        assert server.metric("voxgate_contexts_active") == 0 and llm.calls[-1].outcome == "cancelled"
        await chat.close()

    with running_fake_llm(LONG_REPLY) as llm, \
            running_server(Limits(api_keys=("k",), max_text_chars=40), llm=LLMConfig(llm.url, "m")) as server:
        asyncio.run(early_cancel(server, llm))
        asyncio.run(overlong(server, llm))
        asyncio.run(audio_socket_closes(server, llm))


def test_a_full_completions_address_and_no_key_reach_the_llm_without_authorization():
    """`--llm-url` may name `.../chat/completions` itself; without `--llm-api-key` no Authorization header goes out
    (the SDK would otherwise insist on one)."""
    async def go(server):
        tts, session_id, chat, _ = await open_pair(server)
        await ask(chat, session_id, "r", "c", "Hi")
        done = (await until(chat, lambda e: e["type"] == "chat.done"))[-1]
        await tts.close()
        await chat.close()
        return done

    with running_fake_llm(REPLY, token_delay_s=0.01) as llm, \
            running_server(Limits(api_keys=("k",)), llm=LLMConfig(llm.url + "/chat/completions/", "m")) as server:
        done = asyncio.run(go(server))
        assert done["reason"] == "stop" and done["text"] == "".join(REPLY)
        assert llm.calls[-1].authorization is None and llm.calls[-1].outcome == "complete"


def test_chat_sockets_are_capped_and_a_silent_one_stays_open():
    """A hostile try held every connection with chat sockets (they were not counted): past max_sessions of them a
    new one is refused (1013) while the others stay open; a page's chat socket may stay silent past the idle timeout
    (its user reads, its audio session keeps itself alive), so it is not closed for that."""
    async def go(server):
        url = server.ws.replace("/v1/tts/stream", "/v1/chat") + "?token=k"
        first, second = await connect(url), await connect(url)
        for chat in (first, second):
            assert (await receive(chat))["type"] == "chat.ready"
        async with connect(url) as third:
            refusal = await receive(third)
            assert (refusal["code"], refusal["fatal"]) == ("overloaded", True)
            with pytest.raises(ConnectionClosed) as closed:
                await third.recv()
            assert closed.value.rcvd.code == 1013
        await asyncio.sleep(1.5)  # past the idle timeout
        await second.send(json.dumps({"type": "chat.cancel", "id": "none"}))  # still open: nothing comes back
        await second.close()
        async with connect(url) as again:  # its place is free
            assert (await receive(again))["type"] == "chat.ready"
        await first.close()

    with running_server(Limits(api_keys=("k",), max_sessions=2, idle_timeout_s=1.0)) as capped:
        asyncio.run(go(capped))


async def _reply(url: str) -> str:
    config = LLMConfig(url, "m")
    pieces = stream_chat(new_llm_client(config), config, [{"role": "user", "content": "hi"}])
    return "".join([piece async for piece in pieces])


@pytest.mark.parametrize("reply, refusal", [
    (["fine ", "x" * 3000], "an event of more than 1000 bytes"),  # one huge event
    ([""] * 400, "reply passed 20000 bytes"),  # events without text, endlessly
])
def test_an_llm_that_sends_too_much_is_cut_off_before_its_events_are_gathered(monkeypatch, reply, refusal):
    """A hostile try's LLM sent one 200 MB event (the gateway's loop held 3 s, 430 MB kept) or 200,000 empty chunks
    (9 s): the reply's body is bounded as it is read, per line and in all (lowered here), and the turn ends with an
    LLMError naming the bound; a reply within the bounds is read whole."""
    monkeypatch.setattr(llm_module, "MAX_EVENT_BYTES", 1000)
    monkeypatch.setattr(llm_module, "MAX_REPLY_BYTES", 20_000)
    with running_fake_llm(reply, token_delay_s=0) as fake:
        with pytest.raises(LLMError, match=refusal):
            asyncio.run(_reply(fake.url))
    with running_fake_llm(["a ", "b" * 500, " c"], token_delay_s=0) as fake:
        assert asyncio.run(_reply(fake.url)) == "a " + "b" * 500 + " c"


class _Pieces:
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece

    async def aclose(self) -> None:
        pass


async def _through_bound(pieces: list[bytes]) -> bytes:
    return b"".join([data async for data in llm_module._BoundedBody(_Pieces(pieces))])


def test_the_bounded_body_counts_lines_however_the_stream_is_cut(monkeypatch):
    """A valid event stream passes unchanged at every split into two reads (a read that held one line end raised a
    TypeError once: the turn ended `internal`), and a line over the bound is refused at every split."""
    monkeypatch.setattr(llm_module, "MAX_EVENT_BYTES", 64)
    valid = b"event: x\ndata: " + b"a" * 50 + b"\n\r\ndata: [DONE]\n\n"
    long = b"data: ok\n\ndata: " + b"b" * 70 + b"\n\n"
    for at in range(len(valid) + 1):
        assert asyncio.run(_through_bound([valid[:at], valid[at:]])) == valid
    for at in range(len(long) + 1):
        with pytest.raises(LLMError, match="more than 64 bytes"):
            asyncio.run(_through_bound([long[:at], long[at:]]))


def test_a_compressed_llm_body_is_refused_before_it_is_read():
    """The bounds count the bytes read: a gzip body of 200 KB could expand to 200 MB past them (the client asks for
    an uncompressed body)."""
    response = llm_module._http.Response(200, headers={"content-encoding": "gzip"}, content=b"")
    with pytest.raises(LLMError, match="'gzip'-encoded body"):
        asyncio.run(llm_module.bound_body(response))
    plain = llm_module._http.Response(200, content=b"data: [DONE]\n\n")
    asyncio.run(llm_module.bound_body(plain))
    assert isinstance(plain.stream, llm_module._BoundedBody)


def test_a_server_that_stops_ends_the_turn_and_closes_the_chat_socket_with_1001(llm):
    """Shutdown (what SIGTERM does): the LLM stops at once and what it wrote is still spoken within the grace; the
    chat socket closes with 1001 like its session, not with uvicorn's 1012; one opened during the drain is refused."""
    llm.reply = LONG_REPLY
    try:
        with running_server(Limits(api_keys=("k",)), llm=LLMConfig(llm.url, "m")) as stopping:
            async def go():
                tts, session_id, chat, _ = await open_pair(stopping)
                await ask(chat, session_id, "r", "c")
                await until(chat, lambda e: e["type"] == "chat.delta")
                stopping.server.should_exit = True
                closing = asyncio.gather(events_until_closed(chat), events_until_closed(tts))
                while (await asyncio.to_thread(stopping.get, "/ready"))[0] == 200:
                    await asyncio.sleep(0.05)
                async with connect(chat_url(stopping)) as late:  # opened during the drain: refused, not missed
                    late_events, late_code = await events_until_closed(late)
                assert late_code == 1013 and late_events[-1]["code"] == "overloaded", late_events
                (chat_events, chat_code), (tts_events, tts_code) = await closing
                done = [e for e in chat_events if e["type"] == "chat.done"]
                assert chat_code == 1001 and len(done) == 1 and done[0]["reason"] == "cancelled", chat_events[-3:]
                assert tts_code == 1001 and tts_events[-1]["type"] == "session.closed"
                spoken = [e for e in tts_events if e["type"] in ("context.done", "context.cancelled")]
                assert len(spoken) == 1 and (spoken[0]["type"] == "context.cancelled" or spoken[0]["metrics"][
                    "text_chars"] == len(done[0]["text"]))
            asyncio.run(go())
    finally:
        llm.reply = REPLY
