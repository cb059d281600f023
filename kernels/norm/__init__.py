"""RMSNorms of Qwen3-Next / Qwen3.5 (zero-centred, optionally with the residual add fused;
the gated norm of a GDN layer's output), one dispatch per op: the Triton kernel for CUDA
tensors, the plain-torch reference otherwise."""
from __future__ import annotations

import torch

from ..dispatch import pick
from .naive import gated_rms_norm_ref, rms_norm_ref, sigmoid_gated_rms_norm_ref

__all__ = ["rms_norm", "gated_rms_norm", "sigmoid_gated_rms_norm"]


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, **others: torch.Tensor | None) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dim, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}: expected [{x.shape[-1]}]")
    for name, t in others.items():
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have x's shape {tuple(x.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero_centred: bool = True):
    """RMSNorm over the last dim (Qwen3.5's ``Qwen3_5RMSNorm`` when ``zero_centred``:
    ``x / rms(x) * (1 + w)``), computed in fp32, output in x's dtype.

    With ``residual`` (same shape and dtype as x) it first forms ``x = x + residual`` in
    x's dtype and returns ``(normed, x)``: a decoder layer's residual add and the norm of
    the sum in one launch on CUDA.

    Args:
        x: ``[..., N]`` fp32 / bf16 / fp16. weight: ``[N]``. eps: added to ``mean(x^2)``.

    Returns:
        ``[..., N]`` in x's dtype, or ``(normed, x + residual)``.

    Raises:
        ValueError: weight or residual do not fit x.
    """
    _check_shapes(x, weight, residual=residual)
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"residual is {residual.dtype}, x is {x.dtype}: the sum would change dtype")
    fn = pick(x.is_cuda, "norm.triton_norm", "rms_norm_triton", rms_norm_ref)
    return fn(x, weight, eps, residual, zero_centred)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / rms(x) * silu(z)`` over the last dim: a GDN layer's output norm
    (``Qwen3_5RMSNormGated``; dtype steps in :func:`naive.gated_rms_norm_ref`).

    Args:
        x: ``[..., N]`` fp32 / bf16 / fp16. z: the gate, x's shape. weight: ``[N]``.

    Returns:
        ``[..., N]`` in x's dtype.

    Raises:
        ValueError: z or weight do not fit x.
    """
    _check_shapes(x, weight, z=z)
    return pick(x.is_cuda, "norm.triton_norm", "gated_rms_norm_triton", gated_rms_norm_ref)(x, z, weight, eps)


def sigmoid_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / rms(x) * sigmoid(z)`` over the last dim, in fp32: a KDA layer's output norm
    (:func:`naive.sigmoid_gated_rms_norm_ref`; one Triton launch on CUDA).

    Raises:
        ValueError: z or weight do not fit x.
    """
    _check_shapes(x, weight, z=z)
    return pick(x.is_cuda, "norm.triton_norm", "sigmoid_gated_rms_norm_triton", sigmoid_gated_rms_norm_ref)(
        x, z, weight, eps)
