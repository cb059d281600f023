"""``ppspec.heap.freeze_startup_heap``: startup garbage collected first, what lives frozen.

Every serving process calls it once before it serves (the HTTP server, the engine
process, each stage); ``tests/test_pipeline.py::test_serve_sigterm_ends_open_requests_with_a_message``
checks that each of them reports a frozen heap at start."""
import gc
import weakref

from ppspec.heap import freeze_startup_heap


class _Node:
    def __init__(self):
        self.other = None


def test_freeze_collects_the_startup_garbage_then_freezes_what_lives():
    garbage_a, garbage_b = _Node(), _Node()
    garbage_a.other, garbage_b.other = garbage_b, garbage_a  # a cycle: only the collector frees it
    dead = weakref.ref(garbage_a)
    del garbage_a, garbage_b
    kept = _Node()
    kept.other = kept  # alive, in a cycle of its own
    assert dead() is not None and gc.get_freeze_count() == 0
    try:
        frozen = freeze_startup_heap("test")
        assert dead() is None  # collected before the freeze, not kept in the permanent generation
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # out of every generation a pass walks
        after = _Node()
        assert any(o is after for o in gc.get_objects())  # what comes later is collected as before
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_no_gc_freeze_collects_and_freezes_nothing():
    gc.disable()  # no automatic pass in between: only a collect() of the function frees the cycle
    try:
        garbage = _Node()
        garbage.other = garbage
        dead = weakref.ref(garbage)
        del garbage
        assert freeze_startup_heap("test", enabled=False) == 0
        assert gc.get_freeze_count() == 0 and dead() is not None  # left to the collector's own passes
    finally:
        gc.enable()
    gc.collect()
    assert dead() is None
