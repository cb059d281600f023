"""Bamba decoder (``bamba``), one pipeline stage's slice of it.

Layers follow Hugging Face transformers 5.24's ``modeling_bamba``: ``x + mixer(rmsnorm(x))``
then ``x + feed_forward(rmsnorm(x))``, the mixer a Mamba2 layer (``stage_server.layers.mamba2``:
grouped B/C, D skip, the group-gated RMSNorm after the gate) or attention with partial RoPE
(``stage_server.layers.attention``), the feed-forward a SwiGLU MLP. Module and parameter
names equal the checkpoint's (``model.`` prefix; ``models.hybrid``).
"""
from __future__ import annotations

import torch
from torch import nn

from ...layers.attention import Attention
from ...layers.common import MLP, RMSNorm
from ...layers.mamba2 import Mamba2Mixer
from ...layers.rotary import Rotary
from ..hybrid import MAMBA, HybridStageModel
from .config import BambaConfig


class DecoderLayer(nn.Module):
    """``BambaDecoderLayer``; the residual stream as a pair ``(h, residual)`` whose sum it is
    (the next norm fuses the add), as in the other families."""

    def __init__(self, cfg: BambaConfig, kind: str, rotary: Rotary | None):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(cfg)
        else:
            self.self_attn = Attention(cfg, rotary, bias=cfg.attention_bias)
        self.feed_forward = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, meta, state, residual: torch.Tensor | None = None):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual=residual)
        mixer = self.mamba if self.kind == MAMBA else self.self_attn
        h, residual = self.pre_ff_layernorm(mixer(h, meta, state), residual=residual)
        return self.feed_forward(h), residual


class BambaStageModel(HybridStageModel):
    """Layers ``[start, end)`` of a Bamba model (``models.hybrid.HybridStageModel``)."""

    def __init__(self, cfg: BambaConfig, start: int, end: int):
        super().__init__(cfg, start, end, final_norm="final_layernorm")
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, cfg.layer_types[i], self.rotary)
                                     for i in range(start, end)})
