"""Kimi Delta Attention (channel-wise gated delta rule) at stable rows: chunked prefill,
recurrent decode / verify, and the replay design's verify, one dispatch function per op.

The plain-torch reference (``naive.py``, the gated delta rule of ``kernels/gdn`` with a
per-channel gate) is the CPU path and the oracle. On CUDA, prefill takes fla's ``chunk_kda``
(``kernels/gdn/fla_prefill.py``) where fla imports; decode, verify and the replay take the
Triton kernel of ``triton_kda.py`` where Triton imports.
"""
from __future__ import annotations

import torch

from ..checks import check_rows
from ..dispatch import pick
from ..gdn.naive_replay import recurrent_gated_delta_rule_replay_ref, replay_flush_ref
from .naive import chunk_kda_ref, recurrent_kda_ref

__all__ = ["chunk_kda_ref", "recurrent_kda_ref", "kda_prefill_rows", "kda_recurrent", "kda_recurrent_replay",
           "kda_replay_flush"]


def kda_prefill_rows(q, k, v, g, beta, cu_seqlens, state, req_pool_indices, has_init, scale=None):
    """KDA prefill of packed sequences at stable rows, in place: sequence ``b`` starts from
    ``state[req_pool_indices[b]]`` where ``has_init[b]``, else zeros; its final state is
    written back there. q, k, v, g ``[T, H, K]``, beta ``[T, H]``, ``state`` ``[R, H, K, V]``
    fp32. Returns ``o [T, H, V]`` in v's dtype. Raises IndexError before any write on a row
    outside the pool."""
    check_rows(req_pool_indices, state.shape[0])
    fn = pick(q.is_cuda, "gdn.fla_prefill", "chunk_gated_delta_rule_fla", chunk_kda_ref)
    init = torch.where(has_init.view(-1, 1, 1, 1), state[req_pool_indices],
                       torch.zeros((), dtype=state.dtype, device=state.device))
    o, final = fn(q, k, v, g, beta, cu_seqlens, init, scale)
    state[req_pool_indices] = final.to(state.dtype)
    return o


def kda_recurrent(q, k, v, g, beta, state, req_pool_indices, scratch=None, scale=None):
    """KDA decode (``scratch=None``: the last state written to ``state[row]``) or the copy
    design's verify (the state after each step into ``scratch[row, t]``); shapes as
    ``gdn.naive.recurrent_gated_delta_rule_ref`` with g ``[B, D, H, K]``."""
    check_rows(req_pool_indices, state.shape[0])
    fn = pick(q.is_cuda, "kda.triton_kda", "kda_recurrent_triton", recurrent_kda_ref)
    return fn(q, k, v, g, beta, state, req_pool_indices, scratch, scale)


def kda_recurrent_replay(q, k, v, g, beta, state, req_pool_indices, bufs, scale=None, verify=True):
    """The replay design's verify (or decode) of KDA: each row's pending accepted steps
    first, then D steps recorded into ``bufs`` (``per_channel_gate`` buffers); semantics of
    ``gdn.naive_replay.recurrent_gated_delta_rule_replay_ref``."""
    check_rows(req_pool_indices, state.shape[0])
    fn = pick(q.is_cuda, "kda.triton_kda", "kda_recurrent_replay_triton", recurrent_gated_delta_rule_replay_ref)
    return fn(q, k, v, g, beta, state, req_pool_indices, bufs, scale, verify)


def kda_replay_flush(state, bufs, req_pool_indices) -> None:
    """Apply the rows' pending accepted steps to ``state[row]`` now (before a prefill
    continues a row or a snapshot reads it); ``pending[row]`` becomes 0."""
    check_rows(req_pool_indices, state.shape[0])
    fn = pick(state.is_cuda, "kda.triton_kda", "kda_replay_flush_triton", replay_flush_ref)
    fn(state, bufs, req_pool_indices)
