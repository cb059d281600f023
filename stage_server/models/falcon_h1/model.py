"""Falcon-H1 decoder (``falcon_h1``), one pipeline stage's slice of it.

Layers follow Hugging Face transformers 5.24's ``modeling_falcon_h1``: with ``h =
rmsnorm(x)``, ``x + m_so * mamba(h * m_si) + m_ao * self_attn(h * m_ai)`` (the two mixers
side by side, the Mamba2 in-projection's sections scaled by ``ssm_multipliers``, the keys by
``key_multiplier``), then ``x + feed_forward(rmsnorm(x))`` (SwiGLU, gate and down scaled by
``mlp_multipliers``). Every layer holds both a Mamba2 state (``stage_server.layers.mamba2``)
and paged KV (``stage_server.layers.attention``). Every multiplier of a projection is folded
into its weights once at load (:meth:`DecoderLayer.fold_multipliers`): the forward is
multiplier-free but the embedding's and the logits' (``models.hybrid``).
"""
from __future__ import annotations

import torch
from torch import nn

from ...layers.attention import Attention
from ...layers.common import MLP, RMSNorm
from ...layers.mamba2 import Mamba2Mixer
from ...layers.rotary import Rotary
from ..hybrid import HybridStageModel
from .config import FalconH1Config


@torch.no_grad()
def _scale(linear: nn.Linear, weight, bias=None) -> None:
    """``linear``'s weight times ``weight`` (a float, or ``[out]`` per row) and its bias, if
    any, times ``bias``; in fp32, rounded once to the parameter's dtype."""
    w = torch.as_tensor(weight, dtype=torch.float32, device=linear.weight.device)
    linear.weight.copy_(linear.weight.float() * (w[:, None] if w.dim() else w))
    if linear.bias is not None and bias is not None:
        b = torch.as_tensor(bias, dtype=torch.float32, device=linear.bias.device)
        linear.bias.copy_(linear.bias.float() * b)


def mup_vector(cfg: FalconH1Config) -> torch.Tensor:
    """The Mamba2 in-projection's per-row scale ``[I + C + H]`` (``compute_mup_vector``): the
    z, x, B, C and dt rows times the five ``ssm_multipliers``."""
    i, gn, h = cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads
    sizes = (i, i, gn, gn, h)
    return torch.cat([torch.full((n,), m) for n, m in zip(sizes, cfg.ssm_multipliers)])


class DecoderLayer(nn.Module):
    """``FalconH1DecoderLayer``; the residual stream as a pair ``(h, residual)`` whose sum it is
    (the next norm fuses the add), as in the other families."""

    def __init__(self, cfg: FalconH1Config, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mamba = Mamba2Mixer(cfg, out_bias=cfg.projectors_bias, norm=cfg.mamba_norm)
        self.self_attn = Attention(cfg, rotary, bias=cfg.attention_bias)
        self.feed_forward = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def fold_multipliers(self, cfg: FalconH1Config) -> None:
        """Fold the multipliers into the projections (after loading, before fusing): a
        multiplier of a projection's input scales its weight, one of its output its weight
        and bias. Exact up to one rounding of each weight."""
        m = self.mamba
        _scale(m.in_proj, mup_vector(cfg) * cfg.ssm_in_multiplier, mup_vector(cfg))
        _scale(m.out_proj, cfg.ssm_out_multiplier, cfg.ssm_out_multiplier)
        a, ai = self.self_attn, cfg.attention_in_multiplier
        _scale(a.q_proj, ai)
        _scale(a.k_proj, ai * cfg.key_multiplier, cfg.key_multiplier)
        _scale(a.v_proj, ai)
        _scale(a.o_proj, cfg.attention_out_multiplier, cfg.attention_out_multiplier)
        gate, down = cfg.mlp_multipliers
        _scale(self.feed_forward.gate_proj, gate, gate)
        _scale(self.feed_forward.down_proj, down, down)

    def forward(self, x: torch.Tensor, meta, state, residual: torch.Tensor | None = None):
        st, kv = state  # the Mamba2 state's views and this layer's KV pages
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual=residual)
        out = self.mamba(h, meta, st) + self.self_attn(h, meta, kv)
        h, residual = self.pre_ff_layernorm(out, residual=residual)
        return self.feed_forward(h), residual


class FalconH1StageModel(HybridStageModel):
    """Layers ``[start, end)`` of a Falcon-H1 model (``models.hybrid.HybridStageModel``: the
    embedding times ``embedding_multiplier``, the logits times ``lm_head_multiplier``)."""

    def __init__(self, cfg: FalconH1Config, start: int, end: int):
        super().__init__(cfg, start, end, final_norm="final_layernorm")
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, self.rotary) for i in range(start, end)})

    def finish_load(self, device) -> None:
        for layer in self.layers.values():
            layer.fold_multipliers(self.cfg)
        super().finish_load(device)
