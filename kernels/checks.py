"""Argument checks shared by every dispatch function: they run before any launch, so a
bad row never reaches a kernel (which would write memory it does not own).

Reading a CUDA tensor's values on the host waits for the device, and a step that does it
in every layer spends most of its time waiting. The engine builds each micro-batch's index
tensors from host lists, so it states what it already knows about them with
:func:`known`; the checks read those facts instead of the device. A fact is dropped as
soon as its tensor is modified in place (the tensor's version counter moves; inference-mode
tensors have none, see :func:`known`), and a tensor without facts is read from the device
as before.
"""
from __future__ import annotations

from typing import Callable

import torch


def _version(t: torch.Tensor):
    # inference-mode tensors keep no version counter: their facts hold until stated again,
    # so state facts only about such tensors that nothing modifies afterwards
    return None if t.is_inference() else t._version


def known(t: torch.Tensor, **facts) -> torch.Tensor:
    """Attach host-known facts about ``t``'s current values and return ``t``: ``min`` /
    ``max`` are bounds (every value lies within them), other names are what the checks
    that read them say. Only state what the host knows of these very values."""
    t._ppspec_facts = (_version(t), facts)
    return t


def remember(t: torch.Tensor, name: str, value) -> None:
    """Add ``name`` to ``t``'s still-valid facts: a value derived from them (e.g. a plan
    made from the stated ``values``), which then lives exactly as long as they do."""
    f = getattr(t, "_ppspec_facts", None)
    facts = dict(f[1]) if f is not None and f[0] == _version(t) else {}
    facts[name] = value
    t._ppspec_facts = (_version(t), facts)


def fact(t: torch.Tensor, name: str, compute: Callable[[], object]):
    """The fact ``name`` about ``t`` if still valid, else ``compute()`` (may sync)."""
    f = getattr(t, "_ppspec_facts", None)
    if f is not None and f[0] == _version(t) and name in f[1]:
        return f[1][name]
    return compute()


def min_max(t: torch.Tensor) -> tuple[int, int]:
    """Bounds ``(lo, hi)`` of a non-empty integer tensor: its stated facts, or its exact
    min and max in one device read."""
    lo = fact(t, "min", lambda: None)
    hi = fact(t, "max", lambda: None)
    if lo is None or hi is None:
        lo, hi = (int(x) for x in torch.aminmax(t))
    return lo, hi


def check_rows(req_pool_indices: torch.Tensor, num_rows: int) -> None:
    """Raise IndexError unless every row is in ``[0, num_rows)`` (padding row included)."""
    if req_pool_indices.numel():
        lo, hi = min_max(req_pool_indices)
        if lo < 0 or hi >= num_rows:
            raise IndexError(f"req_pool_indices out of range [0, {num_rows}): min {lo}, max {hi}")


def check_commit(req_pool_indices: torch.Tensor, accept_lengths: torch.Tensor, num_rows: int, d_max: int | None) -> bool:
    """Validate one micro-batch's commit; returns False when there is nothing to commit.

    Raises:
        ValueError: lengths differ, or an accept length outside ``[1, d_max]``.
        IndexError: a row outside ``[0, num_rows)`` or a repeated row.
    """
    if req_pool_indices.shape != accept_lengths.shape:
        raise ValueError(
            f"req_pool_indices has {req_pool_indices.numel()} rows but accept_lengths has {accept_lengths.numel()}"
        )
    if req_pool_indices.numel() == 0:
        return False
    check_rows(req_pool_indices, num_rows)
    n = req_pool_indices.numel()
    if not fact(req_pool_indices, "unique", lambda: torch.unique(req_pool_indices).numel() == n):
        raise IndexError(f"commit rows repeat: {req_pool_indices.tolist()}")
    lo, hi = min_max(accept_lengths)
    if lo < 1 or (d_max is not None and hi > d_max):
        raise ValueError(f"accept lengths must be in [1, {d_max}]: {accept_lengths.tolist()}")
    return True


def check_commit_conv_replay(conv: torch.Tensor, conv_scratch: torch.Tensor, pending: torch.Tensor, slot: torch.Tensor,
                             req_pool_indices: torch.Tensor, accept_lengths: torch.Tensor) -> bool:
    """Validate one micro-batch's replay-design commit (shapes of
    :func:`kernels.commit.naive.commit_accept_conv_replay_ref`, then :func:`check_commit`
    with ``num_rows = rows + 1`` and ``d_max = D``); returns False when there is nothing to
    commit. Reads the device only for facts the caller did not state.

    Raises:
        ValueError: shapes that do not fit together, non-integer ``pending`` / ``slot``, an
            accept length outside ``[1, D]`` or a length mismatch.
        IndexError: a row outside ``[0, rows + 1)`` or a repeated row.
    """
    if conv.dim() < 2 or conv_scratch.shape[:2] != conv.shape[:2] or conv_scratch.shape[3:] != conv.shape[2:] \
            or conv_scratch.dim() != conv.dim() + 1:
        raise ValueError(f"conv_scratch {tuple(conv_scratch.shape)} does not match conv {tuple(conv.shape)}")
    if pending.shape != conv.shape[:2] or slot.shape != conv.shape[:2]:
        raise ValueError(f"pending {tuple(pending.shape)} and slot {tuple(slot.shape)} must be "
                         f"[L, R] = {tuple(conv.shape[:2])}, the conv pool's layers and rows")
    if pending.dtype.is_floating_point or slot.dtype.is_floating_point:
        raise ValueError(f"pending and slot must be integer tensors, got {pending.dtype} and {slot.dtype}")
    return check_commit(req_pool_indices, accept_lengths, conv.shape[1], conv_scratch.shape[2])
