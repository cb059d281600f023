"""Mamba2 (SSD) state-space scan at stable rows: chunked prefill, recurrent decode / verify
(both commit designs) and the replay of accepted verify steps, one dispatch per op.

The plain-torch reference (``naive.py``, ``naive_replay.py``) is the CPU path and the
oracle. On CUDA ``mamba2_recurrent*`` take a Triton kernel from ``triton_recurrent``, the
output norm one from ``triton_norm``, and a bf16 / fp16 prefill takes fla's simple-GLA chunk
kernels (``fla_scan``, :func:`fla_scan_on`) where those modules import.
"""
from __future__ import annotations

import os

import torch

from ..checks import check_rows as _check_rows
from ..dispatch import pick
from .naive import chunk_scan_ref, discretize, gated_rms_norm_ref, recurrent_ref, replay_ref
from .naive_replay import (Mamba2ReplayBuffers, alloc_mamba2_replay_buffers, recurrent_replay_ref,
                           replay_flush_ref)

__all__ = [
    "chunk_scan_ref", "discretize", "gated_rms_norm_ref", "recurrent_ref", "replay_ref",
    "Mamba2ReplayBuffers", "alloc_mamba2_replay_buffers",
    "mamba2_prefill_rows", "mamba2_recurrent", "mamba2_recurrent_replay", "mamba2_replay_flush",
    "mamba2_gated_rms_norm",
]


def mamba2_gated_rms_norm(y, gate, weight, group_size: int, eps: float = 1e-6, norm_before_gate: bool = False):
    """The mixer's output norm: ``silu(gate)`` and an RMSNorm per group of ``group_size``
    channels, in the order ``norm_before_gate`` says (semantics and dtypes of
    :func:`naive.gated_rms_norm_ref`); one Triton launch on CUDA (``triton_norm``), the
    reference elsewhere. y, gate ``[..., I]`` (gate may be a column slice), weight ``[I]``."""
    fn = pick(y.is_cuda, "mamba2.triton_norm", "gated_rms_norm_triton", gated_rms_norm_ref)
    return fn(y, gate, weight, group_size, eps, norm_before_gate)


def mamba2_prefill_rows(x, dt, A, B, C, D, dt_bias, cu_seqlens, state, req_pool_indices, has_init,
                        dt_limit=(0.0, float("inf")), chunk_size: int = 64):
    """Chunked scan of packed sequences at stable rows of the state pool, in place: sequence
    ``b`` starts from ``state[req_pool_indices[b]]`` where ``has_init[b]`` (a continuing
    chunked prefill), else from zeros, and its final state is written back there.

    x ``[T, H, P]``, dt ``[T, H]`` raw, B, C ``[T, G, N]``, A, D, dt_bias ``[H]``,
    cu_seqlens ``[Bs + 1]`` int64, state ``[R, H, P, N]`` fp32, req_pool_indices ``[Bs]``
    int64 (distinct), has_init ``[Bs]`` bool. Returns y ``[T, H, P]`` in x's dtype.

    Raises:
        IndexError: a row outside the pool, before anything is written.
    """
    _check_rows(req_pool_indices, state.shape[0])
    fn = pick(x.is_cuda and fla_scan_on(x.dtype), "mamba2.fla_scan", "mamba2_prefill_rows_fla", _prefill_rows_ref)
    return fn(x, dt, A, B, C, D, dt_bias, cu_seqlens, state, req_pool_indices, has_init, dt_limit, chunk_size)


def fla_scan_on(dtype: torch.dtype) -> bool:
    """Whether the CUDA prefill of ``dtype`` activations takes fla's chunk kernels: bf16 and
    fp16 do, fp32 keeps the reference. fla's chunk kernels run their fp32 products as TF32
    on the GPU (``tl.dot``'s default), up to ~0.07 off the fp32 reference on the H200, while
    exact under Triton's interpreter; fp32 serves as the exact path (tests against
    transformers), so it stays exact. ``PPSPEC_MAMBA2_FLA=1`` takes fla for every dtype,
    ``0`` for none."""
    forced = os.environ.get("PPSPEC_MAMBA2_FLA", "")
    if forced in ("0", "1"):
        return forced == "1"
    return dtype in (torch.bfloat16, torch.float16)


def _prefill_rows_ref(x, dt, A, B, C, D, dt_bias, cu_seqlens, state, req_pool_indices, has_init,
                      dt_limit=(0.0, float("inf")), chunk_size: int = 64):
    rows = req_pool_indices
    zero = torch.zeros((), dtype=state.dtype, device=state.device)
    init = torch.where(has_init.view(-1, 1, 1, 1), state[rows], zero)
    y, final = chunk_scan_ref(x, dt, A, B, C, D, dt_bias, cu_seqlens, init, chunk_size, dt_limit)
    state[rows] = final.to(state.dtype)
    return y


def mamba2_recurrent(x, dt, A, B, C, D, dt_bias, state, req_pool_indices, scratch=None,
                     dt_limit=(0.0, float("inf"))):
    """Decode (``scratch=None``: the final state written to ``state[row]``) or copy-design
    verify (the state after step t to ``scratch[row, t]``); shapes as
    :func:`naive.recurrent_ref`. Raises IndexError before any write on a row outside the pool."""
    _check_rows(req_pool_indices, state.shape[0])
    fn = pick(x.is_cuda, "mamba2.triton_recurrent", "mamba2_recurrent_triton", recurrent_ref)
    return fn(x, dt, A, B, C, D, dt_bias, state, req_pool_indices, scratch, dt_limit=dt_limit)


def mamba2_recurrent_replay(x, dt, A, B, C, D, dt_bias, state, req_pool_indices, bufs: Mamba2ReplayBuffers,
                            verify: bool = True, dt_limit=(0.0, float("inf"))):
    """Replay design: the rows' pending accepted steps first, then a verify (its steps'
    inputs recorded) or a decode; semantics of :func:`naive_replay.recurrent_replay_ref`."""
    _check_rows(req_pool_indices, state.shape[0])
    fn = pick(x.is_cuda, "mamba2.triton_recurrent", "mamba2_recurrent_replay_triton", recurrent_replay_ref)
    return fn(x, dt, A, B, C, D, dt_bias, state, req_pool_indices, bufs, verify, dt_limit)


def mamba2_replay_flush(state, bufs: Mamba2ReplayBuffers, req_pool_indices) -> None:
    """Apply the rows' pending accepted steps to ``state[row]`` now (``pending[row]`` becomes 0)."""
    _check_rows(req_pool_indices, state.shape[0])
    replay_flush_ref(state, bufs, req_pool_indices)
