"""Argument checks shared by every dispatch function: they run before any launch, so a
bad row never reaches a kernel (which would write memory it does not own)."""
from __future__ import annotations

import torch


def check_rows(req_pool_indices: torch.Tensor, num_rows: int) -> None:
    """Raise IndexError unless every row is in ``[0, num_rows)`` (padding row included)."""
    if req_pool_indices.numel() and (
        int(req_pool_indices.min()) < 0 or int(req_pool_indices.max()) >= num_rows
    ):
        raise IndexError(
            f"req_pool_indices out of range [0, {num_rows}): "
            f"min {int(req_pool_indices.min())}, max {int(req_pool_indices.max())}"
        )


def check_commit(req_pool_indices: torch.Tensor, accept_lengths: torch.Tensor, num_rows: int, d_max: int | None) -> bool:
    """Validate one micro-batch's commit; returns False when there is nothing to commit.

    Raises:
        ValueError: lengths differ, or an accept length outside ``[1, d_max]``.
        IndexError: a row outside ``[0, num_rows)`` or a repeated row.
    """
    if req_pool_indices.shape != accept_lengths.shape:
        raise ValueError(
            f"req_pool_indices has {req_pool_indices.numel()} rows but accept_lengths has {accept_lengths.numel()}"
        )
    if req_pool_indices.numel() == 0:
        return False
    check_rows(req_pool_indices, num_rows)
    if torch.unique(req_pool_indices).numel() != req_pool_indices.numel():
        raise IndexError(f"commit rows repeat: {req_pool_indices.tolist()}")
    if int(accept_lengths.min()) < 1 or (d_max is not None and int(accept_lengths.max()) > d_max):
        raise ValueError(f"accept lengths must be in [1, {d_max}]: {accept_lengths.tolist()}")
    return True
