"""The prefix cache's snapshot calls on a stage are a fixed handful of batched ops over all
layers and rows, with no device read (each would wait for the device on CUDA), and move
the right state and KV pages (stage_server/snapshots.py)."""
import pytest
import torch

from ppspec.bench.snapshot_ops import OpCounter
from ppspec.stage_server.pools import KVPool, StatePool
from ppspec.stage_server.snapshots import SnapshotPool

LAYERS, ROWS, PAGE = 3, 16, 4


def _stage(design: str):
    gen = torch.Generator().manual_seed(0)
    st = StatePool(LAYERS, ROWS, 2, 8, 8, 12, 4, 3, torch.float32, "cpu", commit_design=design)
    for t in st.state.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    kvs = [KVPool(2, ROWS, 512, PAGE, 1, 8, 256, torch.float32, "cpu"), KVPool(1, ROWS, 512, PAGE, 1, 8, 256,
                                                                              torch.float32, "cpu")]
    for kv in kvs:
        kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
        kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    return st, kvs, SnapshotPool(8, st, kvs)


def _counted(call) -> dict:
    with torch.inference_mode(), OpCounter() as c:
        call()
    return {k: n for k, n in c.counts.items() if k not in ("slice", "view", "lift_fresh")}


@pytest.mark.parametrize("design", ["copy", "replay"])
def test_take_and_restore_are_batched_without_device_reads(design):
    counts = {}
    for B in (1, 5):
        st, kvs, pool = _stage(design)
        src, dst, slots, lens = list(range(B)), list(range(8, 8 + B)), list(range(B)), [4 * b + 6 for b in range(B)]
        for kv in kvs:
            kv.ensure(src, lens)
        before = {k: t.clone() for k, t in st.state.items()}
        counts[B] = (_counted(lambda: pool.take(src, slots, lens, pending=False)),
                     _counted(lambda: pool.restore(dst, slots)))
        for k, t in st.state.items():  # the rows got the snapshot of the source rows
            assert torch.equal(t[:, dst], before[k][:, src])
        for kv in kvs:
            for s, d, n in zip(src, dst, lens):
                full = n // PAGE
                assert kv.row_pages[d][:full] == kv.row_pages[s][:full]  # whole pages shared
                own, orig = kv.row_pages[d][full], kv.row_pages[s][full]  # the partial one copied
                assert own != orig and torch.equal(kv.k[:, own], kv.k[:, orig]) and torch.equal(kv.v[:, own],
                                                                                                 kv.v[:, orig])
                assert kv.page_table[d, : full + 1].tolist() == kv.row_pages[d]
    n_state = len(st.state)
    take, restore = counts[1]
    # one gather and one scatter per state tensor, over every layer and row at once
    assert take == {"index": n_state, "index_put_": n_state}
    assert "item" not in restore and "_local_scalar_dense" not in restore
    # per KV pool: the partial pages' copy (k and v) and one page-table write; the state's
    # gathers and scatters; the replay design's reset of pending steps (an index_fill_)
    assert restore["index_put_"] == 3 * len(kvs) + n_state
    assert restore.get("index_fill_", 0) == (design == "replay")
    assert counts[5] == counts[1]  # the same ops for five rows as for one


def test_no_slot_no_work():
    st, kvs, pool = _stage("replay")
    for kv in kvs:
        kv.ensure([0, 1], [9, 9])
    assert _counted(lambda: pool.take([0, 1], [-1, -1], [9, 9])) == {}
    assert _counted(lambda: pool.restore([2, 3], [-1, -1])) == {}
    assert pool.used == 0 and all(kv.used_pages == 6 for kv in kvs)
