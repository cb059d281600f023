"""KVPool.ensure's batched page-table write against the one-page-at-a-time rule it
replaced (pages popped from the free list in order, ``page_table[row, k]`` = the row's
k-th page), over random ensure / release cycles."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from ppspec.stage_server.pools import KVPool, PoolExhaustedError


def _ensure_per_page(pool: KVPool, rows, lengths) -> None:
    need = pool.pages_needed(rows, lengths)
    if sum(need) > len(pool.free_pages):
        raise PoolExhaustedError("exhausted")
    for row, k in zip(rows, need):
        have = pool.row_pages.setdefault(row, [])
        for _ in range(k):
            page = pool.free_pages.pop()
            pool.page_table[row, len(have)] = page
            pool.refs[page] = 1  # one holder: the row
            have.append(page)


def test_ensure_matches_per_page_writes():
    rng = random.Random(0)
    for _ in range(100):
        ps, R = rng.choice([1, 4, 16]), rng.randint(1, 6)
        pool = KVPool(1, R, rng.randint(1, 150), ps, 1, 2, rng.randint(ps, 100), torch.float32, "cpu")
        ref = copy.deepcopy(pool)
        for _ in range(15):
            if rng.random() < 0.25:
                r = rng.randrange(R)
                pool.release(r)
                ref.release(r)
                continue
            rows = rng.sample(range(R), rng.randint(1, R))  # distinct, as the stage sends them
            lens = [rng.choice([0, rng.randint(0, pool.max_pages_per_row * ps)]) for _ in rows]
            errs = []
            for p, fn in ((pool, KVPool.ensure), (ref, _ensure_per_page)):
                try:
                    fn(p, rows, lens)
                    errs.append(None)
                except PoolExhaustedError:
                    errs.append(PoolExhaustedError)
            assert errs[0] == errs[1]
            assert pool.free_pages == ref.free_pages and pool.row_pages == ref.row_pages, (rows, lens)
            assert torch.equal(pool.page_table, ref.page_table)
            for r, s in zip(rows, lens) if errs[0] is None else ():  # a row ensured for s tokens has their slots
                assert len(pool.slot_list([r], list(range(s)))) == s


def test_ensure_of_zero_tokens_registers_the_row():
    """A row ensured for no tokens has (no) slots, as before the batched write."""
    pool = KVPool(1, 4, 64, 16, 1, 2, 64, torch.float32, "cpu")
    pool.ensure([2], [0])
    assert pool.slot_list([2], []) == []
    pool.ensure([1, 3], [0, 17])
    assert pool.slot_list([1, 3], []) == [] and len(pool.slot_list([3], list(range(17)))) == 17


def test_exhausted_ensure_takes_nothing():
    pool = KVPool(1, 4, 64, 16, 1, 2, 64, torch.float32, "cpu")  # 4 pages
    pool.ensure([0], [20])
    before = (list(pool.free_pages), copy.deepcopy(pool.row_pages), pool.page_table.clone())
    with pytest.raises(PoolExhaustedError):
        pool.ensure([1, 2], [16, 33])
    assert (pool.free_pages, pool.row_pages) == before[:2] and torch.equal(pool.page_table, before[2])


def _slot_ref(pool: KVPool, row: int, p: int) -> int:
    """Position p of a row by the definition: its (p // page_size)-th page, offset p % page_size."""
    return pool.row_pages[row][p // pool.page_size] * pool.page_size + p % pool.page_size


def test_slot_list_and_device_layout_match_the_rows_pages():
    """The host's slot_list and the device layout a CUDA graph computes
    (kernels.paging.paged_layout, its torch reference here) give every token the slot of
    its row's pages, over random pools, batches and D; padding rows land in the padding page."""
    from ppspec.kernels.paging import paged_layout

    rng = random.Random(1)
    for _ in range(60):
        ps, R, D = rng.choice([1, 4, 16]), rng.randint(1, 8), rng.choice([1, 2, 4])
        ctx = rng.randint(D, 80)
        pool = KVPool(1, R, R * ctx + ps * R, ps, 1, 2, ctx, torch.float32, "cpu")
        rows = rng.sample(range(R), rng.randint(1, R))
        seq = [rng.randint(0, ctx - D) for _ in rows]
        pool.ensure(rows, [s + D for s in seq])
        positions = [s + j for s in seq for j in range(D)]
        want = [_slot_ref(pool, r, s + j) for r, s in zip(rows, seq) for j in range(D)]
        assert pool.slot_list(rows, positions) == want
        pad = rng.randint(0, 3)  # padding entries: the padding row at 0 cached tokens
        rows_t = torch.tensor(rows + [R] * pad)
        seq_t = torch.tensor(seq + [0] * pad)
        n = len(rows_t) * D
        slots, pos, kv_lens = (torch.full((k,), -1, dtype=torch.long) for k in (n, n, len(rows_t)))
        paged_layout(rows_t, seq_t, D, pool.page_table, ps, slots, pos, kv_lens)
        assert slots.tolist() == want + [pool.pad_slot(j) for _ in range(pad) for j in range(D)]
        assert pos.tolist() == positions + [j for _ in range(pad) for j in range(D)]
        assert kv_lens.tolist() == [s + D for s in seq] + [D] * pad


def test_paged_layout_refuses_shapes_that_do_not_fit():
    from ppspec.kernels.paging import paged_layout

    pt = torch.zeros(3, 4, dtype=torch.long)
    rows, seq = torch.tensor([0, 1]), torch.tensor([0, 5])
    slots = torch.full((4,), -1, dtype=torch.long)
    for bad in (dict(slots=torch.zeros(3, dtype=torch.long)), dict(slots=torch.zeros(4, dtype=torch.int32)),
                dict(positions=torch.zeros(4, dtype=torch.long)), dict(tokens_per_request=0),
                dict(rows=torch.tensor(0)), dict(slots=torch.zeros(8, dtype=torch.long)[::2]),
                dict(page_table=torch.zeros(4, 3, dtype=torch.long).t())):
        kw = dict(rows=rows, seq_lens=seq, tokens_per_request=2, page_table=pt, page_size=16, slots=slots) | bad
        with pytest.raises(ValueError):
            paged_layout(**kw)
    assert slots.tolist() == [-1] * 4  # nothing written


def test_paged_layout_refuses_rows_and_lengths_outside_the_page_table():
    """A row outside the page table, or D tokens past seq_lens beyond its width, raise
    IndexError before anything is written; bounds the host states (kernels.checks.known)
    are what is checked, so a stage's graphs read nothing from the device."""
    from ppspec.kernels.checks import known
    from ppspec.kernels.paging import paged_layout

    pt = torch.zeros(3, 4, dtype=torch.long)  # 3 rows of 4 pages of 16 tokens: 64 positions
    slots = torch.full((4,), -1, dtype=torch.long)
    for rows, seq in (([0, 3], [0, 0]), ([0, -1], [0, 0]), ([0, 1], [0, 63]), ([0, 1], [-1, 0])):
        with pytest.raises(IndexError):
            paged_layout(torch.tensor(rows), torch.tensor(seq), 2, pt, 16, slots)
        assert slots.tolist() == [-1] * 4
    paged_layout(torch.tensor([0, 2]), torch.tensor([0, 62]), 2, pt, 16, slots)  # the last positions fit
    assert slots.tolist() == [0, 1, 14, 15]
    # stated bounds stand in for the values: a wider stated bound is refused as such
    rows, seq = torch.tensor([0, 1]), known(torch.tensor([0, 5]), min=0, max=63)
    with pytest.raises(IndexError, match=r"seq_lens in \[0, 63\]"):
        paged_layout(rows, seq, 2, pt, 16, slots)
