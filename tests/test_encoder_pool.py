"""The encoder pool: each stream's frames, from real worker processes and the real libopus, are exactly what a
`StreamEncoder` in this process gives for the same pieces, however streams interleave across workers; a worker that
dies fails its streams' calls with `EncoderFailed` and is replaced."""
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from realtime.audio.encoder_pool import EncoderFailed, EncoderPool
from realtime.audio.encoder_worker import (
    CLOSE,
    ENCODE,
    FAILED,
    HEADER,
    OK,
    OPEN,
    OPEN_CONTINUING,
    Worker,
    first_audio_first,
    pack_frames,
)
from realtime.audio.encoders import StreamEncoder
from realtime.audio.formats import FRAME_MS, SAMPLE_RATES, AudioFormat, UnsupportedFormat

FORMATS = [AudioFormat(encoding, rate, frame_ms) for encoding in SAMPLE_RATES for rate in SAMPLE_RATES[encoding]
           for frame_ms in FRAME_MS[encoding][:2]]


@contextlib.asynccontextmanager
async def running_pool(workers: int) -> AsyncIterator[EncoderPool]:
    pool = EncoderPool(workers)
    await pool.start()
    try:
        yield pool
    finally:
        await pool.stop()


def speech_like(seed: int, samples: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / 24000
    return (0.3 * np.sin(2 * np.pi * rng.uniform(100, 400) * t) + 0.05 * rng.standard_normal(samples)).astype(
        np.float32)


def local(fmt: AudioFormat, pieces: list[np.ndarray], whole_frame: bool) -> list[tuple[bytes, int, int]]:
    encoder = StreamEncoder(fmt)
    frames = [f for piece in pieces for f in encoder.encode(piece)] + encoder.finish(whole_frame)
    return [(f.payload, f.pts, f.samples) for f in frames]


async def pooled(pool: EncoderPool, fmt: AudioFormat, pieces: list[np.ndarray],
                 whole_frame: bool) -> list[tuple[bytes, int, int]]:
    encoder = pool.open(fmt)
    frames = []
    for piece in pieces:
        frames += await encoder.encode(piece)
        await asyncio.sleep(0)  # let the other streams' calls in between
    frames += await encoder.finish(whole_frame)
    return [(f.payload, f.pts, f.samples) for f in frames]


streams = st.lists(st.tuples(st.sampled_from(FORMATS), st.lists(st.integers(0, 4000), max_size=8), st.booleans(),
                             st.integers(0, 2**16)), min_size=1, max_size=6)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams)
def test_pooled_streams_equal_local_encoders(cases) -> None:
    async def run() -> list:
        async with running_pool(2) as pool:
            return await asyncio.gather(*(pooled(pool, fmt, pieces, whole) for fmt, pieces, whole in inputs))

    inputs = [(fmt, np.split(speech_like(seed, sum(sizes)), np.cumsum(sizes)[:-1]) if sizes else [], whole)
              for fmt, sizes, whole, seed in cases]
    assert asyncio.run(run()) == [local(fmt, pieces, whole) for fmt, pieces, whole in inputs]


def test_streams_spread_over_the_workers_and_close_frees_them() -> None:
    async def run() -> None:
        async with running_pool(3) as pool:
            encoders = [pool.open(AudioFormat()) for _ in range(6)]
            assert sorted(w.streams for w in pool._workers) == [2, 2, 2]
            await encoders[0].encode(speech_like(0, 4800))
            encoders[0].close()
            await encoders[1].finish()
            assert sum(w.streams for w in pool._workers) == 4
            with pytest.raises(EncoderFailed):
                await encoders[0].encode(speech_like(0, 480))
            assert await encoders[1].finish() == []

    asyncio.run(run())


def test_a_dead_worker_fails_its_streams_and_is_replaced() -> None:
    async def run() -> None:
        async with running_pool(1) as pool:
            encoder = pool.open(AudioFormat())
            await encoder.encode(speech_like(1, 2400))
            victim = pool._workers[0]
            victim.transport.send_signal(signal.SIGKILL)
            with pytest.raises(EncoderFailed, match="ended"):
                await encoder.encode(speech_like(1, 2400))
            for _ in range(100):  # replaced as it died, no stream opened meanwhile (a hostile try: the first one
                await asyncio.sleep(0.05)  # opened after the crash started the replacement and was refused)
                if pool._workers[0] is not victim:
                    break
            assert pool._workers[0] is not victim
            fresh = pool.open(AudioFormat("pcm_s16le"))
            frames = await fresh.encode(speech_like(2, 960))
            assert [f.samples for f in frames] == [480, 480]

    asyncio.run(run())


def test_a_bad_format_is_refused_before_it_reaches_a_worker() -> None:
    async def run() -> None:
        async with running_pool(1) as pool:
            with pytest.raises(UnsupportedFormat):
                pool.open(AudioFormat("opus", 44100))

    asyncio.run(run())


