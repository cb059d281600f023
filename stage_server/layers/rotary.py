"""Rotary position embedding for the families with rotary attention: frequencies from the
RoPE fields of a config (``stage_server.fields.rope_fields``), applied by ``kernels.rotary``."""
from __future__ import annotations

import math

import torch
from torch import nn

from ppspec.kernels.rotary import apply_rotary


def rope_frequencies(cfg) -> tuple[torch.Tensor, float]:
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

    def __init__(self, cfg):
        super().__init__()
        self.rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        inv_freq, self.attention_factor = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        return apply_rotary(q, k, positions, self.inv_freq, self.attention_factor)
