"""Plain-torch commit of accepted verify state (DESIGN.md section 4)."""
from __future__ import annotations

import torch


def commit_accept_ref(
    state: torch.Tensor,
    scratch: torch.Tensor,
    req_pool_indices: torch.Tensor,
    accept_lengths: torch.Tensor,
) -> None:
    """``state[:, row] = scratch[:, row, accept_length - 1]`` for exactly the named rows.

    Args:
        state: ``[L, rows + 1, *S]`` committed state of L layers (recurrent state or conv
            window), written in place.
        scratch: ``[L, rows + 1, D, *S]`` state after each verify step, addressed by row.
        req_pool_indices: ``[B]`` int64 stable rows of one micro-batch.
        accept_lengths: ``[B]`` int64 in ``[1, D]``: tokens accepted (drafts + bonus).
    """
    state[:, req_pool_indices] = scratch[:, req_pool_indices, accept_lengths - 1]
