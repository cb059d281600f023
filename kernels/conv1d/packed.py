"""Causal conv1d prefill over packed sequences in a fixed number of torch ops: the GPU path
of :func:`naive.causal_conv1d_prefill_ref` (same shapes and semantics).

The reference loops over sequences (about eight launches each, and three host reads of the
index tensors); at 32 prompts and six GDN layers that is 1500 launches per prefill. Here
every token gathers its ``W`` inputs at once from ``[x; windows]``: input ``i - (W-1) + j``
of a sequence's token ``i`` is ``x[cu[b] + i - (W-1) + j]`` when non-negative, else entry
``(W-1) + i - (W-1) + j`` of the row's window (zeros for a new request). No host read.
"""
from __future__ import annotations

import torch

from .naive import _act


def causal_conv1d_prefill_packed(x, weight, bias, conv_state, req_pool_indices, cu_seqlens, has_initial_state,
                                 activation="silu"):
    """Shapes as :func:`naive.causal_conv1d_prefill_ref`; products summed in fp32, output
    in x's dtype, windows written in ``conv_state``'s dtype."""
    T, C = x.shape
    W = weight.shape[-1]
    B = req_pool_indices.numel()
    dev = x.device
    rows = req_pool_indices.to(dev)
    cu = cu_seqlens.to(dev)
    lens = cu[1:] - cu[:-1]
    prev = conv_state[rows].transpose(1, 2).to(torch.float32)  # [B, W-1, C]
    prev = prev * has_initial_state.to(dev).view(B, 1, 1)
    src = torch.cat([x.to(torch.float32), prev.reshape(B * (W - 1), C)])  # [T + B(W-1), C]

    def source(b, pos):  # input ``pos`` (may be negative) of sequence ``b``
        return torch.where(pos >= 0, cu[b] + pos, T + b * (W - 1) + (W - 1) + pos)

    seq = torch.repeat_interleave(torch.arange(B, device=dev), lens, output_size=T)  # [T]
    i = torch.arange(T, device=dev) - cu[seq]
    taps = torch.arange(W, device=dev)
    idx = source(seq[:, None], i[:, None] - (W - 1) + taps)  # [T, W]
    y = (src[idx] * weight.to(torch.float32).t()).sum(1)  # [T, C]
    if bias is not None:
        y = y + bias.to(torch.float32)
    # the new window: the sequence's last W - 1 inputs (from the old window when L < W - 1)
    last = source(torch.arange(B, device=dev)[:, None], lens[:, None] - (W - 1) + torch.arange(W - 1, device=dev))
    conv_state[rows] = src[last].transpose(1, 2).to(conv_state.dtype)
    return _act(y, activation).to(x.dtype)
