"""Triton paged layout: a decode or verify step's positions, KV lengths and KV slots in one
launch (the GPU path of ``naive.paged_layout_ref``).

A stage replays a CUDA graph per step; before this kernel its host built ~1400 ints of
layout per step at batch 64 with D = 4 (positions and slots through the row's page list)
while the device waited. One program lays out ``BLOCK`` tokens."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _paged_layout_kernel(rows, seq_lens, page_table, slots, positions, kv_lens, n_tok, s_pt,
                         D: tl.constexpr, PAGE: tl.constexpr, WRITE_POS: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n_tok
    b = o // D
    j = o % D
    row = tl.load(rows + b, mask=m, other=0)
    s = tl.load(seq_lens + b, mask=m, other=0)
    pos = s + j
    page = tl.load(page_table + row * s_pt + pos // PAGE, mask=m, other=0)
    tl.store(slots + o, page * PAGE + pos % PAGE, mask=m)
    if WRITE_POS:
        tl.store(positions + o, pos, mask=m)
        tl.store(kv_lens + b, s + D, mask=m & (j == 0))


def paged_layout_triton(rows, seq_lens, D, page_table, page_size, slots, positions=None, kv_lens=None) -> None:
    n_tok = rows.shape[0] * D
    if n_tok == 0:
        return
    write_pos = positions is not None
    BLOCK = min(1024, triton.next_power_of_2(n_tok))
    _paged_layout_kernel[(triton.cdiv(n_tok, BLOCK),)](
        rows, seq_lens, page_table, slots, positions if write_pos else slots, kv_lens if write_pos else slots,
        n_tok, page_table.stride(0), D=D, PAGE=page_size, WRITE_POS=write_pos, BLOCK=BLOCK, num_warps=4)
