"""A ready server's long-lived objects are out of the garbage collector's way (engine/serving/heap.py): a full
collection would otherwise walk the whole model and engine while every stream waits."""
import gc

from tests.gateway_server import running_server


def test_a_ready_server_freezes_its_long_lived_objects_and_thaws_them_when_it_stops():
    with running_server():
        assert gc.get_freeze_count() > 10_000
        frozen = gc.get_freeze_count()
        garbage = [[]]
        garbage[0].append(garbage)  # a cycle made after the freeze is still collected
        del garbage
        assert gc.collect() >= 1 and gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0
