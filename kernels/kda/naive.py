"""Plain-torch Kimi Delta Attention (KDA): the gated delta rule with a decay per key channel
(Kimi Team, "Kimi Linear", 2025, eq. 1). Per head, with the state ``S`` ``[K, V]``::

    S_t = diag(exp(g_t)) S_{t-1} + k_t (beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t))^T
    o_t = S_t^T (scale * q_t)

``g_t`` ``[K]`` per head (<= 0), q and k L2-normalised, ``scale = K ** -0.5``; query, key and
value heads are equal in number. GDN is the same rule with one decay per head, so there is one
reference for both (``kernels/gdn/naive.py``, which takes the gate per head or per channel);
the names here are KDA's view of it, with ``g`` ``[..., H, K]``:

- :func:`chunk_kda_ref` (prefill; shapes as ``chunk_gated_delta_rule_ref``),
- :func:`recurrent_kda_ref` (decode, and verify with the copy design's scratch),
- the replay commit through ``kernels/gdn/naive_replay.py`` with ``per_channel_gate=True``
  buffers: a verify keeps each step's normalised key, delta and per-channel log decay at the
  row, and the next step of the row replays the accepted ones (docs/DESIGN.md, "Commit rule").
"""
from __future__ import annotations

from ..gdn.naive import chunk_gated_delta_rule_ref as chunk_kda_ref
from ..gdn.naive import recurrent_gated_delta_rule_ref as recurrent_kda_ref

__all__ = ["chunk_kda_ref", "recurrent_kda_ref"]
