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
from ppspec.kernels.attention import paged_attention, store_kv
from ppspec.kernels.norm import rms_norm

from ...batch import per_part
from ...layers.common import fuse_linears
from ...layers.mamba2 import MAMBA2, Mamba2Mixer
from ...layers.moe import run_experts
from ...layers.rotary import Rotary, rope_frequencies
from .config import GraniteHybridConfig


class RMSNorm(nn.Module):
    """``w * x / rms(x)`` (``GraniteMoeHybridRMSNorm``), with the residual add fused as the
    other families' norms."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual, zero_centred=False)


class Attention(nn.Module):
    """Grouped-KV attention with RoPE (or none) and softmax scale ``attention_multiplier``
    (``GraniteMoeHybridAttention``); q/k/v one GEMM against ``qkv_weight``."""

    def __init__(self, cfg: GraniteHybridConfig, rotary: Rotary | None):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=bias)
        self.scale = cfg.attention_multiplier
        self.rotary = [rotary]  # shared, not a submodule (parameter names stay the checkpoint's)
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    def fuse_projections(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, meta, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = torch.split(F.linear(x, self.qkv_weight, self.qkv_bias),
                              [self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q, k, v = q.view(T, self.nh, self.hd), k.view(T, self.nkv, self.hd), v.view(T, self.nkv, self.hd)
        if self.rotary[0] is not None:
            q, k = self.rotary[0](q, k, meta.positions)
        k_cache, v_cache = kv
        store_kv(k_cache, v_cache, meta.slots, k, v)
        o = per_part(meta, lambda m, q: paged_attention(
            q, k_cache, v_cache, m.page_table, m.rows, m.kv_lens, m.cu_seqlens, self.scale, plan=m.attn_plan,
        ), q)
        return self.o_proj(o.reshape(T, self.nh * self.hd))


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
    ``input_linear [E, 2I, H]`` / ``output_linear [E, H, I]`` (``GraniteMoeHybridMoE``)."""

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
        return run_experts(x, top_i, top_w, experts)


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
            self.self_attn = Attention(cfg, rotary)
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


class GraniteHybridStageModel(nn.Module):
    """Layers ``[start, end)`` plus the embedding (first stage) and the final norm and
    ``lm_head`` (last stage); the stage model of ``stage_server.family.ModelFamily`` (no MTP
    head)."""

    def __init__(self, cfg: GraniteHybridConfig, start: int, end: int):
        super().__init__()
        self.cfg, self.start, self.end = cfg, start, end
        self.is_first, self.is_last = start == 0, end == cfg.num_hidden_layers
        self.rotary = Rotary(cfg) if cfg.use_rope else None
        if self.is_first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, cfg.layer_types[i], self.rotary)
                                     for i in range(start, end)})
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    layer_family = MAMBA2
    shared_kv = False
    capturable = False  # the Mamba2 scan's torch path and the MoE grouping read the host

    @property
    def state_layers(self) -> list[int]:
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] == "linear_attention"]

    @property
    def kv_layers(self) -> list[int]:
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] == "full_attention"]

    def finish_load(self, device) -> None:
        """After loading: the RoPE frequencies rebuilt on the device (made on meta), the
        attention projections fused, the Mamba2 conv weights tap-major."""
        if self.rotary is not None:
            self.rotary.inv_freq = rope_frequencies(self.cfg)[0].to(device)
        for m in self.modules():
            if isinstance(m, (Mamba2Mixer, Attention)):
                m.fuse_projections()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, meta, hidden: torch.Tensor, layer_states: dict) -> torch.Tensor:
        """``[T, hidden]`` after layer ``end - 1``, before the final norm. On the first stage
        ``hidden`` is the raw embedding (the runner's ``embed_tokens``): it is scaled here."""
        if self.is_first:
            hidden = hidden * self.cfg.embedding_multiplier
        residual = None
        for i, layer in self.layers.items():
            hidden, residual = layer(hidden, meta, layer_states.get(int(i)), residual)
        return hidden + residual

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``lm_head(norm(hidden)) / logits_scaling``; ``upcast`` as the other families'."""
        logits = self.lm_head(self.norm(hidden)) / self.cfg.logits_scaling
        return logits.float() if upcast else logits
