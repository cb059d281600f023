"""Plain-torch paged layout (the reference of the Triton kernel beside it)."""
from __future__ import annotations

import torch


def paged_layout_ref(rows, seq_lens, D, page_table, page_size, slots, positions=None, kv_lens=None) -> None:
    """:func:`ppspec.kernels.paging.paged_layout` in torch ops (same arguments, in place)."""
    pos = (seq_lens[:, None] + torch.arange(D, device=seq_lens.device)).reshape(-1)
    tok_rows = rows.repeat_interleave(D)
    slots.copy_(page_table[tok_rows, pos // page_size] * page_size + pos % page_size)
    if positions is not None:
        positions.copy_(pos)
    if kv_lens is not None:
        kv_lens.copy_(seq_lens + D)
