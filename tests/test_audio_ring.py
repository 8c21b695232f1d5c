"""The engine process's audio path: the shared-memory ring gives the reader exactly what was put, a message whose
samples would overwrite some not yet taken carries them itself, and the bulk reader of the pipe gives every message
`Connection.send` sent, in order, however the bytes arrive; the writer's messages reach `Connection.recv` (the
child's end) in order, however many wait for room in the pipe."""
import asyncio
import multiprocessing
import os
import pickle
import struct
import threading
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.request import AudioChunk, Finished
from engine.serving.audio_ring import ALIGN, AudioRing, RingSlice
from engine.serving.process_engine import MessageReader, MessageWriter


def padded(place: RingSlice) -> int:
    """The bytes a message's samples take in the ring."""
    return -(-place.count * 4 // ALIGN) * ALIGN


@settings(max_examples=60, deadline=None)
@given(messages=st.lists(st.lists(st.integers(0, 300), max_size=4), min_size=1, max_size=40),
       lags=st.lists(st.integers(0, 6), min_size=1), capacity=st.sampled_from([ALIGN * 8, ALIGN * 21, ALIGN * 64]))
def test_the_reader_gets_every_chunk_as_put_and_samples_without_room_stay_in_the_message(messages, lags, capacity):
    parent = AudioRing.create(capacity)
    child = AudioRing.attach(parent.name)
    rng = np.random.default_rng(len(messages))
    unread: deque[tuple[list, RingSlice | None, list]] = deque()
    try:
        for index, sizes in enumerate(messages):
            chunks = [AudioChunk(7, n, rng.standard_normal(size).astype(np.float32)) for n, size in enumerate(sizes)]
            events, place = child.outgoing([*chunks, Finished(7, "eos", index)])
            if place is not None:
                assert all(isinstance(e.samples, int) for e in events[:-1])
                placed = [p for _, p, _ in unread if p is not None] + [place]
                assert place.end - (placed[0].end - padded(placed[0])) <= capacity  # never more unread than it holds
            else:  # no room beside the unread samples (or nothing to place): they go as they are
                assert events[:-1] == chunks
                total = sum(sizes)
                assert not total or any(p is not None for _, p, _ in unread) or total * 4 > capacity // 2, \
                    "an empty ring refused a small message"
            unread.append((events, place, chunks))
            while len(unread) > lags[index % len(lags)]:  # the reader lags by up to a few messages
                events, place, chunks = unread.popleft()
                received = events if place is None else parent.incoming(events, place)  # as the reader does
                assert received[-1] == events[-1]
                for got, sent in zip(received, chunks):
                    assert (got.request_id, got.start_sample) == (sent.request_id, sent.start_sample)
                    np.testing.assert_array_equal(got.samples, sent.samples)
    finally:
        child.close()
        parent.close()


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 5, 300, 20_000, 70_000]), min_size=1, max_size=12),
       chunk=st.sampled_from([1, 7, 4096, 1 << 20]))
def test_the_bulk_reader_gives_every_message_in_order(sizes, chunk):
    receiving, sending = multiprocessing.Pipe()
    os.set_blocking(receiving.fileno(), False)  # as the event loop reads it
    sent = [("publish", index, b"x" * size) for index, size in enumerate(sizes)]
    reader, received = MessageReader(receiving, chunk), []
    try:
        for message in sent:  # each one read before the next is sent: the pipe's buffer never has to hold them all
            sending.send(message)
            while len(received) < sent.index(message) + 1:
                received += reader.feed()
        assert received == sent
    finally:
        sending.close()
        receiving.close()


def test_the_bulk_reader_takes_many_waiting_messages_long_headers_and_refuses_a_cut_message():
    receiving, sending = multiprocessing.Pipe()
    os.set_blocking(receiving.fileno(), False)  # as the event loop reads it
    reader = MessageReader(receiving)
    try:
        sent = [("step_done", index, b"y" * index) for index in range(50)]  # all waiting before the first read
        for message in sent:
            sending.send(message)
        assert reader.feed() == sent  # one call took them all
        body = pickle.dumps(("publish", [], None))  # the header of a message over 2 GB: -1, then 8 bytes of length
        os.write(sending.fileno(), struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body)
        assert reader.feed() == [("publish", [], None)]
        assert reader.feed() == []  # nothing waiting
        big = [("publish", index, b"z" * 20_000) for index in range(3)]  # many reads of 4 KB
        for message in big:
            sending.send(message)
        assert MessageReader(receiving, chunk_bytes=4096).feed() == big  # read on until nothing waits
        os.write(sending.fileno(), struct.pack("!i", 100) + b"cut short")
        assert reader.feed() == []  # not a whole message yet
        sending.close()
        with pytest.raises(EOFError):
            reader.feed()
    finally:
        receiving.close()


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 5, 300, 20_000, 70_000, 300_000]), min_size=1, max_size=12))
def test_the_writer_sends_every_message_in_order_however_much_waits_for_room(sizes):
    """All sent before the other end reads any: more than the socket buffer holds waits on the loop for room."""
    sent = [("append", index, "x" * size) for index, size in enumerate(sizes)]
    received: list = []

    async def main() -> None:
        writing, reading = multiprocessing.Pipe()
        os.set_blocking(writing.fileno(), False)  # as the front end's end is
        writer = MessageWriter(writing, asyncio.get_running_loop())
        try:
            for message in sent:
                writer.send(message)
            with pytest.raises(TypeError):
                writer.send(("submit", 0, threading.Lock()))  # cannot be pickled: refused, nothing queued
            child = threading.Thread(target=lambda: received.extend(reading.recv() for _ in sent), daemon=True)
            child.start()
            await asyncio.to_thread(child.join, 20)
            assert not writer.pending
        finally:
            writer.close()
            writing.close()
            reading.close()

    asyncio.run(main())
    assert received == sent
