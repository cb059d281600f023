"""Gated delta rule: chunked prefill and recurrent decode/verify at stable rows.

One dispatch function per op. The plain-torch reference (``naive.py``) is the CPU path
and the test oracle; a GPU kernel takes over when the tensors live on CUDA and the kernel
module imports.
"""
from __future__ import annotations

import torch

from ..checks import check_commit, check_rows as _check_rows, fact
from ..dispatch import pick
from .naive import chunk_gated_delta_rule_ref, l2norm, recurrent_gated_delta_rule_ref

__all__ = ["gdn_prefill", "gdn_prefill_rows", "gdn_recurrent", "l2norm"]


# Longest sequence (tokens) of a prefill chunk that takes the recurrent kernel instead of
# fla on CUDA: its steps run one after another, so its cost grows with the length while
# fla's chunks stay parallel; below this, fla's fixed host cost per layer dominates.
SHORT_PREFILL_TOKENS = 64


def _longest(cu_seqlens) -> int:
    if cu_seqlens.numel() < 2:
        return 0
    return fact(cu_seqlens, "max_len", lambda: int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))


def _recurrent(cu_seqlens) -> bool:
    """Whether a CUDA prefill of these sequences takes the recurrent kernel: its sequences
    are short, or the caller states ``gdn_recurrent`` (a CUDA graph of many prompts' chunks,
    ``stage_server.graphs.PrefillGraphs``, which cannot read fla's chunk plan on the host)."""
    return fact(cu_seqlens, "gdn_recurrent", lambda: _longest(cu_seqlens) <= SHORT_PREFILL_TOKENS)


def gdn_prefill(q, k, v, g, beta, cu_seqlens, initial_state, scale=None):
    """GDN prefill of packed sequences; shapes as :func:`naive.chunk_gated_delta_rule_ref`.
    On CUDA, chunks of short sequences take the one-launch recurrent kernel
    (``triton_prefill``), longer ones fla's chunked kernels."""
    if q.is_cuda and _recurrent(cu_seqlens):
        fn = pick(True, "gdn.triton_prefill", "gdn_prefill_recurrent_triton", chunk_gated_delta_rule_ref)
    else:
        fn = pick(q.is_cuda, "gdn.fla_prefill", "chunk_gated_delta_rule_fla", chunk_gated_delta_rule_ref)
    return fn(q, k, v, g, beta, cu_seqlens, initial_state, scale)


def gdn_prefill_rows(q, k, v, g, beta, cu_seqlens, state, req_pool_indices, has_init, scale=None):
    """GDN prefill of packed sequences at stable rows of the state pool, in place: sequence
    ``b`` starts from ``state[req_pool_indices[b]]`` where ``has_init[b]`` (a continuing
    chunked prefill), else from zeros, and its final state is written back there.

    q, k ``[T, H, K]``, v ``[T, HV, V]``, g, beta ``[T, HV]``, ``cu_seqlens`` ``[B + 1]``
    int64, ``state`` ``[R, HV, K, V]`` fp32, ``req_pool_indices`` ``[B]`` int64 (distinct),
    ``has_init`` ``[B]`` bool. Returns ``o [T, HV, V]`` in v's dtype. On CUDA, short
    sequences run :func:`triton_prefill.gdn_prefill_rows_triton` (one launch, the rows read
    and written inside it), longer ones :func:`fla_prefill.gdn_prefill_rows_fla` (fla's
    forward-level kernels, no host read where the stage states ``cu_seqlens``' values or
    chunk plan); elsewhere :func:`gdn_prefill` between a gather and a scatter.

    Raises:
        IndexError: a row outside the pool, before anything is written.
        ValueError: shapes that disagree.
    """
    _check_rows(req_pool_indices, state.shape[0])
    if q.is_cuda and _recurrent(cu_seqlens):
        fn = pick(True, "gdn.triton_prefill", "gdn_prefill_rows_triton", _prefill_rows_gathered)
    else:
        fn = pick(q.is_cuda, "gdn.fla_prefill", "gdn_prefill_rows_fla", _prefill_rows_gathered)
        fn = fn if fn is _prefill_rows_gathered or _fla_direct() else _prefill_rows_gathered
    return fn(q, k, v, g, beta, cu_seqlens, state, req_pool_indices, has_init, scale)


