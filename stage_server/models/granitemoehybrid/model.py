"""Granite 4.0 hybrid decoder (``granitemoehybrid``), one pipeline stage's slice of it.

Layers follow Hugging Face transformers 5.24's ``modeling_granitemoehybrid``: each layer is
``x + m * mixer(rmsnorm(x))`` then ``x + m * ffn(rmsnorm(x))`` (``m = residual_multiplier``),
the mixer a Mamba2 layer (``stage_server.layers.mamba2``) or attention (RoPE or none,
softmax scale ``attention_multiplier``), the FFN ``shared_mlp(x)`` (SwiGLU) plus, with
experts, ``block_sparse_moe(x)`` (top-k softmax routing over SwiGLU experts). The first
stage scales the embedding by ``embedding_multiplier``; the last divides the logits by
``logits_scaling``. Module and parameter names equal the checkpoint's (``model.`` prefix).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ppspec.kernels.activation import silu_mul

from ...layers.attention import Attention
from ...layers.common import RMSNorm
from ...layers.mamba2 import Mamba2Mixer
from ...layers.moe import routed_experts
from ...layers.rotary import Rotary
from ..hybrid import HybridStageModel
from .config import GraniteHybridConfig


class _Weight(nn.Module):
    """A bare ``weight`` parameter (the checkpoint's ``*_linear.weight`` of stacked experts)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


class SharedMLP(nn.Module):
    """``output_linear(silu(gate) * up)`` with ``[gate | up] = input_linear(x)`` (``GraniteMoeHybridMLP``)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * inter, bias=False)
        self.output_linear = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(silu_mul(gate, up))


class MoE(nn.Module):
    """Top-k of the router's logits (fp32), softmax over those k, SwiGLU experts stacked as
    ``input_linear [E, 2I, H]`` / ``output_linear [E, H, I]`` (``GraniteMoeHybridMoE``), run by
    ``layers.moe.routed_experts`` (no host read on CUDA)."""

    def __init__(self, cfg: GraniteHybridConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Module()
        self.router.layer = nn.Linear(h, e, bias=False)
        self.input_linear = _Weight(e, 2 * i, h)
        self.output_linear = _Weight(e, h, i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.layer.weight).float()
        top_logits, top_i = logits.topk(self.top_k, dim=-1)
        top_w = torch.softmax(top_logits, dim=-1).type_as(x)
        experts = SimpleNamespace(gate_up_proj=self.input_linear.weight, down_proj=self.output_linear.weight)
        return routed_experts(x, top_i, top_w, experts)


class DecoderLayer(nn.Module):
    """``GraniteMoeHybridDecoderLayer``; the residual stream as a pair ``(h, residual)``
    whose sum it is (the next norm fuses the add), as in the other families."""

    def __init__(self, cfg: GraniteHybridConfig, kind: str, rotary: Rotary | None):
        super().__init__()
        self.kind, self.m = kind, cfg.residual_multiplier
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == "linear_attention":
            self.mamba = Mamba2Mixer(cfg)
        else:
            self.self_attn = Attention(cfg, rotary, bias=cfg.attention_bias, scale=cfg.attention_multiplier)
        self.block_sparse_moe = MoE(cfg) if cfg.num_experts > 0 else None
        self.shared_mlp = SharedMLP(cfg.hidden_size, cfg.shared_intermediate_size)

    def forward(self, x: torch.Tensor, meta, state, residual: torch.Tensor | None = None):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual=residual)
        mixer = self.mamba if self.kind == "linear_attention" else self.self_attn
        h, residual = self.post_attention_layernorm(mixer(h, meta, state) * self.m, residual=residual)
        out = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(h) + out
        return out * self.m, residual


class GraniteHybridStageModel(HybridStageModel):
    """Layers ``[start, end)`` of a Granite 4.0 hybrid (``models.hybrid.HybridStageModel``:
    the embedding times ``embedding_multiplier``, the logits divided by ``logits_scaling``)."""

    def __init__(self, cfg: GraniteHybridConfig, start: int, end: int):
        super().__init__(cfg, start, end, final_norm="norm")
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, cfg.layer_types[i], self.rotary)
                                     for i in range(start, end)})
