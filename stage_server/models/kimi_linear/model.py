"""Kimi Linear decoder, one pipeline stage's slice of it.

Layers follow transformers' ``modeling_kimi_linear`` (the independent reference): KDA token
mixers (Kimi Delta Attention: the gated delta rule with a decay per key channel, short
convolutions on q, k and v, an output gate through a sigmoid-gated RMSNorm), multi-head
latent attention (MLA, DeepSeek-V2) without RoPE in the full-attention layers, plain
RMSNorm ``w * x / rms(x)``, dense SwiGLU or a DeepSeek-V3 MoE (sigmoid router with a
correction bias, grouped top-k, routed scaling, shared experts). Parameter names equal the
published checkpoints' (``self_attn.q_conv1d``, ``block_sparse_moe.experts.{e}.w1`` are
mapped by the loader, ``weights.py``); tokens are packed ``[T, hidden]`` with the layout of
``stage_server.batch.BatchMeta``, and every pool is addressed by ``req_pool_index``.

KV cache (docs/DESIGN.md, "Kimi Linear"): an MLA layer stores per token only its compressed
latent ``[c, k_rope]`` (``kv_lora_rank + qk_rope_head_dim`` values, one "KV head"), once, as
keys and values alike. Attention runs on the latent with the key up-projection absorbed into
the query (``q_nope W_uk`` per head) and the value up-projection applied to the attention
output (``o_lat W_uv^T``): ``softmax(q_nope . (W_uk c) + q_rope . k_rope) (W_uv c)`` equals
``(softmax((W_uk^T q_nope) . c + q_rope . k_rope) c) W_uv^T`` per head: every head of a
request attends over the request's one latent head, keys its whole rows and values their
first ``kv_lora_rank`` columns (``kernels.attention.mla_attention``; on CUDA a Triton kernel
that computes the score as a ``kv_lora_rank``-wide plus a ``qk_rope_head_dim``-wide dot).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppspec.kernels.attention import mla_attention, store_kv
from ppspec.kernels.conv1d import causal_conv1d_prefill, causal_conv1d_update
from ppspec.kernels.kda import kda_prefill_rows, kda_recurrent, kda_recurrent_replay
from ppspec.kernels.norm import sigmoid_gated_rms_norm

from ...batch import PREFILL, VERIFY, BatchMeta, per_part
from ...family import LayerState
from ...graphs import family_graphs
from ...layers.common import MLP, RMSNorm, fuse_linears
from ...layers.kda import KDA
from ...layers.moe import Experts, routed_experts
from .config import KimiLinearConfig

# transformers' MLA builds its latent norms with the RMSNorm default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


class KimiDeltaAttention(nn.Module):
    """KDA token mixer. Projections of the normed input x: q, k, v (``H K`` each), beta
    logits (``H``), and the low-rank first halves of the forget gate (``f_a``) and of the
    output gate (``g_a``), run as one GEMM against ``in_proj_weight`` (built by
    :meth:`fuse_projections`). The three depthwise convs run as one over ``3 H K`` channels.

    Gates (transformers' ``KimiLinearForgetGate``): ``g = -exp(A_log[h]) *
    softplus(f_b(f_a(x)) + dt_bias)`` ``[T, H, K]`` fp32, the log decay per key channel;
    ``beta = sigmoid(b(x))``. Output: ``o_proj(o_norm(o, g_b(g_a(x))))`` with the
    sigmoid-gated RMSNorm per head.
    """

    def __init__(self, cfg: KimiLinearConfig):
        super().__init__()
        self.h, self.dk = cfg.linear_num_heads, cfg.linear_head_dim
        self.dim = self.h * self.dk
        hidden, w = cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.q_proj = nn.Linear(hidden, self.dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.dim, bias=False)
        self.b_proj = nn.Linear(hidden, self.h, bias=False)
        self.f_a_proj = nn.Linear(hidden, self.dk, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.dk, bias=False)
        self.f_b_proj = nn.Linear(self.dk, self.dim, bias=False)
        self.g_b_proj = nn.Linear(self.dk, self.dim, bias=False)
        self.q_conv1d = nn.Conv1d(self.dim, self.dim, w, groups=self.dim, bias=False)
        self.k_conv1d = nn.Conv1d(self.dim, self.dim, w, groups=self.dim, bias=False)
        self.v_conv1d = nn.Conv1d(self.dim, self.dim, w, groups=self.dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.h, 1))
        self.dt_bias = nn.Parameter(torch.zeros(self.dim))
        self.o_norm = RMSNorm(self.dk, cfg.rms_norm_eps)  # its weight; the gated norm is below
        self.o_proj = nn.Linear(self.dim, hidden, bias=False)
        self.register_buffer("in_proj_weight", None, persistent=False)
        self.register_buffer("conv_weight", None, persistent=False)
        # fp32, made by fuse_projections: -exp(A_log) [H, 1] and dt_bias [H K]
        self.register_buffer("neg_A", None, persistent=False)
        self.register_buffer("dt_bias_f32", None, persistent=False)

    def fuse_projections(self) -> None:
        self.in_proj_weight, _ = fuse_linears(self.q_proj, self.k_proj, self.v_proj, self.b_proj,
                                              self.f_a_proj, self.g_a_proj)
        # q | k | v channels of one depthwise conv, [3 H K, W] (the conv kernels' weight layout)
        # kept tap-major in memory as GDN's (strides (1, C)): the GPU conv kernels load one tap
        # of many channels at a time
        conv = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        self.conv_weight = conv.t().contiguous().t()
        # the gate's constants in fp32, once: not three kernels per layer and step
        self.neg_A = -self.A_log.detach().float().view(self.h, 1).exp()
        self.dt_bias_f32 = self.dt_bias.detach().float()

    def forward(self, x: torch.Tensor, meta, st: LayerState) -> torch.Tensor:
        """x: ``[T, hidden]`` (normed). Returns ``[T, hidden]`` in x's dtype."""
        T = x.shape[0]
        mixed, b, fa, ga = torch.split(F.linear(x, self.in_proj_weight), [3 * self.dim, self.h, self.dk, self.dk], -1)
        g = (self.f_b_proj(fa).float() + self.dt_bias_f32).view(T, self.h, self.dk)
        g = self.neg_A * F.softplus(g)  # softplus: x past 20 as transformers
        beta = torch.sigmoid(b)
        o = per_part(meta, lambda m, *xs: self._mix(m, st, *xs), mixed, g, beta)
        o = sigmoid_gated_rms_norm(o, self.g_b_proj(ga).view(T, self.h, self.dk), self.o_norm.weight, self.o_norm.eps)
        return self.o_proj(o.reshape(T, self.dim))

    def _mix(self, meta: BatchMeta, st: LayerState, mixed, g, beta) -> torch.Tensor:
        """Short convs and the delta rule of one part: ``mixed [T, 3 H K]``, ``g [T, H, K]``,
        ``beta [T, H]``. Returns ``o [T, H, K]``. Prefill starts a row from its committed
        state (continuing rows: the replay design's pending steps were applied by the stage
        first); decode advances it; verify writes the copy design's scratch or records the
        replay design's steps, never the committed state (docs/DESIGN.md, "Commit rule")."""
        T = mixed.shape[0]
        if meta.mode == PREFILL:
            mixed = causal_conv1d_prefill(mixed, self.conv_weight, None, st.conv, meta.rows, meta.cu_seqlens,
                                          meta.has_init)
        else:
            B, D = meta.batch_size, meta.tokens_per_request
            scratch = st.conv_scratch if meta.mode == VERIFY else None
            mixed = causal_conv1d_update(mixed.view(B, D, -1), self.conv_weight, None, st.conv, meta.rows,
                                         scratch).reshape(T, -1)
        q, k, v = (t.view(T, self.h, self.dk) for t in torch.split(mixed, self.dim, dim=-1))
        if meta.mode == PREFILL:
            return kda_prefill_rows(q, k, v, g, beta, meta.cu_seqlens, st.ssm, meta.rows, meta.has_init)
        B, D = meta.batch_size, meta.tokens_per_request
        args = (q.view(B, D, self.h, self.dk), k.view(B, D, self.h, self.dk), v.view(B, D, self.h, self.dk),
                g.view(B, D, self.h, self.dk), beta.view(B, D, self.h), st.ssm, meta.rows)
        if st.replay is not None:
            o = kda_recurrent_replay(*args, st.replay, verify=meta.mode == VERIFY)
        else:
            o = kda_recurrent(*args, st.ssm_scratch if meta.mode == VERIFY else None)
        return o.reshape(T, self.h, self.dk)


class LatentAttention(nn.Module):
    """Multi-head latent attention over the paged KV cache of compressed latents (module
    docstring). q: ``q_proj(x)`` or ``q_b_proj(q_a_layernorm(q_a_proj(x)))``, ``[T, nh,
    nope + rope]``; latent ``[c, k_rope]`` = ``kv_a_proj_with_mqa(x)`` with ``c`` through
    ``kv_a_layernorm``; ``kv_b_proj`` ``[nh (nope + v), kv_lora_rank]`` holds ``W_uk`` and
    ``W_uv`` per head. Softmax scale ``(nope + rope) ** -0.5``."""

    def __init__(self, cfg: KimiLinearConfig):
        super().__init__()
        self.nh, self.r = cfg.num_attention_heads, cfg.kv_lora_rank
        self.nope, self.rope, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        h, bias, qd = cfg.hidden_size, cfg.attention_bias, self.nh * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, qd, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, qd, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.r + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.r, self.nh * (self.nope + self.dv), bias=False)
        self.o_proj = nn.Linear(self.nh * self.dv, h, bias=bias)
        self.scale = (self.nope + self.rope) ** -0.5

    def forward(self, x: torch.Tensor, meta, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: ``[T, hidden]`` (normed); kv: the layer's ``(k_cache, v_cache)``, one tensor
        twice when the pool shares them. Returns ``[T, hidden]`` in x's dtype."""
        T = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(T, self.nh, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.r, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), k_rope], dim=-1).unsqueeze(1)  # [T, 1, r + rope]
        w = self.kv_b_proj.weight.view(self.nh, self.nope + self.dv, self.r)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]
        q_lat = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope], dim=-1)  # [T, nh, r + rope]
        k_cache, v_cache = kv
        store_kv(k_cache, v_cache, meta.slots, latent, latent)
        o = per_part(meta, lambda m, q: mla_attention(
            q, k_cache, m.page_table, m.rows, m.kv_lens, m.cu_seqlens, self.scale, self.r,
        ), q_lat.contiguous())  # [T, nh, r]
        o = torch.einsum("thr,hvr->thv", o, w_uv)
        return self.o_proj(o.reshape(T, self.nh * self.dv))


