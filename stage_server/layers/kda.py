"""Kimi Delta Attention (KDA), the layer family of Kimi Linear: the gated delta rule with a
log decay per key channel (docs/DESIGN.md, "Layer families"). Its state is GDN's
(``layers/gdn.py``): one conv window over the q|k|v channels (kept after every verify step)
and the recurrent state ``ssm [H, K, V]`` fp32; the replay design records ``k``, ``delta``
and the per-channel log decay ``g [H, K]``. The mixer is ``models/kimi_linear/model.py``'s
``KimiDeltaAttention``; the kernels are ``kernels/kda``.
"""
from __future__ import annotations

import torch

from ppspec.kernels.gdn import ReplayBuffers
from ppspec.kernels.kda import kda_replay_flush

from ..family import LayerFamily, LayerState, StateLayout
from .gdn import gdn_layout


class KDAFamily(LayerFamily):
    name = "kda"
    record_type = ReplayBuffers  # k, delta, g (per key channel), pending, slot

    def layout(self, cfg) -> StateLayout:
        return gdn_layout(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim,
                          per_channel_gate=True, family=self)

    def flush(self, st: LayerState, rows: torch.Tensor) -> None:
        # kernels/kda's flush (Triton on CUDA): GDN's Triton replay keeps one log decay per head
        kda_replay_flush(st.ssm, st.replay, rows)


KDA = KDAFamily()
