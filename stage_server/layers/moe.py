"""Mixture-of-experts blocks that model families share: SwiGLU experts stacked in two
tensors, and their run over routed tokens grouped by expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppspec.kernels.activation import silu_mul


class Experts(nn.Module):
    """Expert weights stacked: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, from the
    config's ``num_experts`` (E), ``moe_intermediate_size`` (I), ``hidden_size`` (H)."""

    def __init__(self, cfg):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))


def run_experts(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, experts: Experts) -> torch.Tensor:
    """``sum_j top_w[t, j] * expert_{top_i[t, j]}(x_t)`` with SwiGLU experts: x ``[T, hidden]``,
    top_i ``[T, k]`` int64, top_w ``[T, k]`` (the product in torch's promotion of top_w and
    the experts' output). Returns ``[T, hidden]`` in x's dtype."""
    k = top_i.shape[-1]
    # group the (token, slot) pairs by expert on the device; one host read of the group
    # sizes per layer (not one per expert) decides which expert GEMMs run
    flat = top_i.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.down_proj.shape[0]).tolist()
    tok = order // k
    xs, ws = x[tok], top_w.flatten()[order, None]
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(xs[start:start + n], experts.gate_up_proj[e]).chunk(2, dim=-1)
            ys.append(F.linear(silu_mul(gate, up), experts.down_proj[e]))
            start += n
    if not ys:
        return torch.zeros_like(x)
    return torch.zeros_like(x).index_add_(0, tok, (torch.cat(ys) * ws).to(x.dtype))
