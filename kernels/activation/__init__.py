"""Elementwise activations of Qwen3-Next / Qwen3.5 layers (SwiGLU's ``silu(gate) * up``,
a GDN layer's gates), one dispatch per op: the Triton kernel for CUDA tensors, the
plain-torch reference otherwise."""
from __future__ import annotations

import torch

from ..dispatch import pick
from .naive import gdn_gates_ref, silu_mul_ref

__all__ = ["silu_mul", "gdn_gates"]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU; ``Qwen3_5MLP``), in their dtype.

    Args:
        gate, up: ``[..., I]``, same shape and dtype; they may be the two ``chunk(2, -1)``
            halves of a concatenated ``[..., 2I]`` projection (read in place on CUDA).

    Returns:
        ``[..., I]``.

    Raises:
        ValueError: shapes or dtypes differ.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    return pick(gate.is_cuda, "activation.triton_activation", "silu_mul_triton", silu_mul_ref)(gate, up)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """A Gated DeltaNet layer's gates (``Qwen3_5GatedDeltaNet`` / ``Qwen3NextGatedDeltaNet``):
    ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32 log decay).

    Args:
        a, b: ``[..., HV]`` (``in_proj_a(x)``, ``in_proj_b(x)``). A_log, dt_bias: ``[HV]``.

    Returns:
        ``(g, beta)``: g ``[..., HV]`` fp32, beta ``[..., HV]`` in b's dtype.

    Raises:
        ValueError: shapes do not fit.
    """
    if a.shape != b.shape or a.dim() < 1 or A_log.shape != (a.shape[-1],) or dt_bias.shape != (a.shape[-1],):
        raise ValueError(
            f"gdn gates: a {tuple(a.shape)}, b {tuple(b.shape)} must be [..., HV] with A_log "
            f"{tuple(A_log.shape)} and dt_bias {tuple(dt_bias.shape)} [HV]"
        )
    fn = pick(a.is_cuda, "activation.triton_activation", "gdn_gates_triton", gdn_gates_ref)
    return fn(a, b, A_log, dt_bias)
