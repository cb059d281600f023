"""Building blocks that layer and model families share: projections fused into one GEMM,
the SwiGLU MLP, the plain RMSNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppspec.kernels.activation import silu_mul
from ppspec.kernels.norm import rms_norm


@torch.no_grad()
def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for linears that read the same input, so that they run as one
    GEMM: ``[sum of out_features, in_features]`` (``[sum of out_features]``), the
    linears' rows in argument order.

    Each linear's parameters are re-pointed at their rows of the fused tensors (views,
    contiguous): parameter names, ``named_parameters()`` and the values any reader of
    ``linear.weight`` sees are unchanged, and every byte is held once. The linears keep
    their device and dtype; a later ``.to()`` copies each view on its own (values stay
    right, the sharing is lost), so fuse after the model has its final device and dtype.

    Returns:
        ``(weight, bias)``, bias None when the linears have none.
    """
    fused = []
    for name in ("weight", "bias"):
        parts = [getattr(lin, name) for lin in linears]
        if parts[0] is None:
            fused.append(None)
            continue
        cat, off = torch.cat(parts), 0
        for lin, p in zip(linears, parts):
            setattr(lin, name, nn.Parameter(cat[off:off + p.shape[0]], requires_grad=p.requires_grad))
            off += p.shape[0]
        fused.append(cat)
    return fused[0], fused[1]


class MLP(nn.Module):
    """SwiGLU ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (with biases when ``bias``);
    gate and up run as one GEMM against ``gate_up_weight`` ``[2 I, hidden]``, built by
    :meth:`fuse_projections`."""

    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.register_buffer("gate_up_weight", None, persistent=False)
        self.register_buffer("gate_up_bias", None, persistent=False)

    def fuse_projections(self) -> None:
        self.gate_up_weight, self.gate_up_bias = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[T, hidden]``. Returns ``[T, hidden]`` in x's dtype."""
        # silu_mul reads the halves in place
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return self.down_proj(silu_mul(gate, up))


class RMSNorm(nn.Module):
    """``w * x / rms(x)`` in fp32, cast to x's dtype (transformers' ``LlamaRMSNorm`` form, the
    Mamba2 hybrids' ``*RMSNorm``); with ``residual`` the residual add is fused and ``(normed,
    x + residual)`` returned, as ``stage_server.model.RMSNorm`` (whose weight is zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual, zero_centred=False)