class Router(nn.Module):
    """DeepSeek-V3 routing (transformers' ``KimiLinearTopkRouter``), in fp32: scores
    ``sigmoid(x W^T)``; the experts are chosen on ``scores + e_score_correction_bias``, first
    the ``topk_group`` groups with the highest sum of their two best, then the top k inside
    them; the weights are the chosen scores (renormalised when ``norm_topk_prob``) times
    ``routed_scaling_factor``."""

    def __init__(self, cfg: KimiLinearConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        self.k, self.groups, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, hidden]`` -> ``(top_i [T, k] int64, top_w [T, k] fp32)``."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        T, E = choice.shape
        if self.topk_group < self.groups:  # else every group is kept (Kimi Linear: one group)
            by_group = choice.view(T, self.groups, E // self.groups)
            group_idx = by_group.topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros(T, self.groups, dtype=torch.bool, device=x.device).scatter_(1, group_idx, True)
            keep = keep.unsqueeze(-1).expand(T, self.groups, E // self.groups).reshape(T, E)  # each expert's group
            choice = choice.masked_fill(~keep, float("-inf"))
        top_i = choice.topk(self.k, dim=-1, sorted=False)[1]
        top_w = scores.gather(1, top_i)
        if self.norm:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_i, top_w * self.scaling


class MoE(nn.Module):
    """Routed SwiGLU experts plus ``n_shared_experts`` always-on experts as one MLP."""

    def __init__(self, cfg: KimiLinearConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_i, top_w = self.gate(x)
        return routed_experts(x, top_i, top_w, self.experts) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    """Pre-norm residual block, the stream as ``(h, residual)`` pairs as in
    ``models/qwen3_next/model.py``'s ``DecoderLayer``: KDA or MLA, then the dense MLP or the MoE."""

    def __init__(self, cfg: KimiLinearConfig, layer: int):
        super().__init__()
        self.layer_type = cfg.layer_types[layer]
        self.self_attn = KimiDeltaAttention(cfg) if self.layer_type == "linear_attention" else LatentAttention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta, state, residual: torch.Tensor | None = None):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual=residual)
        h = self.self_attn(h, meta, state)
        h, residual = self.post_attention_layernorm(h, residual=residual)
        return self.mlp(h), residual


class KimiStageModel(nn.Module):
    """Decoder layers ``[start, end)`` plus the embedding (first stage) and the final norm and
    ``lm_head`` (last stage); the stage model of ``stage_server.family.ModelFamily`` (no MTP
    head: Kimi Linear checkpoints have none). Needs :meth:`fuse_projections` after loading."""

    def __init__(self, cfg: KimiLinearConfig, start: int, end: int):
        super().__init__()
        self.cfg, self.start, self.end = cfg, start, end
        self.is_first, self.is_last = start == 0, end == cfg.num_hidden_layers
        if self.is_first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(start, end)})
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    layer_family = KDA  # the recurrent layers' family (stage_server.family.LayerFamily)
    # the KV pool holds the MLA latent once, as keys and values alike
    shared_kv = True
    # a prefill chunk runs fla's chunk_kda, which reads its chunk offsets on the host
    prefill_capturable = False

    @property
    def capturable(self) -> bool:
        """Decode / verify in CUDA graphs: unless ``PPSPEC_FAMILY_GRAPHS=0``
        (``graphs.family_graphs``). The MoE layers' experts run without a host read on CUDA
        (``layers.moe.routed_experts``)."""
        return family_graphs()

    @property
    def linear_layers(self) -> list[int]:
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] == "linear_attention"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] == "full_attention"]

    state_layers = linear_layers  # the stage's layers with recurrent state, in pool order
    kv_layers = attention_layers  # ... with paged KV

    def fuse_projections(self) -> None:
        for m in self.modules():
            if isinstance(m, (KimiDeltaAttention, MLP)):
                m.fuse_projections()

    def finish_load(self, device) -> None:
        """After the weights are loaded (``loader.load_stage_model``): the projections fused
        (no buffer to rebuild: MLA here has no RoPE)."""
        self.fuse_projections()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, meta, hidden: torch.Tensor, layer_states: dict) -> torch.Tensor:
        """As ``StageModel.forward``: ``[T, hidden]`` after layer ``end - 1``, before the final norm."""
        residual = None
        for i, layer in self.layers.items():
            hidden, residual = layer(hidden, meta, layer_states[int(i)], residual)
        return hidden + residual

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        return logits.float() if upcast else logits
