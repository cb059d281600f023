"""Plain-torch RMSNorms of Qwen3-Next / Qwen3.5: the CPU path and the oracle of the Triton
kernels (``triton_norm.py``).

The math is that of Hugging Face transformers' ``modeling_qwen3_5`` (``Qwen3_5RMSNorm``,
``Qwen3_5RMSNormGated``; ``modeling_qwen3_next`` has the same two), with ``F.rms_norm``
for ``x * rsqrt(mean(x^2) + eps)`` in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centred: bool = True,
):
    """RMSNorm over the last dim, in fp32, output in x's dtype.

    ``zero_centred`` (Qwen3.5's ``Qwen3_5RMSNorm``): ``(x / rms(x) * (1 + w)).to(x.dtype)``;
    else ``(x / rms(x) * w).to(x.dtype)`` (the product in fp32 too, cast once).
    With ``residual`` first ``x = x + residual`` in x's dtype (torch's add, rounded as
    torch rounds it), and the result is ``(normed, x)``: the pre-norm residual add of a
    decoder layer and its norm in one call.

    Args:
        x: ``[..., N]``. weight: ``[N]``. residual: like x (shape and dtype) or None.

    Returns:
        ``[..., N]`` in x's dtype, or the pair ``(normed, x + residual)``.
    """
    if residual is not None:
        x = x + residual
    xf = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    w = weight.float()
    out = (xf * (1.0 + w if zero_centred else w)).to(x.dtype)
    return out if residual is None else (out, x)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / rms(x) * silu(z)``: the output norm of a GDN layer (``Qwen3_5RMSNormGated``;
    the weight is not zero-centred).

    Dtype steps as the reference: ``x / rms(x)`` in fp32, cast to x's dtype, times the
    weight (in torch's promotion of the two dtypes), times ``silu(z.float())`` in fp32,
    cast to x's dtype.

    Args:
        x: ``[..., N]``. z: the gate, same shape as x. weight: ``[N]``.

    Returns:
        ``[..., N]`` in x's dtype.
    """
    dtype = x.dtype
    xf = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return ((weight * xf.to(dtype)) * F.silu(z.float())).to(dtype)


def sigmoid_gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / rms(x) * sigmoid(z)``: the output norm of a KDA layer (transformers'
    ``KimiLinearRMSNormGated``, fla's ``FusedRMSNormGated`` with a sigmoid gate). Every step in
    fp32 (the weight too), one cast to x's dtype at the end.

    Args:
        x: ``[..., N]``. z: the gate, x's shape. weight: ``[N]``.

    Returns:
        ``[..., N]`` in x's dtype.
    """
    xf = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (weight.float() * xf * torch.sigmoid(z.float())).to(x.dtype)
