"""Plain-torch causal depthwise conv1d over packed sequences, with a state window per row.

The window of a row holds the last ``W - 1`` inputs (channels first: ``[C, W - 1]``),
W being the kernel width. Output ``y_t = act(sum_j w[:, j] * x_{t - (W-1) + j} + bias)``
as ``torch.nn.functional.conv1d`` with left padding from the window (the short conv of
Mamba2 / GDN layers; transformers' ``causal_conv1d_fn`` / ``causal_conv1d_update``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _act(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(x)
    if activation is None:
        return x
    raise ValueError(f"unsupported conv activation {activation!r}")


def causal_conv1d_prefill_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    req_pool_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal conv over each packed sequence, continuing from (and updating) its window.

    Args:
        x: ``[T, C]`` packed inputs. weight: ``[C, W]``. bias: ``[C]`` or None.
        conv_state: ``[rows + 1, C, W - 1]`` window pool; ``conv_state[row]`` is read when
            ``has_initial_state[b]`` (a later prefill chunk) and overwritten with the last
            ``W - 1`` inputs of the sequence.
        req_pool_indices: ``[B]`` stable rows. cu_seqlens: ``[B + 1]``.
        has_initial_state: ``[B]`` bool; False starts from zeros (a new request).

    Returns:
        ``[T, C]`` outputs in x's dtype.
    """
    W = weight.shape[-1]
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    rows = req_pool_indices.tolist()
    init = has_initial_state.tolist()
    for b, row in enumerate(rows):
        xs = x[bounds[b] : bounds[b + 1]].t().to(weight.dtype)  # [C, L]
        prev = conv_state[row].to(weight.dtype) if init[b] else xs.new_zeros(xs.shape[0], W - 1)
        full = torch.cat([prev, xs], dim=-1)  # [C, W - 1 + L]
        y = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=xs.shape[0])[0]
        out[bounds[b] : bounds[b + 1]] = _act(y, activation).t().to(x.dtype)
        conv_state[row] = full[:, full.shape[-1] - (W - 1) :].to(conv_state.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    req_pool_indices: torch.Tensor,
    conv_scratch: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Step the conv over ``D`` new tokens per request (decode: D = 1; verify: D > 1).

    Args:
        x: ``[B, D, C]``. weight: ``[C, W]``. bias: ``[C]`` or None.
        conv_state: ``[rows + 1, C, W - 1]`` committed windows, read at ``req_pool_indices``.
        conv_scratch: ``[rows + 1, D_max, C, W - 1]`` or None. With a scratch (verify) the
            window after step ``t`` goes to ``conv_scratch[row, t]`` and ``conv_state`` is
            untouched until the commit; without (decode) the final window is written back.

    Returns:
        ``[B, D, C]`` outputs in x's dtype.
    """
    B, D, C = x.shape
    W = weight.shape[-1]
    prev = conv_state[req_pool_indices].to(weight.dtype)  # [B, C, W-1]
    full = torch.cat([prev, x.transpose(1, 2).to(weight.dtype)], dim=-1)  # [B, C, W-1+D]
    y = F.conv1d(full, weight.unsqueeze(1), bias, groups=C)  # [B, C, D]
    if conv_scratch is not None:
        windows = full.unfold(-1, W - 1, 1)[:, :, 1:]  # [B, C, D, W-1]: window after each step
        conv_scratch[req_pool_indices, :D] = windows.permute(0, 2, 1, 3).to(conv_scratch.dtype)
    else:
        conv_state[req_pool_indices] = full[:, :, D:].to(conv_state.dtype)
    return _act(y, activation).transpose(1, 2).to(x.dtype)
