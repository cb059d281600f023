"""Qwen3-Next / Qwen3.5 hybrid decoder, one pipeline stage's slice of it.

Layers follow the reference models of Hugging Face transformers (``modeling_qwen3_next``,
``modeling_qwen3_5``, ``modeling_qwen3_5_moe``): Gated DeltaNet token mixers, gated full
attention every few layers, zero-centred RMSNorm ``x * (1 + w)``, dense SwiGLU or a sparse
MoE with a sigmoid-gated shared expert. Module and parameter names equal the checkpoint's
so that loading is a name lookup; after loading, projections that read the same input
become views of one weight each (:meth:`StageModel.fuse_projections`), one GEMM per set.

The GDN mixer is the layer family of ``stage_server.layers.gdn``; RoPE, the SwiGLU MLP
and the projection fusing are shared blocks (``stage_server.layers``). Tokens of a
micro-batch are packed without padding (``[T, hidden]``; ``stage_server.batch``). Recurrent
state, conv windows and KV live in pools addressed by ``req_pool_index``
(``stage_server.pools``), never by batch position.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppspec.kernels.attention import paged_attention, store_kv
from ppspec.kernels.norm import rms_norm

from ...batch import BatchMeta, per_part
from ...layers.common import MLP, fuse_linears
from ...layers.gdn import GDN, GatedDeltaNet
from ...layers.moe import Experts, routed_experts
from ...layers.rotary import Rotary, rope_frequencies
from .config import HybridConfig


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + w)`` in fp32 (Qwen3-Next / Qwen3.5).

    With ``residual`` it returns ``(norm(x + residual), x + residual)``, the sum in x's
    dtype: a decoder layer's residual add fused into its norm (one kernel on CUDA).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)


class GatedAttention(nn.Module):
    """Full attention with an output gate: ``q_proj`` yields query and gate per head,
    per-head q/k RMSNorm, partial RoPE, output ``o_proj(attn * sigmoid(gate))``.

    q/k/v run as one GEMM against ``qkv_weight`` ``[2 Hq hd + 2 Hkv hd, hidden]`` (and
    ``qkv_bias`` with ``attention_bias``), built by :meth:`fuse_projections`.
    """

    def __init__(self, cfg: HybridConfig, rotary: Rotary):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.nh * self.hd * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.rotary = [rotary]  # shared, not a submodule (keeps parameter names checkpoint-exact)
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    def fuse_projections(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, meta: BatchMeta, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: ``[T, hidden]`` (normed). Returns ``[T, hidden]`` in x's dtype."""
        T = x.shape[0]
        qg, k, v = torch.split(
            F.linear(x, self.qkv_weight, self.qkv_bias),
            [2 * self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1,
        )
        q, gate = qg.view(T, self.nh, 2 * self.hd).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, self.nkv, self.hd))
        v = v.view(T, self.nkv, self.hd)
        q, k = self.rotary[0](q, k, meta.positions)
        k_cache, v_cache = kv
        store_kv(k_cache, v_cache, meta.slots, k, v)
        # the output gate, read in place from its strided view, is applied in the Triton
        # kernel's epilogue on CUDA (no sigmoid or product kernel; FlashInfer's path applies
        # it after the attention)
        o = per_part(meta, lambda m, q, gate: paged_attention(
            q, k_cache, v_cache, m.page_table, m.rows, m.kv_lens, m.cu_seqlens, self.hd ** -0.5,
            gate=gate, plan=m.attn_plan,
        ), q, gate)
        return self.o_proj(o.reshape(T, self.nh * self.hd))


class Router(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))


class SparseMoE(nn.Module):
    """Top-k softmax routing (optionally renormalised) plus a sigmoid-gated shared expert;
    the routed experts run by ``layers.moe.routed_experts`` (no host read on CUDA)."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed_experts(x, top_i, top_w.to(x.dtype), self.experts) + shared


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or gated attention), then MLP / MoE.

    The residual stream travels as a pair ``(h, residual)`` whose sum it is: a layer's
    closing add is left to the next layer's ``input_layernorm``, which fuses it (one
    kernel on CUDA); the caller adds the last layer's pair.
    """

    def __init__(self, cfg: HybridConfig, layer_type: str, moe: bool, rotary: Rotary):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg, rotary)
        self.mlp = SparseMoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: BatchMeta, state, residual: torch.Tensor | None = None):
        """x, residual: ``[T, hidden]``, the stream ``x + residual`` entering the layer
        (``residual`` None: x is the stream itself).

        Returns ``(h, residual)``, ``[T, hidden]`` each: the stream after the layer is
        ``h + residual``.
        """
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            # the previous layer's closing add and this norm, one kernel on CUDA
            h, residual = self.input_layernorm(x, residual=residual)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, meta, state)
        else:
            h = self.self_attn(h, meta, state)
        h, residual = self.post_attention_layernorm(h, residual=residual)
        return self.mlp(h), residual


