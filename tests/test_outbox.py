"""A session's send queue (realtime/ws/outbox.py): urgent items (pongs, a fatal error) go ahead of the audio
queued, and among themselves in the order they were put: five pings are answered 0, 1, 2, 3, 4."""
from __future__ import annotations

import asyncio
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realtime.ws.outbox import Outbox, Outgoing

OPERATIONS = st.lists(st.sampled_from(["audio", "urgent", "get", "drop"]), max_size=60)


@settings(max_examples=300, deadline=None)
@given(operations=OPERATIONS)
def test_urgent_items_go_first_in_their_own_order(operations):
    async def run() -> tuple[list[str], list[str]]:
        outbox, urgent, normal, got, expected = Outbox(), deque(), deque(), [], []
        for number, operation in enumerate(operations):
            name = f"{operation}{number}"
            if operation in ("audio", "urgent"):
                context = "c" if number % 2 else "d"
                outbox.put(Outgoing([name], context, [20.0] if operation == "audio" else None),
                           urgent=operation == "urgent")
                (urgent if operation == "urgent" else normal).append((name, context))
            elif operation == "drop":  # a cancel: context c's unsent items go, the order of the rest stays
                outbox.drop("c")
                urgent = deque(item for item in urgent if item[1] != "c")
                normal = deque(item for item in normal if item[1] != "c")
            elif urgent or normal:
                got.append((await outbox.get()).messages[0])
                expected.append((urgent or normal).popleft()[0])
        return got, expected

    got, expected = asyncio.run(run())
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(message_ms=st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=20),
       urgent=st.integers(0, 3), behind=st.integers(0, 3))
def test_a_chunk_sent_a_message_at_a_time_keeps_its_place_and_a_cancel_drops_the_rest(message_ms, urgent, behind):
    """The sender on a paused socket sends one message of a chunk and puts the rest back (`split_first`,
    `put_back`): the rest goes next behind urgent items only, the audio queued is the rest's, and a cancel of its
    context drops it (before, the whole chunk left after the cancel)."""
    async def run() -> tuple[list, float, float, list]:
        outbox = Outbox()
        chunk = Outgoing([f"m{i}" for i in range(len(message_ms))], "c", list(message_ms), on_sent=print)
        outbox.put(chunk)
        for number in range(behind):
            outbox.put(Outgoing([f"later{number}"], "d", [20.0]))
        taken = await outbox.get()
        first, rest = taken.split_first()
        assert first.messages == ["m0"] and first.audio_ms == message_ms[0] and first.on_sent is print
        assert (rest is None) == (len(message_ms) == 1)
        if rest is not None:
            assert rest.messages == chunk.messages[1:] and rest.on_sent is None
            outbox.put_back(rest)
        for number in range(urgent):
            outbox.put(Outgoing([f"pong{number}"]), urgent=True)
        queued = outbox.queued_ms
        dropped = outbox.drop("c")
        return [(await outbox.get()).messages[0] for _ in range(len(outbox))], queued, dropped, message_ms
    order, queued, dropped, ms = asyncio.run(run())
    assert queued == pytest.approx(sum(ms[1:]) + 20.0 * behind)
    assert dropped == pytest.approx(sum(ms[1:]))
    assert order == [f"pong{n}" for n in range(urgent)] + [f"later{n}" for n in range(behind)]


def test_the_rest_of_a_chunk_goes_before_what_was_queued_after_it():
    async def run() -> list[str]:
        outbox = Outbox()
        outbox.put(Outgoing(["a0", "a1", "a2"], "c", [20.0] * 3))
        outbox.put(Outgoing(["later"], "d", [20.0]))
        _, rest = (await outbox.get()).split_first()
        outbox.put_back(rest)
        outbox.put(Outgoing(["pong"]), urgent=True)
        return [message for _ in range(len(outbox)) for message in (await outbox.get()).messages]
    assert asyncio.run(run()) == ["pong", "a1", "a2", "later"]
