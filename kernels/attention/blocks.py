"""Tile sizes of the Triton paged attention (``gpu.py``) that fit one program's shared
memory. Plain Python (no Triton import), so the CPU tests check the rule."""
from __future__ import annotations

from typing import Callable

# Shared memory a program may plan for: the H200 allows 227 KiB per block; the margin is
# Triton's own scratch. The tiles of every head dim up to 256 fit as chosen in gpu.py; the
# MLA latent (Kimi Linear: 512 + 64 = 576, padded to 1024) needs smaller ones.
SHARED_BUDGET = 200 * 1024

# what launched after a shrink, by the tiles first tried: (bd, elt, bm, bn, stages) -> (bm, bn, stages)
_FITTED: dict[tuple, tuple[int, int, int]] = {}


def shrink(block_m: int, block_n: int, stages: int, bd: int) -> tuple[int, int, int]:
    """One step down: fewer pipeline stages, then fewer keys, then fewer query rows per
    block. Raises ValueError when all are at their least."""
    if stages > 1:
        return block_m, block_n, stages - 1
    if block_n > 16:
        return block_m, block_n // 2, stages
    if block_m > 16:
        return block_m // 2, block_n, stages
    raise ValueError(f"attention head dim {bd} is too wide for one program's shared memory")


def fit_shared(block_m: int, block_n: int, stages: int, bd: int, elt: int) -> tuple[int, int, int]:
    """Shrink until the Q tile and ``stages`` K and V tiles fit :data:`SHARED_BUDGET`:
    ``elt`` bytes x ``bd`` x (``block_m`` + 2 ``block_n`` ``stages``). A lower bound of what
    Triton allocates (at the 1024-wide MLA head it asked 256 KiB for tiles this counts as
    160 KiB, on the H200): :func:`launch_fitting` shrinks further when a launch is refused."""
    while elt * bd * (block_m + 2 * block_n * stages) > SHARED_BUDGET:
        block_m, block_n, stages = shrink(block_m, block_n, stages, bd)
    return block_m, block_n, stages


def launch_fitting(launch: Callable[[int, int, int], object], block_m: int, block_n: int, stages: int,
                   bd: int, elt: int):
    """``launch(block_m, block_n, stages)``, shrinking the tiles while Triton refuses them
    for shared memory (its ``OutOfResources``, raised before anything runs); the tiles that
    launched are remembered for the next call with the same start. Returns launch's result."""
    key = (bd, elt, block_m, block_n, stages)
    tiles = _FITTED.get(key, (block_m, block_n, stages))
    while True:
        try:
            out = launch(*tiles)
        except Exception as e:  # noqa: BLE001  (triton.runtime.errors.OutOfResources, without importing triton)
            if type(e).__name__ != "OutOfResources":
                raise
            tiles = shrink(*tiles, bd)
            continue
        if tiles != (block_m, block_n, stages):
            _FITTED[key] = tiles
        return out
