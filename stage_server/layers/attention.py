"""Grouped-query attention over the paged KV cache, as the Mamba2 hybrids define it
(transformers' ``NemotronHAttention``, ``GraniteMoeHybridAttention``, ``BambaAttention``,
``FalconH1Attention``): q / k / v projections (one GEMM), an optional rotary embedding,
softmax attention over the row's pages, ``o_proj``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppspec.kernels.attention import paged_attention, store_kv

from ..batch import per_part
from .common import fuse_linears
from .rotary import Rotary


class Attention(nn.Module):
    """``o_proj(softmax(q k^T * scale) v)`` with ``num_key_value_heads`` KV heads shared by
    groups of the ``num_attention_heads`` query heads, each ``head_dim`` wide (from ``cfg``).

    rotary: the model's :class:`Rotary` (shared, held outside the module tree so that
        parameter names stay the checkpoint's), or None for no positional encoding.
    bias: q / k / v / o biases. scale: the softmax scale (None: ``head_dim ** -0.5``).
    """

    def __init__(self, cfg, rotary: Rotary | None = None, bias: bool = False, scale: float | None = None):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=bias)
        self.scale = self.hd ** -0.5 if scale is None else scale
        self.rotary = [rotary]  # not a submodule (see above)
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    def fuse_projections(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, meta, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x ``[T, hidden]`` (normed), kv: this layer's ``(k_cache, v_cache)`` pages.
        Returns ``[T, hidden]``; the tokens' k / v are stored at ``meta.slots`` first."""
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
