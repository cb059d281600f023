"""On CUDA the prefix cache's snapshot calls make no host sync (``torch.cuda`` sync debug
mode set to raise: a read-back, or a copy from pageable host memory that waits for the
stream, fails the test), with the replay design's Triton flush, and move the same state and
KV pages as the same calls on the CPU (stage_server/snapshots.py)."""
import pytest
import torch

from ppspec.stage_server.pools import KVPool, StatePool
from ppspec.stage_server.snapshots import SnapshotPool

pytestmark = pytest.mark.gpu

LAYERS, ROWS, PAGE = 3, 16, 4


def _stage(device: str):
    gen = torch.Generator().manual_seed(0)
    st = StatePool(LAYERS, ROWS, 2, 16, 16, 24, 4, 3, torch.float32, device, commit_design="replay")
    for t in st.state.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    kvs = [KVPool(2, ROWS, 512, PAGE, 1, 16, 256, torch.float32, device),
           KVPool(1, ROWS, 512, PAGE, 1, 16, 256, torch.float32, device)]
    for kv in kvs:
        kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
        kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    return st, kvs, SnapshotPool(8, st, kvs)


def _calls(device: str, strict: bool):
    st, kvs, pool = _stage(device)
    src, dst, lens = [0, 3, 5], [9, 10, 11], [6, 9, 13]
    for kv in kvs:
        kv.ensure(src, lens)
    torch.cuda.synchronize()
    if strict:
        torch.cuda.set_sync_debug_mode("error")
    try:
        pool.take(src[:2], [0, 1], lens[:2], pending=False)  # after a prefill chunk
        pool.take(src[2:], [2], lens[2:])  # a finished row: the flush first
        pool.restore(dst, [0, 1, 2])
        pool.drop([1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return ({k: t[:, dst].cpu() for k, t in st.state.items()},
            [(kv.k.cpu(), kv.v.cpu(), kv.page_table.cpu(), dict(kv.row_pages)) for kv in kvs])


def test_snapshot_calls_make_no_host_sync_and_match_the_cpu():
    _calls("cuda", strict=False)  # first use: Triton compiles, the pinned allocator's first block
    state, kv = _calls("cuda", strict=True)
    ref_state, ref_kv = _calls("cpu", strict=False)
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k])
    for (k, v, table, pages), (rk, rv, rtable, rpages) in zip(kv, ref_kv):
        assert pages == rpages and torch.equal(table, rtable)
        assert torch.equal(k, rk) and torch.equal(v, rv)
