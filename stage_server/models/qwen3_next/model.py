"""Qwen3-Next / Qwen3.5 hybrid decoder, one pipeline stage's slice of it.

Layers follow the reference models of Hugging Face transformers (``modeling_qwen3_next``,
``modeling_qwen3_5``, ``modeling_qwen3_5_moe``): Gated DeltaNet token mixers, gated full
attention every few layers, zero-centred RMSNorm ``x * (1 + w)``, dense SwiGLU or a sparse
MoE with a sigmoid-gated shared expert. Module and parameter names equal the checkpoint's
so that loading is a name lookup; after loading, projections that read the same input
become views of one weight each (:meth:`StageModel.fuse_projections`), one GEMM per set.

Tokens of a micro-batch are packed without padding (``[T, hidden]``); the per-request
layout is in :class:`BatchMeta`. Recurrent state, conv windows and KV live in pools
addressed by ``req_pool_index`` (``stage_server.pools``), never by batch position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ppspec.kernels.activation import gdn_gates, silu_mul
from ppspec.kernels.attention import paged_attention, store_kv
from ppspec.kernels.conv1d import causal_conv1d_prefill, causal_conv1d_update
from ppspec.kernels.gdn import ReplayBuffers, gdn_prefill_rows, gdn_recurrent, gdn_recurrent_replay
from ppspec.kernels.norm import gated_rms_norm, rms_norm
from ppspec.kernels.rotary import apply_rotary

from .config import HybridConfig

from ppspec.proto.messages import DECODE, PREFILL, VERIFY  # noqa: F401


@dataclass
class BatchMeta:
    """Layout of one micro-batch on one stage.

    mode: ``prefill`` (a chunk of each prompt; linear state starts from ``state[row]`` when
    ``seq_lens > 0``, else zeros, and the final state is written to ``state[row]``),
    ``decode`` (one token, state updated in place) or ``verify`` (``D`` tokens per request,
    the state after each step written to the verify scratch at ``row``, or with the replay
    commit design only the steps' inputs kept at ``row``).
    rows: ``[B]`` int64 ``req_pool_indices``. seq_lens: ``[B]`` tokens already cached.
    extend_lens: ``[B]`` new tokens. cu_seqlens: ``[B + 1]``. positions: ``[T]``.
    slots: ``[T]`` flat KV slot of each token (paged KV of this stage's attention layers).
    attn_plan: None, or the step's FlashInfer plan over this meta's KV pool
    (``kernels.attention.flashinfer.PrefillPlan``; eager prefill of a stage that uses
    FlashInfer), planned by the first attention layer and reused by the others.
    """

    mode: str
    rows: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor | None
    page_table: torch.Tensor | None
    kv_lens: torch.Tensor  # [B] seq_lens + extend_lens
    tokens_per_request: int  # D for decode/verify (every request has the same count), host-known
    # prefill only: ``[B]`` bool, seq_lens > 0 (the row continues a chunked prefill), made
    # once per step rather than per layer
    has_init: torch.Tensor | None = None
    attn_plan: object | None = None

    @property
    def batch_size(self) -> int:
        return int(self.rows.numel())


@dataclass
class MixedMeta:
    """Layout of a mixed micro-batch: its parts (a decode or verify :class:`BatchMeta`,
    then a prefill one) over consecutive token ranges ``[bounds[i], bounds[i + 1])``.

    The token-wise work (projections, norms, RoPE, the KV store, the MLP) runs over all
    ``T`` tokens at once, so decodes and prefill chunks share its GEMMs; attention and the
    GDN conv / recurrence run per part with that part's kernel (:func:`per_part`).
    positions, slots: ``[T]``, the parts' concatenated."""

    parts: list[BatchMeta]
    bounds: list[int]
    positions: torch.Tensor
    slots: torch.Tensor | None
    mode: str = "mixed"

    @classmethod
    def of(cls, parts: list[BatchMeta], extend_lens: list[list[int]]) -> MixedMeta:
        """``extend_lens``: each part's, from the host (the bounds without a device read)."""
        bounds = [0]
        for e in extend_lens:
            bounds.append(bounds[-1] + sum(e))
        slots = None if parts[0].slots is None else torch.cat([m.slots for m in parts])
        return cls(parts, bounds, torch.cat([m.positions for m in parts]), slots)


def per_part(meta, fn, *xs: torch.Tensor) -> torch.Tensor:
    """``fn(meta, *xs)``; for a :class:`MixedMeta`, ``fn(part, *token slices)`` per part,
    concatenated over tokens. ``xs``: ``[T, ...]`` tensors."""
    if not isinstance(meta, MixedMeta):
        return fn(meta, *xs)
    b = meta.bounds
    return torch.cat([fn(m, *(x[b[i]:b[i + 1]] for x in xs)) for i, m in enumerate(meta.parts)])


@dataclass
class LinearLayerState:
    """Views of one GDN layer's pools: ``conv [rows+1, C, W-1]``, ``ssm [rows+1, HV, K, V]``
    fp32, the conv verify scratch ``conv_scratch [rows+1, D, C, W-1]`` and either the copy
    design's ``ssm_scratch [rows+1, D, HV, K, V]`` or the replay design's ``replay``
    buffers (``kernels.gdn.ReplayBuffers``); both None when the stage never verifies."""

    conv: torch.Tensor
    ssm: torch.Tensor
    conv_scratch: torch.Tensor | None
    ssm_scratch: torch.Tensor | None
    replay: ReplayBuffers | None = None


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


class GatedRMSNorm(nn.Module):
    """``w * x / rms(x) * silu(z)``: the output norm of a GDN layer (weight not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)


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


class GatedDeltaNet(nn.Module):
    """GDN token mixer (Qwen3.5 parameter layout; Qwen3-Next's fused ``in_proj_qkvz`` /
    ``in_proj_ba`` are split into this layout at load time).

    The four input projections run as one GEMM against ``in_proj_weight``
    ``[conv_dim + value_dim + 2 HV, hidden]`` (qkv | z | b | a rows), built by
    :meth:`fuse_projections` once the weights are loaded.
    """

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = conv_dim = cfg.conv_dim
        h = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(h, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.hv, bias=False)
        self.in_proj_a = nn.Linear(h, self.hv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.register_buffer("in_proj_weight", None, persistent=False)

    def fuse_projections(self) -> None:
        self.in_proj_weight, _ = fuse_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        # the conv kernels load one tap of many channels at a time: keep the depthwise
        # weight [C, 1, W] tap-major in memory (same shape and values, strides (1, C, C))
        w = self.conv1d.weight
        self.conv1d.weight = nn.Parameter(w.detach().permute(2, 1, 0).contiguous().permute(2, 1, 0),
                                          requires_grad=w.requires_grad)

    def forward(self, x: torch.Tensor, meta: BatchMeta, st: LinearLayerState) -> torch.Tensor:
        """x: ``[T, hidden]`` (normed). Returns ``[T, hidden]`` in x's dtype."""
        T = x.shape[0]
        # column slices of one GEMM's output: the kernels below read them in place (row strides)
        mixed, z, b, a = torch.split(
            F.linear(x, self.in_proj_weight), [self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1
        )
        z = z.view(T, self.hv, self.dv)
        # beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias): the log decay, in fp32
        # (Mamba2 discretisation)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        o = per_part(meta, lambda m, *xs: self._mix(m, st, *xs), mixed, g, beta)
        o = self.norm(o, z).reshape(T, self.value_dim)
        return self.out_proj(o)

    def _mix(self, meta: BatchMeta, st: LinearLayerState, mixed: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> torch.Tensor:
        """Conv window and gated delta rule of one part: ``mixed [T, conv_dim]`` (the qkv
        columns of the input GEMM), ``g, beta [T, HV]``. Returns ``o [T, HV, V]``."""
        T = mixed.shape[0]
        weight = self.conv1d.weight.squeeze(1)
        if meta.mode == PREFILL:
            mixed = causal_conv1d_prefill(mixed, weight, None, st.conv, meta.rows, meta.cu_seqlens, meta.has_init)
        else:
            B, D = meta.batch_size, meta.tokens_per_request
            scratch = st.conv_scratch if meta.mode == VERIFY else None
            mixed = causal_conv1d_update(mixed.view(B, D, -1), weight, None, st.conv, meta.rows, scratch).reshape(T, -1)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.view(T, self.hk, self.dk), k.view(T, self.hk, self.dk), v.view(T, self.hv, self.dv)
        if meta.mode == PREFILL:
            # replay design: the stage has already applied a continuing row's pending steps
            # and dropped a new row's (StageRunner._replay_before_prefill)
            o = gdn_prefill_rows(q, k, v, g, beta, meta.cu_seqlens, st.ssm, meta.rows, meta.has_init)
        else:
            B, D = meta.batch_size, meta.tokens_per_request
            args = (
                q.view(B, D, self.hk, self.dk), k.view(B, D, self.hk, self.dk), v.view(B, D, self.hv, self.dv),
                g.view(B, D, self.hv), beta.view(B, D, self.hv), st.ssm, meta.rows,
            )
            if st.replay is not None:
                # replay design: pending accepted steps first; a verify keeps only its inputs,
                # a decode writes its final state (docs/DESIGN.md, "Commit rule")
                o = gdn_recurrent_replay(*args, st.replay, verify=meta.mode == VERIFY)
            else:
                o = gdn_recurrent(*args, st.ssm_scratch if meta.mode == VERIFY else None)
            o = o.reshape(T, self.hv, self.dv)
        return o


def rope_frequencies(cfg: HybridConfig) -> tuple[torch.Tensor, float]:
    """The rotary embedding's inverse frequencies and attention factor, for every RoPE type
    served (``config.ROPE_TYPES``); the one place they are computed.

    ``default``: ``theta ** (-2i / rotary_dim)`` (Su et al. 2021, RoFormer), factor 1.
    ``linear``: those divided by ``rope_scaling_factor``, factor 1.
    ``yarn`` (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
    Models", sec. 3.2-3.4; the same arithmetic as transformers' ``_compute_yarn_parameters``,
    fp32 op by op): with ``s = factor`` and ``L = original_max_position_embeddings``, pair
    ``i`` of the rotated dims (frequency ``base_i = theta^(-2i / rotary_dim)``) turns
    ``r(i) = L * base_i / (2 pi)`` times over ``L`` tokens. ``i(beta)``, where ``r = beta``
    (solved for ``i``; floor / ceil when ``truncate``, clipped to ``[0, rotary_dim - 1]`` as
    there), bound a linear ramp ``gamma_i = clamp((i - i(beta_fast)) / (i(beta_slow) -
    i(beta_fast)), 0, 1)``; ``inv_freq_i = base_i / s * gamma_i + base_i * (1 - gamma_i)``:
    pairs that turn many times keep their frequency, slow ones are interpolated by ``s``.
    The attention factor is ``attention_factor`` when set, else ``mscale(s, mscale) /
    mscale(s, mscale_all_dim)`` when both are set, else ``mscale(s)``, with ``mscale(s, m=1)
    = 0.1 m ln s + 1`` (1 for ``s <= 1``). It multiplies cos and sin
    (``kernels.rotary.apply_rotary``'s ``scale``), so only the rotated dims of q and k
    (their share of ``q . k``, by its square), as in transformers.

    Returns:
        ``(inv_freq, attention_factor)``: ``[rotary_dim // 2]`` fp32 on the CPU, and a float.
    """
    dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    if cfg.rope_type != "yarn":
        inv = 1.0 / (cfg.rope_theta ** exponents)
        return inv / cfg.rope_scaling_factor, 1.0
    y = cfg.rope_yarn
    powers = cfg.rope_theta ** exponents  # theta^(2i / rotary_dim) = 1 / base_i, fp32
    keep = 1.0 / powers
    interpolated = 1.0 / (y.factor * powers)

    def pair_turning(turns: float) -> float:
        # the pair i that turns ``turns`` times over the original context (real-valued)
        ctx = y.original_max_position_embeddings
        return dim * math.log(ctx / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    lo, hi = pair_turning(y.beta_fast), pair_turning(y.beta_slow)
    if y.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # a step, not a division by zero
    gamma = ((torch.arange(dim // 2, dtype=torch.float) - lo) / (hi - lo)).clamp(0, 1)
    kept = 1 - gamma
    inv = interpolated * (1 - kept) + keep * kept

    def magnitude(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if y.attention_factor is not None:
        att = y.attention_factor
    elif y.mscale and y.mscale_all_dim:
        att = magnitude(y.factor, y.mscale) / magnitude(y.factor, y.mscale_all_dim)
    else:
        att = magnitude(y.factor)
    return inv, float(att)


class Rotary(nn.Module):
    """Partial rotary embedding on the first ``rotary_dim`` dims of each head, rotate-half
    form: holds ``inv_freq`` (fp32, kept so after the model's dtype cast by the loader) and
    the attention factor (a float, 1 unless YaRN) from :func:`rope_frequencies` for
    ``kernels.rotary.apply_rotary``, which rotates q and k together."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        inv_freq, self.attention_factor = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        return apply_rotary(q, k, positions, self.inv_freq, self.attention_factor)


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


class MLP(nn.Module):
    """SwiGLU ``down_proj(silu(gate_proj(x)) * up_proj(x))``; gate and up run as one GEMM
    against ``gate_up_weight`` ``[2 I, hidden]``, built by :meth:`fuse_projections`."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)

    def fuse_projections(self) -> None:
        self.gate_up_weight, _ = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[T, hidden]``. Returns ``[T, hidden]`` in x's dtype."""
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)  # silu_mul reads the halves in place
        return self.down_proj(silu_mul(gate, up))


class Router(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))


class Experts(nn.Module):
    """Expert weights stacked: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""

    def __init__(self, cfg: HybridConfig):
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


class SparseMoE(nn.Module):
    """Top-k softmax routing (optionally renormalised) plus a sigmoid-gated shared expert."""

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
        return run_experts(x, top_i, top_w.to(x.dtype), self.experts) + shared


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

    @property
    def linear_layers(self) -> list[int]:
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] == "linear_attention"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] == "full_attention"]

    def fuse_projections(self) -> None:
        """Concatenate the projections that read the same input (GDN qkv/z/b/a, attention
        q/k/v, MLP and shared-expert gate/up, the MTP head's layer included) into one
        weight each, so each set is one GEMM; parameters become views of it
        (:func:`fuse_linears`). GDN conv weights become tap-major in memory. Call after
        loading, on the final device and dtype."""
        for m in self.modules():
            if isinstance(m, (GatedDeltaNet, GatedAttention, MLP)):
                m.fuse_projections()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.is_first else self.mtp_embed_tokens
        return table(input_ids)

    def forward(self, meta: BatchMeta, hidden: torch.Tensor, layer_states: dict) -> torch.Tensor:
        """Run this stage's layers. ``hidden`` is the embedded input on the first stage.

        layer_states: global layer index -> :class:`LinearLayerState` or ``(k_cache, v_cache)``.
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