def test_worker_refuses_a_call_for_a_stream_it_does_not_hold() -> None:
    worker = Worker()
    assert worker.handle(7, ENCODE, b"\0" * 8)[0] == FAILED
    assert worker.handle(7, OPEN, b"{\"encoding\": \"opus\", \"sample_rate\": 44100}") is None  # refused: not held
    assert worker.handle(7, ENCODE, b"\0" * 8)[0] == FAILED
    assert worker.handle(7, CLOSE, b"") is None


def test_workers_outlive_the_signals_a_shutdown_sends_the_process_group() -> None:
    """Ctrl-C reaches every process of the group; the gateway then drains its sessions, so its encoders must still
    answer: they leave when the pool closes their pipes."""
    async def run() -> list:
        async with running_pool(1) as pool:
            encoder = pool.open(AudioFormat("pcm_s16le"))
            await encoder.encode(speech_like(3, 480))  # the worker is up
            assert os.getpgid(pool._workers[0].pid) != os.getpgrp()  # a Ctrl-C on the terminal misses it
            for sig in (signal.SIGINT, signal.SIGTERM):  # a service manager signals every process all the same
                pool._workers[0].transport.send_signal(sig)
            await asyncio.sleep(0.3)
            return await encoder.encode(speech_like(3, 960))

    assert [f.samples for f in asyncio.run(run())] == [480, 480]


def test_a_worker_answers_a_new_streams_first_audio_ahead_of_calls_waiting_before_it():
    """A real worker process given, in one write, three chunks of a stream already speaking and then a new stream's
    first chunk: the new stream's answer comes first (its time to first audio), each stream's answers in order."""
    def call(stream: int, op: int, payload: bytes = b"") -> bytes:
        return HEADER.pack(stream, op, len(payload)) + payload

    def answer(pipe) -> tuple[int, int, bytes]:
        stream, status, length = HEADER.unpack(pipe.read(HEADER.size))
        return stream, status, pipe.read(length)

    opus = json.dumps(asdict(AudioFormat())).encode()
    chunk = speech_like(1, 1920).tobytes()
    worker = subprocess.Popen([sys.executable, "-m", "realtime.audio.encoder_worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        worker.stdin.write(call(1, OPEN, opus) + call(1, ENCODE, chunk))
        worker.stdin.flush()
        assert answer(worker.stdout)[:2] == (1, OK)  # stream 1 speaks
        worker.stdin.write(b"".join(call(1, ENCODE, speech_like(seed, 1920).tobytes()) for seed in (2, 3, 4))
                           + call(2, OPEN, opus) + call(2, ENCODE, chunk))
        worker.stdin.flush()
        answers = [answer(worker.stdout) for _ in range(4)]
    finally:
        worker.stdin.close()
        worker.wait(10)
    assert [stream for stream, _, _ in answers] == [2, 1, 1, 1]
    expected = StreamEncoder(AudioFormat())
    expected.encode(speech_like(1, 1920))
    for (_, status, payload), seed in zip(answers[1:], (2, 3, 4)):  # stream 1's, in its order
        assert status == OK and payload == pack_frames(expected.encode(speech_like(seed, 1920)))


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(st.integers(0, 5), st.sampled_from([ENCODE, CLOSE])), max_size=30),
       started=st.sets(st.integers(0, 5)))
def test_first_audio_first_keeps_each_streams_order(calls, started):
    """Streams that have given out audio go after those that have not; within a stream, the calls keep their order."""
    worker = Worker()
    for stream in started:
        worker.encoders[stream] = StreamEncoder(AudioFormat())
        worker.encoders[stream].encode(speech_like(stream, 1920))
    numbered = [(stream, op, index.to_bytes(2, "big")) for index, (stream, op) in enumerate(calls)]
    ordered = first_audio_first(numbered, worker)
    assert sorted(ordered) == sorted(numbered)
    keys = [stream in started for stream, _, _ in ordered]
    assert keys == sorted(keys)
    for stream in range(6):
        assert [c for c in ordered if c[0] == stream] == [c for c in numbered if c[0] == stream]


def test_a_turns_calls_reach_the_worker_together_so_a_new_streams_first_audio_goes_first():
    """Calls made in one turn of the event loop are written to their worker in one go: a chunk for a stream already
    speaking and, after it, a new stream's first chunk reach the worker together, and the new stream is answered
    first."""
    async def go() -> tuple[list[str], list[int]]:
        async with running_pool(1) as pool:
            speaking = pool.open(AudioFormat())
            await speaking.encode(speech_like(1, 1920))
            new = pool.open(AudioFormat())
            await asyncio.sleep(0)  # a turn of its own for the new stream's OPEN
            pipe = pool._workers[0].transport.get_pipe_transport(0)
            writes, write = [], pipe.write
            pipe.write = lambda data: (writes.append(len(data)), write(data))
            answered: list[str] = []
            calls = {"speaking": asyncio.ensure_future(speaking.encode(speech_like(2, 1920 * 2))),
                     "new": asyncio.ensure_future(new.encode(speech_like(3, 1920)))}  # both in the next turn
            for name, call in calls.items():
                call.add_done_callback(lambda _, name=name: answered.append(name))
            await asyncio.gather(*calls.values())
            return answered, writes
    answered, writes = asyncio.run(go())
    assert writes == [2 * HEADER.size + 4 * 1920 * 3]  # one write: both calls' headers and float32 samples
    assert answered == ["new", "speaking"]


