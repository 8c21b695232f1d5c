"""A ready server's long-lived objects are out of the garbage collector's way (engine/serving/heap.py): a full
collection would otherwise walk the whole model and engine while every stream waits."""
import gc
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
