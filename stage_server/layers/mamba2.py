"""Mamba2 (SSD), the layer family of the Mamba2 hybrids (NemotronH, Granite 4.0 hybrid, Bamba,
Falcon-H1):
its per-row state, its replay record and its token mixer (docs/DESIGN.md, "Layer families";
docs/DESIGN.md, "NemotronH (Mamba2)").

Per row and layer (:meth:`Mamba2Family.layout`): the conv window ``conv [C, W - 1]`` in the
stage's dtype over the ``x | B | C`` channels (``C = H P + 2 G N``; kept in a scratch after
every verify step in both commit designs), and the state ``ssm [H, P, N]`` fp32 (heads x head
dim x state size; a scratch per verify step in the copy design). The replay design records
per verify step ``x (H, P)``, the discretised ``dt (H,)``, the decay ``dA = exp(dt A) (H,)``
and ``B (G, N)`` (``kernels/mamba2/naive_replay.py``): a replayed step reads no state and no
model parameter. The config supplies ``mamba_num_heads`` (H), ``mamba_head_dim`` (P),
``n_groups`` (G), ``ssm_state_size`` (N), ``conv_kernel`` (W), ``conv_dim``, ``use_conv_bias``,
``use_bias`` (the in / out projections), ``dt_limit`` (the prefill's clamp of ``dt``),
``hidden_size`` and ``rms_norm_eps``; a model family sets what differs (Falcon-H1: the out
projection's bias, the output norm's form) through :class:`Mamba2Mixer`'s arguments.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppspec.kernels.conv1d import causal_conv1d_prefill, causal_conv1d_update
from ppspec.kernels.mamba2 import (Mamba2ReplayBuffers, mamba2_gated_rms_norm, mamba2_prefill_rows, mamba2_recurrent,
                                   mamba2_recurrent_replay, mamba2_replay_flush)

from ..batch import PREFILL, VERIFY, BatchMeta, per_part
from ..family import REPLAY, SCRATCH, LayerFamily, LayerState, RecordSpec, StateLayout, StateSpec

CHUNK_SIZE = 64  # tokens per block of the chunked scan (the result does not depend on it)


# the output gate and norm of a Mamba2 mixer (``Mamba2Mixer(norm=...)``)
GATE_THEN_NORM = "gate_then_norm"  # w * rmsnorm_per_group(y * silu(z)): NemotronH, Granite, Bamba,
#                                    Falcon-H1 with mamba_norm_before_gate false
NORM_THEN_GATE = "norm_then_gate"  # w * rmsnorm_per_group(y) * silu(z): Falcon-H1's default
GATE_ONLY = "gate_only"            # y * silu(z), no norm: Falcon-H1 with mamba_rms_norm false
NORMS = (GATE_THEN_NORM, NORM_THEN_GATE, GATE_ONLY)


class GroupGatedRMSNorm(nn.Module):
    """Mamba2's output norm over groups of ``group_size`` channels, the gate ``silu(z)``
    applied before the norm or after it (``norm_before_gate``; transformers' ``*RMSNormGated``
    of the Mamba2 hybrids, ``kernels.mamba2.mamba2_gated_rms_norm``: one Triton launch on CUDA)."""

    def __init__(self, dim: int, group_size: int, eps: float, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return mamba2_gated_rms_norm(y, z, self.weight, self.group_size, self.eps, self.norm_before_gate)


class Mamba2Mixer(nn.Module):
    """Mamba2 token mixer (transformers' ``NemotronHMamba2Mixer``, ``GraniteMoeHybridMambaLayer``).

    ``in_proj`` ``[I + C + H, hidden]`` yields the gate ``z`` (I = H P), the conv input
    ``xBC`` (C channels) and the raw time step ``dt`` (H). The causal conv (with its bias,
    SiLU) runs over ``xBC``; then the SSD scan with ``A = -exp(A_log)``, ``dt = softplus(dt +
    dt_bias)`` (clamped to ``dt_limit`` in prefill, as transformers' chunked scan; unclamped
    in decode and verify, as its one-token update), B / C of group ``h // (H / G)``, skip
    ``D x``; then the gate and group norm (``norm``: one of :data:`NORMS`) and ``out_proj``.

    out_bias: ``out_proj``'s bias (None: ``cfg.use_bias``, as ``in_proj``'s; Falcon-H1 reads
    it from ``projectors_bias``).
    """

    def __init__(self, cfg, out_bias: bool | None = None, norm: str = GATE_THEN_NORM):
        super().__init__()
        self.h, self.p = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.g, self.n = cfg.n_groups, cfg.ssm_state_size
        self.inner = self.h * self.p
        self.conv_dim = cfg.conv_dim
        self.dt_limit = cfg.dt_limit
        self.in_proj = nn.Linear(cfg.hidden_size, self.inner + self.conv_dim + self.h, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim,
                                bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.h))
        self.A_log = nn.Parameter(torch.zeros(self.h))
        self.D = nn.Parameter(torch.ones(self.h))
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        self.norm = None if norm == GATE_ONLY else GroupGatedRMSNorm(
            self.inner, self.inner // self.g, cfg.rms_norm_eps, norm_before_gate=norm == NORM_THEN_GATE)
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.use_bias if out_bias is None else out_bias)
        self.register_buffer("A", None, persistent=False)  # -exp(A_log) fp32, made by fuse_projections

    def fuse_projections(self) -> None:
        # the conv kernels load one tap of many channels at a time: tap-major in memory
        w = self.conv1d.weight
        self.conv1d.weight = nn.Parameter(w.detach().permute(2, 1, 0).contiguous().permute(2, 1, 0),
                                          requires_grad=w.requires_grad)
        # the decay rate, the same for every step: computed once, not by two kernels per step
        self.A = -torch.exp(self.A_log.detach().float())

    def forward(self, x: torch.Tensor, meta, st: LayerState) -> torch.Tensor:
        """x: ``[T, hidden]`` (normed). Returns ``[T, hidden]`` in x's dtype."""
        T = x.shape[0]
        z, xbc, dt = torch.split(self.in_proj(x), [self.inner, self.conv_dim, self.h], dim=-1)
        y = per_part(meta, lambda m, xbc, dt: self._mix(m, st, xbc, dt), xbc, dt)
        y = y.reshape(T, self.inner)
        y = y * F.silu(z) if self.norm is None else self.norm(y, z)
        return self.out_proj(y.to(x.dtype))

    def _mix(self, meta: BatchMeta, st: LayerState, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """Conv window and SSD scan of one part: ``xbc [T, C]``, ``dt [T, H]`` raw.
        Returns ``y [T, H, P]``."""
        T = xbc.shape[0]
        weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
        if meta.mode == PREFILL:
            xbc = causal_conv1d_prefill(xbc, weight, bias, st.conv, meta.rows, meta.cu_seqlens, meta.has_init)
        else:
            Bs, D = meta.batch_size, meta.tokens_per_request
            scratch = st.conv_scratch if meta.mode == VERIFY else None
            xbc = causal_conv1d_update(xbc.reshape(Bs, D, -1), weight, bias, st.conv, meta.rows, scratch).reshape(T, -1)
        xs, B, C = torch.split(xbc, [self.inner, self.g * self.n, self.g * self.n], dim=-1)
        xs, B, C = xs.reshape(T, self.h, self.p), B.reshape(T, self.g, self.n), C.reshape(T, self.g, self.n)
        A = self.A
        if meta.mode == PREFILL:
            # replay design: the stage has applied a continuing row's pending steps and
            # dropped a new row's before this chunk (StageRunner._replay_before_prefill)
            return mamba2_prefill_rows(xs, dt, A, B, C, self.D, self.dt_bias, meta.cu_seqlens, st.ssm, meta.rows,
                                       meta.has_init, self.dt_limit, CHUNK_SIZE)
        Bs, D = meta.batch_size, meta.tokens_per_request
        args = (xs.reshape(Bs, D, self.h, self.p), dt.reshape(Bs, D, self.h), A, B.reshape(Bs, D, self.g, self.n),
                C.reshape(Bs, D, self.g, self.n), self.D, self.dt_bias, st.ssm, meta.rows)
        if st.replay is not None:
            # replay design: pending accepted steps first; a verify keeps only its steps'
            # inputs, a decode writes its final state (docs/DESIGN.md, "Commit rule")
            y = mamba2_recurrent_replay(*args, st.replay, verify=meta.mode == VERIFY)
        else:
            y = mamba2_recurrent(*args, st.ssm_scratch if meta.mode == VERIFY else None)
        return y.reshape(T, self.h, self.p)


class Mamba2Family(LayerFamily):
    """The Mamba2 layer family; its module is :class:`Mamba2Mixer`."""

    name = "mamba2"
    record_type = Mamba2ReplayBuffers  # x, dt, dA, B, pending, slot

    def layout(self, cfg) -> StateLayout:
        h, p, g, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
        return StateLayout(
            self,
            state=(StateSpec("conv", (cfg.conv_dim, cfg.conv_kernel - 1), None, SCRATCH, column_major=True),
                   StateSpec("ssm", (h, p, n), torch.float32, REPLAY)),
            record=(RecordSpec("x", (h, p)), RecordSpec("dt", (h,)), RecordSpec("dA", (h,)), RecordSpec("B", (g, n))),
        )

    def flush(self, st: LayerState, rows: torch.Tensor) -> None:
        mamba2_replay_flush(st.ssm, st.replay, rows)


MAMBA2 = Mamba2Family()
