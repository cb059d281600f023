"""Plain-torch commit of accepted verify state (docs/DESIGN.md, "Commit rule")."""
from __future__ import annotations

import torch

from ..gdn.naive_replay import commit_accept_replay_ref


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


def commit_accept_conv_replay_ref(
    conv: torch.Tensor,
    conv_scratch: torch.Tensor,
    pending: torch.Tensor,
    slot: torch.Tensor,
    req_pool_indices: torch.Tensor,
    accept_lengths: torch.Tensor,
) -> None:
    """The whole commit of the replay design (docs/DESIGN.md, "Commit rule"): the two reference
    commits composed, for exactly the named rows of every layer ``l``::

        conv[l, row] = conv_scratch[l, row, accept_length - 1]    # commit_accept_ref
        pending[l, row] = accept_length                           # commit_accept_replay_ref
        slot[l, row] = 1 - slot[l, row]

    Args:
        conv: ``[L, rows + 1, C, W - 1]`` committed conv windows (any float dtype), in place.
        conv_scratch: ``[L, rows + 1, D, C, W - 1]`` conv window after each verify step.
        pending, slot: ``[L, rows + 1]`` integer (int32 in the pools) replay counters of the
            same L layers, in place.
        req_pool_indices: ``[B]`` integer stable rows of one micro-batch.
        accept_lengths: ``[B]`` integer in ``[1, D]``.
    """
    commit_accept_ref(conv, conv_scratch, req_pool_indices, accept_lengths)
    commit_accept_replay_ref(pending, slot, req_pool_indices, accept_lengths)
