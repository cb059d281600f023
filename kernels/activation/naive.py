"""Plain-torch elementwise activations of Qwen3-Next / Qwen3.5 layers: the CPU path and the
oracle of the Triton kernels (``triton_activation.py``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` (``Qwen3_5MLP``: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``).

    Dtype steps as torch: ``silu(gate)`` in gate's dtype (computed in fp32, rounded), then
    the product in the dtype of both.

    Args:
        gate, up: ``[..., I]``, same shape and dtype.

    Returns:
        ``[..., I]`` in their dtype.
    """
    return F.silu(gate) * up


def gdn_gates_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """The per-head gates of a Gated DeltaNet layer (``Qwen3_5GatedDeltaNet.forward``):
    ``beta = sigmoid(b)`` and the log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` in
    fp32 (Mamba2's discretisation; ``F.softplus`` with its threshold 20).

    Args:
        a, b: ``[..., HV]`` (``in_proj_a(x)``, ``in_proj_b(x)``). A_log, dt_bias: ``[HV]``.

    Returns:
        ``(g, beta)``: ``g`` ``[..., HV]`` fp32; ``beta`` ``[..., HV]`` in b's dtype.
    """
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta
