"""CUDA graph capture (``stage_server.graphs.record``) on the GPU."""
import gc
import weakref

import pytest
import torch

pytestmark = pytest.mark.gpu


class _Owner:
    """Holds a captured graph in a reference cycle: only the cyclic collector frees it, at a
    moment of its choosing (as an earlier ``LLM`` of the same process is freed)."""


def test_capture_while_garbage_owns_a_graph():
    """make test-gpu on a cold Triton cache failed twice in ``StageRunner``'s captures
    ("operation failed due to a previous error during capture", CUDA warnings "operation not
    permitted when stream is capturing (function reset)"): a collection inside the capture
    freed an earlier test's graphs. Here a cycle owning a graph becomes garbage while
    another graph is captured, and the capture makes enough objects to trigger collections
    of the young generations; the collector must not run there, the capture must succeed
    and replay right, and the old graph is freed after it."""
    from ppspec.stage_server.graphs import record

    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    x = torch.zeros(8, device="cuda")
    old = [record(lambda: x.add_(1))[0]]
    owner = _Owner()  # young: created after the capture above
    owner.me, owner.graph = owner, old.pop()
    alive, hold = weakref.ref(owner), [owner]
    del owner
    during = []

    def body():
        if torch.cuda.is_current_stream_capturing() and hold:
            hold.clear()  # the cycle is garbage from here on, while this stream captures
            before = gc.get_stats()[0]["collections"]
            junk = [[i] for i in range(200_000)]  # ~100 young collections' worth of objects
            during.append(gc.get_stats()[0]["collections"] - before)
            del junk
        return x * 2

    g, out, _ = record(body)
    assert during == [0], "the garbage collector ran inside a capture"
    assert alive() is not None  # not freed inside the capture
    gc.collect()
    assert alive() is None  # freed now, outside any capture
    x.fill_(3.0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 6.0))