def test_a_contexts_encoder_after_a_flush_does_not_count_as_first_audio():
    """A flush or mark starts a fresh encoder stream for the context (`AudioFramer.restart`): once the context's audio
    has begun, that stream is `OPEN_CONTINUING`, so a client flushing after every word does not put its chunks ahead
    of other streams' as first audio; a new context's first chunk still goes first."""
    from realtime.ws.framing import AudioFramer

    async def go() -> list[str]:
        async with running_pool(1) as pool:
            flushing = AudioFramer("c", 1, AudioFormat(), "binary", pool)
            flushing.outgoing(await flushing.encode(speech_like(1, 1920)), last=False, on_first_sent=lambda: None)
            await flushing.finish(whole_frame=True)
            flushing.restart()
            fresh = AudioFramer("d", 2, AudioFormat(), "binary", pool)
            await asyncio.sleep(0)  # the OPENs go in a turn of their own
            answered: list[str] = []
            calls = {"flushing": asyncio.ensure_future(flushing.encode(speech_like(2, 1920))),
                     "fresh": asyncio.ensure_future(fresh.encode(speech_like(3, 1920)))}
            for name, call in calls.items():
                call.add_done_callback(lambda _, name=name: answered.append(name))
            await asyncio.gather(*calls.values())
            return answered
    assert asyncio.run(go()) == ["fresh", "flushing"]


def test_a_continuing_stream_has_begun_before_its_first_frame():
    fmt = json.dumps(asdict(AudioFormat())).encode()
    worker = Worker()
    worker.handle(1, OPEN, fmt)
    worker.handle(2, OPEN_CONTINUING, fmt)
    assert not worker.started(1) and worker.started(2)
    calls = [(2, ENCODE, b"x"), (1, ENCODE, b"y")]
    assert first_audio_first(calls, worker) == [(1, ENCODE, b"y"), (2, ENCODE, b"x")]
    worker.handle(2, CLOSE, b"")
    assert not worker.started(2) and 2 not in worker.continuing


def test_a_stream_opened_continuing_in_the_same_batch_has_begun_too():
    fmt = json.dumps(asdict(AudioFormat())).encode()
    calls = [(2, OPEN_CONTINUING, fmt), (3, OPEN, fmt), (2, ENCODE, b"x"), (3, ENCODE, b"y")]
    assert [c[0] for c in first_audio_first(calls, Worker())] == [3, 3, 2, 2]


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.tuples(st.integers(0, 2**40), st.integers(1, 5), st.binary(max_size=9000)), max_size=12),
       cuts=st.lists(st.integers(1, 5000), max_size=12))
def test_the_calls_read_from_a_pipe_in_any_pieces_are_the_calls_written(calls, cuts):
    """`Calls.read` on a real pipe written in arbitrary pieces (headers and payloads split anywhere): every call comes
    out whole, in order, and the end of the input is None."""
    import threading

    from realtime.audio.encoder_worker import Calls

    data = b"".join(HEADER.pack(stream, op, len(payload)) + payload for stream, op, payload in calls)
    read_end, write_end = os.pipe()

    def write() -> None:
        at = 0
        for cut in cuts:
            os.write(write_end, data[at:at + cut])
            at += cut
        os.write(write_end, data[at:])
        os.close(write_end)
    writer = threading.Thread(target=write)
    writer.start()
    got, reader = [], Calls(read_end)
    try:
        while (batch := reader.read()) is not None:
            assert batch
            got += batch
    finally:
        writer.join()
        os.close(read_end)
    assert got == calls


def test_the_pipe_to_a_worker_holds_a_bursts_calls():
    """A loop turn's calls to a worker in a burst (~250 KB) fit its pipe, so they reach it in one piece (Linux)."""
    import fcntl

    async def size() -> int:
        async with running_pool(1) as pool:
            pipe = pool._workers[0].transport.get_pipe_transport(0).get_extra_info("pipe")
            return fcntl.fcntl(pipe.fileno(), fcntl.F_GETPIPE_SZ)
    if not hasattr(fcntl, "F_GETPIPE_SZ"):
        pytest.skip("the pipe's size is Linux's")
    assert asyncio.run(size()) >= 256 * 1024
