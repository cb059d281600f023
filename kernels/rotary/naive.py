"""Plain-torch rotary position embedding (the reference of the Triton kernel beside it)."""
from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """``cos`` and ``sin`` of ``positions x inv_freq`` in fp32, times ``scale`` in fp32 (the
    attention factor of YaRN; skipped at 1, where it is exact), rounded to ``dtype``:
    ``[T, 1, rotary_dim]`` each, the frequencies repeated over both halves (rotate-half form)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               scale: float = 1.0):
    """Partial rotary embedding, rotate-half form (``apply_rotary_pos_emb`` of transformers'
    ``modeling_qwen3_5`` with ``partial_rotary_factor``): the first ``rotary_dim = 2 *
    len(inv_freq)`` dims of each head become ``x * cos + rotate_half(x) * sin``, the rest
    pass through; cos and sin are multiplied by ``scale`` in fp32 before their rounding (the
    rotary embedding's ``attention_scaling`` there); products and sum rounded to x's dtype
    one op at a time, as there.

    Args:
        q: ``[T, Hq, head_dim]``. k: ``[T, Hk, head_dim]`` (same dtype). positions: ``[T]``
            int64 token positions. inv_freq: ``[rotary_dim / 2]`` fp32. scale: a float
            (YaRN's attention factor; 1.0 otherwise).

    Returns:
        ``(q, k)`` rotated, new tensors of the inputs' shapes and dtype.
    """
    cos, sin = rotary_cos_sin(positions, inv_freq, q.dtype, scale)
    rd = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rd], x[..., rd:]
        rotated = torch.cat([-rot[..., rd // 2:], rot[..., : rd // 2]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)

    return rotate(q), rotate(k)
