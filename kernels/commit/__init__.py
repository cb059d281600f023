"""Commit of the accepted verify state into stable rows: one dispatch function."""
from __future__ import annotations

import torch

from ..checks import check_commit
from ..dispatch import pick
from .naive import commit_accept_ref

__all__ = ["commit_accept"]


def commit_accept(state: torch.Tensor, scratch: torch.Tensor, req_pool_indices: torch.Tensor, accept_lengths: torch.Tensor) -> None:
    """Shapes as :func:`naive.commit_accept_ref`.

    Raises:
        IndexError: a row outside ``[0, rows + 1)``, or the rows repeat.
        ValueError: an accept length outside ``[1, D]`` or a length mismatch.
    Nothing is written when it raises.
    """
    if not check_commit(req_pool_indices, accept_lengths, state.shape[1], scratch.shape[2]):
        return
    fn = pick(state.is_cuda, "commit.triton_commit", "commit_accept_triton", commit_accept_ref)
    fn(state, scratch, req_pool_indices, accept_lengths)
