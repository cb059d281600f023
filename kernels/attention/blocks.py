"""Tile sizes of the Triton paged attention (``gpu.py``) that fit one program's shared
memory. Plain Python (no Triton import), so the CPU tests check the rule."""
from __future__ import annotations

from typing import Callable

# Shared memory a program may plan for: the H200 allows 227 KiB per block; the margin is
# Triton's own scratch. The tiles of every head dim up to 256 fit as chosen in gpu.py; the
# MLA latent (Kimi Linear: 512 + 64 = 576) has its own kernel and tiles (mla.py, mla_tiles).
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


def mla_shared_bytes(block_m: int, block_n: int, stages: int, width: int, elt: int) -> int:
    """What one MLA program (``mla.py``) may hold in shared memory, counted high: the
    query tile staged once for its dot layout, the latent tile ``[block_n, width]`` in
    each of ``stages`` pipeline buffers, and one more latent tile for the layout
    conversions of the two dots that read it (as keys, transposed, and as values).
    ``width``: the padded rank plus the padded rope width; ``elt``: bytes per element."""
    return elt * width * (block_m + block_n * (stages + 1))


def mla_tiles(width: int, elt: int) -> tuple[int, int, int, int]:
    """``(block_m, block_n, stages, num_warps)`` of the MLA kernel for a padded latent
    ``width`` and ``elt``-byte inputs, chosen to fit :data:`SHARED_BUDGET` by
    :func:`mla_shared_bytes` before any compile: 16 (query, head) rows a program (one
    token's 16 heads); 16-bit inputs 32 keys a block through a 2-stage pipeline on 8 warps,
    fp32 (IEEE products) 16 keys unpipelined on 4. Every ``tl.dot`` dimension stays >= 16.
    Compiled for sm_90 at Kimi Linear's 512 + 64 (Triton 3.6): 68 KiB of shared memory and
    211 registers without spills in bf16, 72 KiB and 254 registers in fp32; 32 rows on 8
    warps spilled, as did 4 warps at 16 rows in bf16. Raises ValueError when even 16 keys
    unpipelined do not fit."""
    fp32 = elt >= 4
    block_m = 16
    block_n, stages, warps = (16, 1, 4) if fp32 else (32, 2, 8)
    while mla_shared_bytes(block_m, block_n, stages, width, elt) > SHARED_BUDGET:
        if stages > 1:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            raise ValueError(f"MLA latent width {width} is too wide for one program's shared memory")
    return block_m, block_n, stages, warps
