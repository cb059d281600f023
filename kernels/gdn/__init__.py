"""Gated delta rule: chunked prefill and recurrent decode/verify at stable rows.

One dispatch function per op. The plain-torch reference (``naive.py``) is the CPU path
and the test oracle; a GPU kernel takes over when the tensors live on CUDA and the kernel
module imports.
"""
from __future__ import annotations

import torch

from .naive import chunk_gated_delta_rule_ref, l2norm, recurrent_gated_delta_rule_ref

__all__ = ["gdn_prefill", "gdn_recurrent", "l2norm"]


def _check_rows(req_pool_indices: torch.Tensor, num_rows: int) -> None:
    if req_pool_indices.numel() and (
        int(req_pool_indices.min()) < 0 or int(req_pool_indices.max()) >= num_rows
    ):
        raise IndexError(
            f"req_pool_indices out of range [0, {num_rows}): "
            f"min {int(req_pool_indices.min())}, max {int(req_pool_indices.max())}"
        )


def gdn_prefill(q, k, v, g, beta, cu_seqlens, initial_state, scale=None):
    """Chunked GDN prefill; shapes as :func:`naive.chunk_gated_delta_rule_ref`."""
    if q.is_cuda:
        try:
            from .fla_prefill import chunk_gated_delta_rule_fla
        except ImportError:
            pass
        else:
            return chunk_gated_delta_rule_fla(q, k, v, g, beta, cu_seqlens, initial_state, scale)
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens, initial_state, scale)


def gdn_recurrent(q, k, v, g, beta, state, req_pool_indices, scratch=None, scale=None):
    """Recurrent GDN decode (``scratch=None``) or verify (every step into ``scratch`` rows).

    Shapes as :func:`naive.recurrent_gated_delta_rule_ref`. Raises ``IndexError`` before
    any write when a row is outside the pool (the padding row included).
    """
    _check_rows(req_pool_indices, state.shape[0])
    if q.is_cuda:
        try:
            from .triton_recurrent import recurrent_gated_delta_rule_triton
        except ImportError:
            pass
        else:
            return recurrent_gated_delta_rule_triton(q, k, v, g, beta, state, req_pool_indices, scratch, scale)
    return recurrent_gated_delta_rule_ref(q, k, v, g, beta, state, req_pool_indices, scratch, scale)
