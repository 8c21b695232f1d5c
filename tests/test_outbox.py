"""A session's send queue (realtime/ws/outbox.py): urgent items (pongs, a fatal error) go ahead of the audio
queued, and among themselves in the order they were put: five pings are answered 0, 1, 2, 3, 4."""
from __future__ import annotations

import asyncio
from collections import deque

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
                outbox.put(Outgoing([name], context, audio_ms=20.0 if operation == "audio" else 0.0),
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
