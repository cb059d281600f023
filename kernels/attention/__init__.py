"""Paged attention for prefill, decode and verify, and its multi-head latent attention form\n(MLA): one dispatch function per op."""
from __future__ import annotations

from ..checks import min_max
from ..dispatch import pick
from .naive import mla_attention_ref, paged_attention_ref, store_kv_ref

__all__ = ["paged_attention", "mla_attention", "store_kv"]


def store_kv(k_cache, v_cache, slots, k, v):
    """Shapes as :func:`naive.store_kv_ref`. Raises IndexError on a slot outside the cache."""
    n = k_cache.shape[0] * k_cache.shape[1]
    if slots.numel():
        lo, hi = min_max(slots)
        if lo < 0 or hi >= n:
            raise IndexError(f"KV slots out of range [0, {n})")
    store_kv_ref(k_cache, v_cache, slots, k, v)


def paged_attention(q, k_cache, v_cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, scale, gate=None,
                    plan=None):
    """Shapes as :func:`naive.paged_attention_ref` (``gate``: the optional output gate,
    fused into the Triton kernel's epilogue).

    ``plan``: None, or the step's :class:`flashinfer.PrefillPlan` (an eager prefill chunk
    of a stage that uses FlashInfer, made from the same batch): FlashInfer runs the call
    where the plan :meth:`~flashinfer.PrefillPlan.supports` it (CUDA, bf16/fp16, not under
    graph capture), else the Triton kernel. Without a plan CUDA tensors take Triton, the
    reference otherwise."""
    if plan is not None and plan.supports(q, k_cache):
        return plan.run(q, k_cache, v_cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, scale, gate)
    fn = pick(q.is_cuda, "attention.gpu", "paged_attention_gpu", paged_attention_ref)
    return fn(q, k_cache, v_cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, scale, gate)


def mla_attention(q, cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, scale, rank):
    """Shapes as :func:`naive.mla_attention_ref`: every query head over the request's one
    latent head, keys the whole latent row, values its first ``rank`` columns. CUDA tensors
    take the Triton kernel of ``mla.py``, the reference otherwise."""
    fn = pick(q.is_cuda, "attention.mla", "mla_attention_gpu", mla_attention_ref)
    return fn(q, cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, scale, rank)
