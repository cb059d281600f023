"""The layout of one micro-batch on one stage, which every layer family reads.

Tokens of a micro-batch are packed without padding (``[T, hidden]``); the per-request
layout is a :class:`BatchMeta` (one mode) or a :class:`MixedMeta` (decodes or verifies and
prefill chunks together). State and KV live in pools addressed by ``req_pool_index``
(``stage_server.pools``), never by batch position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ppspec.proto.messages import DECODE, PREFILL, VERIFY  # noqa: F401  (the modes, defined once in proto/)


@dataclass
class BatchMeta:
    """Layout of one micro-batch on one stage.

    mode: ``prefill`` (a chunk of each prompt; linear state starts from ``state[row]`` when
    ``seq_lens > 0``, else zeros, and the final state is written to ``state[row]``),
    ``decode`` (one token, state updated in place) or ``verify`` (``D`` tokens per request,
    the state after each step written to the verify scratch at ``row``, or with the replay
    commit design only the steps' inputs kept at ``row``).
    rows: ``[B]`` int64 ``req_pool_indices``. seq_lens: ``[B]`` tokens already cached.
    extend_lens: ``[B]`` new tokens. cu_seqlens: ``[B + 1]``. positions: ``[T]``.
    slots: ``[T]`` flat KV slot of each token (paged KV of this stage's attention layers).
    attn_plan: None, or the step's FlashInfer plan over this meta's KV pool
    (``kernels.attention.flashinfer.PrefillPlan``; eager prefill of a stage that uses
    FlashInfer), planned by the first attention layer and reused by the others.
    """

    mode: str
    rows: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor | None
    page_table: torch.Tensor | None
    kv_lens: torch.Tensor  # [B] seq_lens + extend_lens
    tokens_per_request: int  # D for decode/verify (every request has the same count), host-known
    # prefill only: ``[B]`` bool, seq_lens > 0 (the row continues a chunked prefill), made
    # once per step rather than per layer
    has_init: torch.Tensor | None = None
    attn_plan: object | None = None

    @property
    def batch_size(self) -> int:
        return int(self.rows.numel())


class MixedMeta:
    """Layout of a mixed micro-batch: its parts (a decode or verify :class:`BatchMeta`,
    then a prefill one) over consecutive token ranges ``[bounds[i], bounds[i + 1])``.

    The token-wise work (projections, norms, RoPE, the KV store, the MLP) runs over all
    ``T`` tokens at once, so decodes and prefill chunks share its GEMMs; attention and the
    GDN conv / recurrence run per part with that part's kernel (:func:`per_part`).
    positions, slots: ``[T]``, the parts' concatenated, joined when first read: after a
    graph replay nothing reads them (the last stage samples per part), and two joins are
    two launches on the step's path."""

    mode = "mixed"

    def __init__(self, parts: list[BatchMeta], bounds: list[int], positions: torch.Tensor | None = None,
                 slots: torch.Tensor | None = None):
        self.parts, self.bounds = parts, bounds
        self._positions, self._slots = positions, slots

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            self._positions = torch.cat([m.positions for m in self.parts])
        return self._positions

    @property
    def slots(self) -> torch.Tensor | None:
        """None without attention layers (a graph's layout carries placeholder slots even then)."""
        if self._slots is None and all(m.slots is not None for m in self.parts):
            self._slots = torch.cat([m.slots for m in self.parts])
        return self._slots

    @classmethod
    def of(cls, parts: list[BatchMeta], extend_lens: list[list[int]]) -> MixedMeta:
        """``extend_lens``: each part's, from the host (the bounds without a device read)."""
        bounds = [0]
        for e in extend_lens:
            bounds.append(bounds[-1] + sum(e))
        return cls(parts, bounds)


def per_part(meta, fn, *xs: torch.Tensor) -> torch.Tensor:
    """``fn(meta, *xs)``; for a :class:`MixedMeta`, ``fn(part, *token slices)`` per part,
    concatenated over tokens. ``xs``: ``[T, ...]`` tensors."""
    if not isinstance(meta, MixedMeta):
        return fn(meta, *xs)
    b = meta.bounds
    return torch.cat([fn(m, *(x[b[i]:b[i + 1]] for x in xs)) for i, m in enumerate(meta.parts)])