class MTPHead(nn.Module):
    """Multi-token-prediction head (``mtp.*`` keys; DeepSeek-V3 MTP as in Qwen3-Next / Qwen3.5).

    At position p: ``u = fc(cat(pre_fc_norm_embedding(embed(x[p+1])), pre_fc_norm_hidden(h_p)))``,
    then one full-attention decoder layer at rotary position p; ``norm(u)`` through the
    shared ``lm_head`` predicts ``x[p+2]``. ``h_p`` is the target's last decoder-layer
    output before the final norm; the chain's next step takes the layer output ``u``.
    """

    def __init__(self, cfg: HybridConfig, rotary: Rotary):
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention", cfg.is_moe_layer(-1), rotary)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, meta: BatchMeta, kv) -> torch.Tensor:
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        h, residual = self.layers[0](u, meta, kv)
        return h + residual


class StageModel(nn.Module):
    """Decoder layers ``[start, end)`` plus the embedding (first stage) and the final norm,
    ``lm_head`` and MTP head (last stage). Parameter names equal the checkpoint's, without
    its decoder prefix (``model.`` or ``model.language_model.``).

    The forward needs :meth:`fuse_projections`, called once the weights are loaded
    (``loader.load_stage_model`` does).
    """

    def __init__(self, cfg: HybridConfig, start: int, end: int, with_mtp: bool):
        super().__init__()
        self.cfg, self.start, self.end = cfg, start, end
        self.is_first, self.is_last = start == 0, end == cfg.num_hidden_layers
        self.rotary = Rotary(cfg)
        if self.is_first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(cfg, cfg.layer_types[i], cfg.is_moe_layer(i), self.rotary)
                for i in range(start, end)
            }
        )
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if with_mtp:
                self.mtp = MTPHead(cfg, self.rotary)
                if not self.is_first:
                    # The MTP head embeds the token it conditions on; stages past the first
                    # keep their own copy of the (shared) embedding for it.
                    self.mtp_embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    layer_family = GDN  # the recurrent layers' family (stage_server.family.LayerFamily)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] == "linear_attention"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] == "full_attention"]

    state_layers = linear_layers  # the stage's layers with recurrent state, in pool order
    kv_layers = attention_layers  # ... with paged KV
    shared_kv = False  # keys and values are two tensors of the KV pool

    # the decode / verify forward reads nothing on the host, MoE layers included (their
    # experts run by layers.moe.routed_experts), so every stage records it in CUDA graphs;
    # PPSPEC_FAMILY_GRAPHS (graphs.family_graphs) is the other families' switch, not this one's
    capturable = True

    def fuse_projections(self) -> None:
        """Concatenate the projections that read the same input (GDN qkv/z/b/a, attention
        q/k/v, MLP and shared-expert gate/up, the MTP head's layer included) into one
        weight each, so each set is one GEMM; parameters become views of it
        (:func:`fuse_linears`). GDN conv weights become tap-major in memory. Call after
        loading, on the final device and dtype."""
        for m in self.modules():
            if isinstance(m, (GatedDeltaNet, GatedAttention, MLP)):
                m.fuse_projections()

    def finish_load(self, device) -> None:
        """After the weights are loaded (``loader.load_stage_model``): the non-persistent
        buffers made on the meta device rebuilt on ``device``, then the projections fused."""
        self.rotary.inv_freq = rope_frequencies(self.cfg)[0].to(device)
        self.fuse_projections()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.is_first else self.mtp_embed_tokens
        return table(input_ids)

    def forward(self, meta: BatchMeta, hidden: torch.Tensor, layer_states: dict) -> torch.Tensor:
        """Run this stage's layers. ``hidden`` is the embedded input on the first stage.

        layer_states: global layer index -> its ``stage_server.family.LayerState`` (GDN) or ``(k_cache, v_cache)``.
        Returns ``[T, hidden]``: the residual stream after layer ``end - 1`` (pre final norm).
        """
        residual = None
        for i, layer in self.layers.items():
            hidden, residual = layer(hidden, meta, layer_states[int(i)], residual)
        return hidden + residual

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``lm_head(norm(hidden))``: ``[N, vocab]`` in fp32, or with ``upcast=False`` in the
        model's dtype, for a caller that only takes the argmax: upcasting is exact, so the
        argmax (first index among ties, for every dtype) is the same, and a bf16 stage
        saves a copy kernel of ``[N, vocab]``."""
        logits = self.lm_head(self.norm(hidden))
        return logits.float() if upcast else logits

    def mtp_logits(self, mtp_hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """The MTP head's logits from its output ``[N, hidden]``; ``upcast`` as in :meth:`logits`."""
        logits = self.lm_head(self.mtp.norm(mtp_hidden))
        return logits.float() if upcast else logits
