"""Rotary position embedding of Qwen3-Next / Qwen3.5 attention (partial, rotate-half form),
q and k together: the Triton kernel for CUDA tensors, the plain-torch reference otherwise."""
from __future__ import annotations

import torch

from ..dispatch import pick
from .naive import rotary_ref

__all__ = ["apply_rotary"]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 scale: float = 1.0):
    """Rotate the first ``rotary_dim = 2 * len(inv_freq)`` dims of every q and k head by the
    token's position (RoFormer, Su et al. 2021, eq. 34, rotate-half pairing as in
    transformers' ``apply_rotary_pos_emb``), with cos and sin multiplied by ``scale`` in
    fp32 before their rounding to q's dtype; the remaining dims pass through.

    Args:
        q: ``[T, Hq, head_dim]``. k: ``[T, Hk, head_dim]``, q's dtype (fp32 / bf16 / fp16).
        positions: ``[T]`` int64 token positions. inv_freq: ``[rotary_dim / 2]`` fp32,
            ``theta ** (-2i / rotary_dim)`` or a scaled variant (linear, YaRN).
        scale: finite positive float, YaRN's attention factor (1.0 for other RoPE types).

    Returns:
        ``(q, k)`` rotated: new tensors, the inputs' shapes and dtype.

    Raises:
        ValueError: shapes or dtypes do not fit, or ``scale`` is not a finite positive number.
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or k.dtype != q.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must be [T, H, head_dim], "
                         "same T, head_dim and dtype")
    if positions.shape != (q.shape[0],) or inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > q.shape[2]:
        raise ValueError(f"positions {tuple(positions.shape)} must be [T={q.shape[0]}] and inv_freq "
                         f"{tuple(inv_freq.shape)} [rotary_dim / 2] with rotary_dim <= head_dim {q.shape[2]}")
    if not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    return pick(q.is_cuda, "rotary.triton_rotary", "rotary_triton", rotary_ref)(q, k, positions, inv_freq,
                                                                               float(scale))
