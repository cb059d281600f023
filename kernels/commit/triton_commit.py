"""Triton commit of accepted verify state, all layers in one launch: the GPU path of
``naive.commit_accept_ref`` (``state[:, row] = scratch[:, row, accept_length - 1]``) and of
``naive.commit_accept_conv_replay_ref`` (the same copy of the conv windows plus, for the
replay design, ``pending[:, row] = accept_length`` and ``slot[:, row]`` flipped, in the
same launch).

Grid: (layers x requests, chunks of one row's state). Each program copies one contiguous
chunk of ``S`` elements from ``scratch[l, row, a - 1]`` to ``state[l, row]``; with ``MARK``
the row's first chunk also writes ``pending[l, row]`` and flips ``slot[l, row]`` (one
program per layer and row, and the rows are distinct, so no two programs touch one
counter). Rows come from ``req_pool_indices`` only. The launch-only entry points skip an
entry whose accept length is 0: a CUDA graph's padding (``stage_server.graphs.CommitGraphs``),
which the checked entry points never let through.
"""
from __future__ import annotations

import math

import torch

import triton
import triton.language as tl

from ..checks import check_commit_conv_replay, check_rows, min_max


@triton.jit
def _commit_kernel(
    state, scratch, rows, acc, pending, slot,
    B, S,
    st_l, st_r, sc_l, sc_r, sc_d, pd_l, pd_r, sl_l, sl_r,
    BLOCK: tl.constexpr, MARK: tl.constexpr,
):
    i_lb = tl.program_id(0)
    i_c = tl.program_id(1)
    i_l = (i_lb // B).to(tl.int64)
    i_b = i_lb % B
    row = tl.load(rows + i_b).to(tl.int64)
    a = tl.load(acc + i_b).to(tl.int64)
    offs = i_c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = (offs < S) & (a > 0)  # accept length 0: a padding entry (CUDA graphs), skipped
    src = scratch + i_l * sc_l + row * sc_r + (a - 1) * sc_d + offs
    x = tl.load(src, mask=m)
    tl.store(state + i_l * st_l + row * st_r + offs, x.to(state.dtype.element_ty), mask=m)
    if MARK:
        if (i_c == 0) & (a > 0):
            tl.store(pending + i_l * pd_l + row * pd_r, a.to(pending.dtype.element_ty))
            p_s = slot + i_l * sl_l + row * sl_r
            tl.store(p_s, 1 - tl.load(p_s))


def _row_layout(t: torch.Tensor, lead: int) -> tuple[int, ...] | None:
    """The strides of ``t``'s dims after ``lead`` when they fill one dense block of memory
    (contiguous in some dim order, e.g. a transposed window), else None. Dims of size 1
    carry no layout (their stride reads as 0)."""
    dims = [(size, stride) for size, stride in zip(t.shape[lead:], t.stride()[lead:])]
    expect = 1
    for size, stride in sorted((d for d in dims if d[0] != 1), key=lambda d: d[1]):
        if stride != expect:
            return None
        expect *= size
    return tuple(0 if size == 1 else stride for size, stride in dims)


def _same_row_layout(state: torch.Tensor, scratch: torch.Tensor) -> bool:
    """A row's state and each of its scratch entries are dense blocks laid out alike: the
    commit may copy one as a flat span onto the other."""
    layout = _row_layout(state, 2)
    return layout is not None and layout == _row_layout(scratch, 3)


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
    if not _same_row_layout(state, scratch):
        raise ValueError("commit needs each row's state one dense block, laid out as in the scratch")
    launch_commit(state, scratch, req_pool_indices.to(state.device, torch.int64).contiguous(),
                  accept_lengths.to(state.device, torch.int64).contiguous())


def launch_commit(state, scratch, rows, acc) -> None:
    """The launch alone (no checks, no host sync: CUDA-graph capturable). ``rows`` and
    ``acc`` int64 on the device, already validated by the caller; an entry with accept
    length 0 writes nothing (padding)."""
    _launch(state, scratch, rows, acc, None, None)


def commit_accept_conv_replay_triton(conv: torch.Tensor, conv_scratch: torch.Tensor, pending: torch.Tensor,
                                     slot: torch.Tensor, req_pool_indices: torch.Tensor,
                                     accept_lengths: torch.Tensor) -> None:
    """Same shapes and semantics as :func:`naive.commit_accept_conv_replay_ref`: the replay
    design's whole commit (conv windows, ``pending``, ``slot`` of all L layers) in one
    launch. Validates shapes, rows and lengths first (:func:`checks.check_commit_conv_replay`),
    then :func:`launch_commit_conv_replay`; the dispatcher
    :func:`kernels.commit.commit_accept_conv_replay` validates once and launches directly.

    Raises:
        ValueError / IndexError: as :func:`checks.check_commit_conv_replay` and
            :func:`launch_commit_conv_replay`; nothing is written then.
    """
    if check_commit_conv_replay(conv, conv_scratch, pending, slot, req_pool_indices, accept_lengths):
        launch_commit_conv_replay(conv, conv_scratch, pending, slot, req_pool_indices, accept_lengths)


def launch_commit_conv_replay(conv, conv_scratch, pending, slot, rows, acc) -> None:
    """The replay design's commit as one launch, nothing else (no value checks, no host
    sync: CUDA-graph capturable). Shapes as :func:`naive.commit_accept_conv_replay_ref`;
    ``rows`` and ``acc`` ``[B]`` integer, contiguous, on the pool's device, already
    validated by the caller (rows in ``[0, R)`` and distinct, lengths in ``[1, D]``), except
    that an entry with accept length 0 writes nothing: padding, whose row may repeat.

    Raises:
        ValueError: before the launch, from host metadata alone: ``rows`` / ``acc`` not
            contiguous on the pool's device, or a row's conv window not one dense block
            laid out alike in ``conv`` and ``conv_scratch``.
    """
    dev = conv.device
    for name, t in (("req_pool_indices", rows), ("accept_lengths", acc)):
        if t.device != dev or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {dev}, got {t.device}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    if not _same_row_layout(conv, conv_scratch):
        raise ValueError("commit needs each row's conv window one dense block, laid out as in the scratch")
    _launch(conv, conv_scratch, rows, acc, pending, slot)


def _launch(state, scratch, rows, acc, pending, slot) -> None:
    L = state.shape[0]
    B = rows.numel()
    if L == 0 or B == 0:
        return
    S = math.prod(state.shape[2:])
    BLOCK = min(4096, triton.next_power_of_2(max(S, 1)))
    mark = pending is not None
    if not mark:
        pending = slot = rows  # never touched (MARK is off)
    # layers x requests on the first axis (up to 2^31 - 1 programs), chunks on the second;
    # at least one chunk, so the counters are written even for an empty window
    grid = (L * B, max(1, triton.cdiv(S, BLOCK)))
    _commit_kernel[grid](
        state, scratch, rows, acc, pending, slot, B, S,
        state.stride(0), state.stride(1), scratch.stride(0), scratch.stride(1), scratch.stride(2),
        pending.stride(0) if mark else 0, pending.stride(1) if mark else 0,
        slot.stride(0) if mark else 0, slot.stride(1) if mark else 0,
        BLOCK=BLOCK, MARK=mark, num_warps=8 if BLOCK >= 2048 else 4,
    )
