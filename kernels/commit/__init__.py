"""Commit of the accepted verify state into stable rows: one dispatch function per commit
(the copy design's state or conv window; the replay design's whole commit)."""
from __future__ import annotations

import torch

from ..checks import check_commit, check_commit_conv_replay
from ..dispatch import pick
from .naive import commit_accept_conv_replay_ref, commit_accept_ref

__all__ = ["commit_accept", "commit_accept_conv_replay"]


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


def commit_accept_conv_replay(conv: torch.Tensor, conv_scratch: torch.Tensor, pending: torch.Tensor, slot: torch.Tensor,
                              req_pool_indices: torch.Tensor, accept_lengths: torch.Tensor) -> None:
    """The replay design's commit of one micro-batch in every layer ``l`` (docs/DESIGN.md,
    "Commit rule")::

        conv[l, row] = conv_scratch[l, row, accept_length - 1]
        pending[l, row] = accept_length;  slot[l, row] = 1 - slot[l, row]

    Args:
        conv: ``[L, R, C, W - 1]`` committed conv windows (``R`` = rows + 1), in place.
        conv_scratch: ``[L, R, D, C, W - 1]`` conv window after each verify step.
        pending, slot: ``[L, R]`` integer replay counters (int32 in the pools), in place.
        req_pool_indices: ``[B]`` integer stable rows; on CUDA contiguous on the pool's device.
        accept_lengths: ``[B]`` integer in ``[1, D]``; on CUDA likewise.

    Validated once, on the host, before anything is written (:func:`checks.check_commit_conv_replay`,
    which reads facts stated with :func:`checks.known` instead of the device). On CUDA it is
    then one launch (``triton_commit.launch_commit_conv_replay``); elsewhere the plain-torch
    reference (:func:`naive.commit_accept_conv_replay_ref`).

    Raises:
        IndexError: a row outside ``[0, R)``, or the rows repeat.
        ValueError: an accept length outside ``[1, D]``, a length mismatch, shapes that do
            not fit together; on CUDA also rows or lengths not contiguous on the pool's device.
    Nothing is written when it raises.
    """
    if not check_commit_conv_replay(conv, conv_scratch, pending, slot, req_pool_indices, accept_lengths):
        return
    fn = pick(conv.is_cuda, "commit.triton_commit", "launch_commit_conv_replay", commit_accept_conv_replay_ref)
    fn(conv, conv_scratch, pending, slot, req_pool_indices, accept_lengths)
