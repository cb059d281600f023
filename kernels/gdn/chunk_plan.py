"""fla's varlen chunk plan computed on the device, in plain torch (no fla, no Triton): the
CUDA graphs of long prefill chunks record it (``stage_server.graphs``), and it imports where
fla does not (the CPU tests run the graphs' padded path eagerly, with the reference GDN)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # fla's chunk length (tokens); a sequence of n tokens has ceil(n / CHUNK) chunks


def device_chunk_plan(cu_seqlens: torch.Tensor, num_chunks: int, slots: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk plan of ``fla_prefill.chunk_plan`` computed on the device (no host read, so
    a CUDA graph can record it), for sequences that have exactly ``num_chunks`` chunks in all
    (the caller's bucket guarantees it: fla's grids are sized by it). ``slots``: a cached
    ``arange(num_chunks)`` on the device (made when None). Returns ``(chunk_indices
    [num_chunks, 2]`` int64, (sequence, chunk within it) per chunk, ``chunk_offsets
    [B + 1]`` int64, each sequence's first chunk)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    offsets = F.pad(((lens + CHUNK - 1) // CHUNK).cumsum(0), (1, 0))
    if slots is None:
        slots = torch.arange(num_chunks, device=cu_seqlens.device, dtype=offsets.dtype)
    seq = torch.searchsorted(offsets, slots, right=True) - 1
    return torch.stack([seq, slots - offsets[seq]], 1), offsets