def _fla_direct() -> bool:
    from .fla_prefill import direct

    return direct()


def _prefill_rows_gathered(q, k, v, g, beta, cu_seqlens, state, rows, has_init, scale=None):
    init = torch.where(has_init.view(-1, 1, 1, 1), state[rows], torch.zeros((), dtype=state.dtype, device=state.device))
    o, final = gdn_prefill(q, k, v, g, beta, cu_seqlens, init, scale)
    state[rows] = final.to(state.dtype)
    return o


def gdn_recurrent(q, k, v, g, beta, state, req_pool_indices, scratch=None, scale=None):
    """Recurrent GDN decode (``scratch=None``) or verify (every step into ``scratch`` rows).

    Shapes as :func:`naive.recurrent_gated_delta_rule_ref`. Raises ``IndexError`` before
    any write when a row is outside the pool (the padding row included).
    """
    _check_rows(req_pool_indices, state.shape[0])
    fn = pick(q.is_cuda, "gdn.triton_recurrent", "recurrent_gated_delta_rule_triton", recurrent_gated_delta_rule_ref)
    return fn(q, k, v, g, beta, state, req_pool_indices, scratch, scale)


# ---- replay commit (docs/DESIGN.md, "Commit rule"): step inputs at stable rows, replayed in the next verify
from .naive_replay import (  # noqa: E402
    ReplayBuffers,
    alloc_replay_buffers,
    alloc_replay_meta,
    commit_accept_replay_ref,
    recurrent_gated_delta_rule_replay_ref,
    replay_flush_ref,
    replay_reset_ref,
)

__all__ += [
    "ReplayBuffers", "alloc_replay_buffers", "alloc_replay_meta",
    "gdn_recurrent_replay", "commit_accept_replay", "replay_flush", "replay_reset",
]


def gdn_recurrent_replay(q, k, v, g, beta, state, req_pool_indices, bufs, scale=None, verify=True):
    """Verify (``verify=True``) or decode that first replays each row's accepted steps.

    Shapes and semantics as :func:`naive_replay.recurrent_gated_delta_rule_replay_ref`.
    Raises ``IndexError`` before any write when a row is outside the pool.
    """
    _check_rows(req_pool_indices, state.shape[0])
    fn = pick(q.is_cuda, "gdn.triton_replay", "recurrent_gated_delta_rule_replay_triton", recurrent_gated_delta_rule_replay_ref)
    return fn(q, k, v, g, beta, state, req_pool_indices, bufs, scale, verify)


def commit_accept_replay(pending, slot, req_pool_indices, accept_lengths, d_max=None) -> None:
    """Replay commit of one micro-batch for all layers (``pending``/``slot`` ``[L, R]`` or ``[R]``).

    Raises IndexError on rows outside ``[0, R)`` or repeated, ValueError on accept lengths
    outside ``[1, d_max]`` (``d_max`` when given) or a length mismatch; nothing is written then.
    """
    if not check_commit(req_pool_indices, accept_lengths, pending.shape[-1], d_max):
        return
    fn = pick(pending.is_cuda, "gdn.triton_replay", "commit_accept_replay_triton", commit_accept_replay_ref)
    fn(pending, slot, req_pool_indices, accept_lengths)


def replay_flush(state, bufs, req_pool_indices) -> None:
    """Apply the rows' pending accepted steps to ``state[row]`` now (before a prefill
    continues a row or a state is read out). Buffers with a per-channel gate (KDA) go to
    ``kda.kda_replay_flush`` (GDN's Triton kernel reads one decay per head)."""
    if bufs.g.dim() == 5:
        from ..kda import kda_replay_flush

        return kda_replay_flush(state, bufs, req_pool_indices)
    _check_rows(req_pool_indices, state.shape[0])
    fn = pick(state.is_cuda, "gdn.triton_replay", "replay_flush_triton", replay_flush_ref)
    fn(state, bufs, req_pool_indices)


def replay_reset(pending, req_pool_indices) -> None:
    """Drop the rows' pending steps (a new request's prefill, a released row)."""
    _check_rows(req_pool_indices, pending.shape[-1])
    replay_reset_ref(pending, req_pool_indices)
