"""Gated DeltaNet (GDN), the layer family of Qwen3-Next and Qwen3.5 (docs/DESIGN.md,
"Layer families"): its per-row state, its replay record and its token mixer.

Per row and layer (:meth:`GDNFamily.layout`): the conv window ``conv [conv_dim, K - 1]``
in the stage's dtype over the q|k|v channels (kept in a scratch after every verify step
in both commit designs), and the recurrent state ``ssm [HV, K, V]`` fp32 (a scratch per
verify step in the copy design; in the replay design the steps' inputs, ``k [H, K]``,
``delta [HV, V]``, ``g [HV]``, replayed by ``kernels.gdn``). The config supplies
``linear_num_key_heads`` (H), ``linear_num_value_heads`` (HV), ``linear_key_head_dim``
(K), ``linear_value_head_dim`` (V), ``linear_conv_kernel_dim``, ``conv_dim``,
``hidden_size`` and ``rms_norm_eps``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppspec.kernels.activation import gdn_gates
from ppspec.kernels.conv1d import causal_conv1d_prefill, causal_conv1d_update
from ppspec.kernels.gdn import (ReplayBuffers, gdn_prefill_rows, gdn_recurrent, gdn_recurrent_replay,
                                replay_flush)
from ppspec.kernels.norm import gated_rms_norm

from ..batch import PREFILL, VERIFY, BatchMeta, per_part
from ..family import REPLAY, SCRATCH, LayerFamily, LayerState, RecordSpec, StateLayout, StateSpec
from .common import fuse_linears


class GatedRMSNorm(nn.Module):
    """``w * x / rms(x) * silu(z)``: the output norm of a GDN layer (weight not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """GDN token mixer (Qwen3.5 parameter layout; Qwen3-Next's fused ``in_proj_qkvz`` /
    ``in_proj_ba`` are split into this layout at load time).

    The four input projections run as one GEMM against ``in_proj_weight``
    ``[conv_dim + value_dim + 2 HV, hidden]`` (qkv | z | b | a rows), built by
    :meth:`fuse_projections` once the weights are loaded.
    """

    def __init__(self, cfg):
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

    def forward(self, x: torch.Tensor, meta: BatchMeta, st: LayerState) -> torch.Tensor:
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

    def _mix(self, meta: BatchMeta, st: LayerState, mixed: torch.Tensor, g: torch.Tensor,
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


def gdn_layout(hk: int, hv: int, dk: int, dv: int, conv_dim: int, conv_width: int, *,
               per_channel_gate: bool = False, family: LayerFamily | None = None) -> StateLayout:
    """The gated delta rule's per-row state and replay record for these sizes
    (:meth:`GDNFamily.layout`); ``per_channel_gate``: the log decay recorded per key channel,
    ``g (HV, K)`` (KDA, ``layers/kda.py``), else per head."""
    return StateLayout(
        family or GDN,
        state=(StateSpec("conv", (conv_dim, conv_width - 1), None, SCRATCH, column_major=True),
               StateSpec("ssm", (hv, dk, dv), torch.float32, REPLAY)),
        record=(RecordSpec("k", (hk, dk)), RecordSpec("delta", (hv, dv)),
                RecordSpec("g", (hv, dk) if per_channel_gate else (hv,))),
    )


class GDNFamily(LayerFamily):
    """The GDN layer family; its module is :class:`GatedDeltaNet`."""

    name = "gdn"
    record_type = ReplayBuffers  # k, delta, g, pending, slot

    def layout(self, cfg) -> StateLayout:
        return gdn_layout(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim)

    def flush(self, st: LayerState, rows: torch.Tensor) -> None:
        replay_flush(st.ssm, st.replay, rows)


GDN = GDNFamily()
