"""Commit of the accepted verify state into stable rows: one dispatch function."""
from __future__ import annotations

import torch

from .naive import commit_accept_ref

__all__ = ["commit_accept"]


def commit_accept(state: torch.Tensor, scratch: torch.Tensor, req_pool_indices: torch.Tensor, accept_lengths: torch.Tensor) -> None:
    """Shapes as :func:`naive.commit_accept_ref`.

    Raises:
        IndexError: a row outside ``[0, rows + 1)``, or the rows repeat.
        ValueError: an accept length outside ``[1, D]`` or a length mismatch.
    Nothing is written when it raises.
    """
    n_rows, d = state.shape[1], scratch.shape[2]
    if req_pool_indices.shape != accept_lengths.shape:
        raise ValueError(
            f"req_pool_indices has {req_pool_indices.numel()} rows but accept_lengths has {accept_lengths.numel()}"
        )
    if req_pool_indices.numel() == 0:
        return
    if int(req_pool_indices.min()) < 0 or int(req_pool_indices.max()) >= n_rows:
        raise IndexError(f"commit rows out of range [0, {n_rows}): {req_pool_indices.tolist()}")
    if torch.unique(req_pool_indices).numel() != req_pool_indices.numel():
        raise IndexError(f"commit rows repeat: {req_pool_indices.tolist()}")
    if int(accept_lengths.min()) < 1 or int(accept_lengths.max()) > d:
        raise ValueError(f"accept lengths must be in [1, {d}]: {accept_lengths.tolist()}")
    if state.is_cuda:
        try:
            from .triton_commit import commit_accept_triton
        except ImportError:
            pass
        else:
            return commit_accept_triton(state, scratch, req_pool_indices, accept_lengths)
    commit_accept_ref(state, scratch, req_pool_indices, accept_lengths)
