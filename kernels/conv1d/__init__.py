"""Causal depthwise conv1d (the short conv before GDN / Mamba2 mixing), one dispatch per op."""
from __future__ import annotations

from ..checks import check_rows as _check_rows
from ..dispatch import pick
from .naive import causal_conv1d_prefill_ref, causal_conv1d_update_ref

__all__ = ["causal_conv1d_prefill", "causal_conv1d_update"]


def causal_conv1d_prefill(x, weight, bias, conv_state, req_pool_indices, cu_seqlens, has_initial_state, activation="silu"):
    """Shapes as :func:`naive.causal_conv1d_prefill_ref`; raises IndexError on rows outside the pool."""
    _check_rows(req_pool_indices, conv_state.shape[0])
    fn = causal_conv1d_prefill_ref
    if x.is_cuda:  # the reference's per-sequence loop launches ~8 kernels per prompt
        from .packed import causal_conv1d_prefill_packed  # plain torch: where Triton is absent

        fn = pick(True, "conv1d.triton_prefill", "causal_conv1d_prefill_triton", causal_conv1d_prefill_packed)
    return fn(x, weight, bias, conv_state, req_pool_indices, cu_seqlens, has_initial_state, activation)


def causal_conv1d_update(x, weight, bias, conv_state, req_pool_indices, conv_scratch=None, activation="silu"):
    """Shapes as :func:`naive.causal_conv1d_update_ref`; raises IndexError on rows outside the pool."""
    _check_rows(req_pool_indices, conv_state.shape[0])
    fn = pick(x.is_cuda, "conv1d.triton_update", "causal_conv1d_update_triton", causal_conv1d_update_ref)
    return fn(x, weight, bias, conv_state, req_pool_indices, conv_scratch, activation)
