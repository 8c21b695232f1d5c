"""A ready server's long-lived objects are out of the garbage collector's way (engine/serving/heap.py): a full
collection would otherwise walk the whole model and engine while every stream waits."""
import gc
import json
import socket
import weakref

from tests.gateway_server import running_server


def test_a_ready_server_freezes_its_long_lived_objects_and_thaws_them_when_it_stops():
    with running_server():
        assert gc.get_freeze_count() > 10_000

        class Node:
            """A cycle made after the freeze: a full collection must still free it."""

        cycle = Node()
        cycle.self = cycle
        freed = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert freed() is None
        # The collection left the frozen objects frozen (the server thread may free a few of them meanwhile, which
        # lowers the count: only a thaw would empty it).
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0


def test_a_storm_of_long_lived_objects_sets_off_no_full_collection_while_serving():
    """A storm of sessions makes objects that live on: under the default thresholds they were promoted fast enough
    to set off full collections, each walking every live session with the loop stopped (engine/serving/heap.py).
    The collections that do run are timed in /metrics."""
    default = gc.get_threshold()
    collected: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collected.append(info["generation"])

    with running_server() as server:
        gc.callbacks.append(count)
        try:
            storm = [[index] for index in range(150_000)]  # ~512 sessions' worth, all alive (lists stay tracked)
        finally:
            gc.callbacks.remove(count)
        assert len(storm) == 150_000
        assert 0 < collected.count(0) and 2 not in collected, collected
        _, body = server.get("/metrics")  # each collection is timed there: it stopped the server's event loop
        timed = {line.split()[0]: float(line.split()[1]) for line in body.decode().splitlines()
                 if line.startswith("voxgate_gc_pause_seconds_count")}
        assert timed.get('voxgate_gc_pause_seconds_count{generation="0"}', 0) >= collected.count(0), timed
    assert gc.get_threshold() == default  # a stopped server leaves the process as it found it


def test_the_codecs_of_finished_responses_are_collected_within_a_few_dozen_requests():
    """A container response's FFmpeg objects sit in reference cycles inside PyAV, each holding ~0.3 MB of native
    buffers the collector does not see: only a collection frees them. With a young threshold of 50,000 they lived
    through 1M allocations (the server's memory grew 117 MB over 400 streamed mp3 requests); the serving thresholds
    collect them within a few dozen requests."""
    with running_server() as server:
        port = int(server.http.rsplit(":", 1)[1])
        body = json.dumps({"input": "Some words.", "response_format": "mp3", "stream": True}).encode()
        for _ in range(80):
            with socket.create_connection(("127.0.0.1", port)) as client:  # the first bytes, then it leaves
                client.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                assert client.recv(100)
        alive = sum(type(thing).__name__ == "AudioCodecContext" for thing in gc.get_objects())
        assert alive < 40, alive
