"""Where a decode or verify step's tokens go in a paged KV pool, computed on the device:
the Triton kernel for CUDA tensors, the plain-torch reference otherwise."""
from __future__ import annotations

import torch

from ..checks import check_rows, min_max
from ..dispatch import pick
from .naive import paged_layout_ref

__all__ = ["paged_layout"]


def paged_layout(rows: torch.Tensor, seq_lens: torch.Tensor, tokens_per_request: int, page_table: torch.Tensor,
                 page_size: int, slots: torch.Tensor, positions: torch.Tensor | None = None,
                 kv_lens: torch.Tensor | None = None) -> None:
    """Lay out ``B`` requests of ``D = tokens_per_request`` consecutive tokens each, in place.

    Token ``j`` of request ``b`` sits at position ``p = seq_lens[b] + j`` and in KV slot
    ``page_table[rows[b], p // page_size] * page_size + p % page_size``; the request's KV
    length is ``seq_lens[b] + D``.

    Args:
        rows: ``[B]`` int64 ``req_pool_indices`` (rows of ``page_table``). seq_lens: ``[B]``
            int64 tokens already cached.
        page_table: ``[rows, max_pages]`` int64 (``KVPool.page_table``). page_size: tokens.
        slots: ``[B * D]`` int64, written. positions: ``[B * D]`` int64, kv_lens: ``[B]``
            int64, written when given (both or neither). Every vector contiguous.

    Rows and lengths are checked against the page table before the launch, from what the
    host states about them (``kernels.checks.known``: a stage states bounds that hold for
    every step it admits, so a captured graph never reads the device) or else with one
    device read. That a row holds pages for its positions is the caller's to ensure
    (``KVPool.ensure``): a row's unused entries point at page 0. CUDA-graph capturable.

    Raises:
        ValueError: shapes or dtypes that do not fit.
        IndexError: a row outside the page table, or a request whose ``seq_lens + D``
            positions pass the page table's width (nothing written).
    """
    D = tokens_per_request
    vecs = [t for t in (rows, seq_lens, slots, positions, kv_lens) if t is not None]
    B = rows.shape[0] if rows.dim() == 1 else -1
    ok = (B >= 0 and seq_lens.shape == (B,) and slots.shape == (B * D,) and D >= 1 and page_size >= 1
          and page_table.dim() == 2 and page_table.dtype == torch.int64 and page_table.stride(1) == 1
          and all(t.dtype == torch.int64 and t.is_contiguous() for t in vecs)
          and (positions is None or positions.shape == (B * D,)) and (kv_lens is None or kv_lens.shape == (B,)))
    if not ok:
        raise ValueError(
            f"paged_layout: rows {tuple(rows.shape)}, seq_lens {tuple(seq_lens.shape)}, slots {tuple(slots.shape)} "
            f"must be contiguous int64 [B], [B], [B * D] with D = {D} >= 1 (positions [B * D], kv_lens [B] when "
            f"given; page_table int64 [rows, max_pages] with contiguous rows, page_size {page_size} >= 1)"
        )
    if (positions is None) != (kv_lens is None):
        raise ValueError("paged_layout: positions and kv_lens are written together (both or neither)")
    if B:
        check_rows(rows, page_table.shape[0])
        lo, hi = min_max(seq_lens)
        cap = page_table.shape[1] * page_size
        if lo < 0 or hi + D > cap:
            raise IndexError(f"paged_layout: seq_lens in [{lo}, {hi}], but {D} tokens past them must fit the "
                             f"page table's {cap} positions per row")
    fn = pick(rows.is_cuda, "paging.triton_layout", "paged_layout_triton", paged_layout_ref)
    fn(rows, seq_lens, D, page_table, page_size, slots, positions, kv_lens)
