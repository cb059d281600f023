"""Triton commit of accepted verify state, all layers in one launch: the GPU path of
``naive.commit_accept_ref`` (``state[:, row] = scratch[:, row, accept_length - 1]``).

Grid: (chunks of one row's state, layers x requests). Each program copies one contiguous
chunk of ``S`` elements from ``scratch[l, row, a - 1]`` to ``state[l, row]``; rows come from
``req_pool_indices`` only.
"""
from __future__ import annotations

import math

import torch

import triton
import triton.language as tl

from ..checks import check_rows, min_max


@triton.jit
def _commit_kernel(
    state, scratch, rows, acc,
    B, S,
    st_l, st_r, sc_l, sc_r, sc_d,
    BLOCK: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_lb = tl.program_id(1)
    i_l = (i_lb // B).to(tl.int64)
    i_b = i_lb % B
    row = tl.load(rows + i_b).to(tl.int64)
    a = tl.load(acc + i_b).to(tl.int64)
    offs = i_c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < S
    src = scratch + i_l * sc_l + row * sc_r + (a - 1) * sc_d + offs
    x = tl.load(src, mask=m)
    tl.store(state + i_l * st_l + row * st_r + offs, x.to(state.dtype.element_ty), mask=m)


def _inner_contiguous(t: torch.Tensor, lead: int) -> bool:
    expect = 1
    for size, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def commit_accept_triton(state: torch.Tensor, scratch: torch.Tensor, req_pool_indices: torch.Tensor,
                         accept_lengths: torch.Tensor) -> None:
    """Same shapes and semantics as :func:`naive.commit_accept_ref`; one launch for all L
    layers. Validates rows and lengths before the launch (the dispatcher does too)."""
    L, R = state.shape[:2]
    if scratch.shape[:2] != (L, R) or scratch.shape[3:] != state.shape[2:]:
        raise ValueError(f"scratch {tuple(scratch.shape)} does not match state {tuple(state.shape)}")
    B = req_pool_indices.numel()
    if accept_lengths.numel() != B:
        raise ValueError("req_pool_indices and accept_lengths differ in length")
    if B == 0 or L == 0:
        return
    d = scratch.shape[2]
    check_rows(req_pool_indices, R)
    lo, hi = min_max(accept_lengths)
    if lo < 1 or hi > d:
        raise ValueError(f"accept lengths must be in [1, {d}]: {accept_lengths.tolist()}")
    if not (_inner_contiguous(state, 2) and _inner_contiguous(scratch, 3)):
        raise ValueError("commit needs each row's state contiguous")
    launch_commit(state, scratch, req_pool_indices.to(state.device, torch.int64).contiguous(),
                  accept_lengths.to(state.device, torch.int64).contiguous())


def launch_commit(state, scratch, rows, acc) -> None:
    """The launch alone (no checks, no host sync: CUDA-graph capturable). ``rows`` and
    ``acc`` int64 on the device, already validated by the caller."""
    L = state.shape[0]
    B = rows.numel()
    S = math.prod(state.shape[2:])
    BLOCK = min(4096, triton.next_power_of_2(max(S, 1)))
    grid = (triton.cdiv(S, BLOCK), L * B)
    _commit_kernel[grid](
        state, scratch, rows, acc, B, S,
        state.stride(0), state.stride(1), scratch.stride(0), scratch.stride(1), scratch.stride(2),
        BLOCK=BLOCK, num_warps=8 if BLOCK >= 2048 else 4,
    )
