"""Memory budgeting of a stage: what its weights and pools take, known before any pool is
allocated, against the bytes it may use (``--memory-budget-gb``; several stages can share
one GPU). The CUDA graphs' share is measured as they are captured (``StageRunner``)."""
from __future__ import annotations

import torch

from .family import StateLayout
from .pools import RowStatePool


def gib(n: int) -> str:
    """``n`` bytes for a budget message: GiB to two decimals, and the exact bytes, which
    tell a need from a budget that round alike."""
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def pool_bytes(model, dtype: torch.dtype, kv_layers: int, kv_tokens: int, page_size: int, nkv: int, head_dim: int,
               layout: StateLayout | None, state_layers: int, max_rows: int, d: int,
               commit_design: str) -> dict[str, int]:
    """Bytes of a stage's weights (``model``'s parameters, as loaded), paged KV (``kv_layers``
    layers, the MTP head's counted, ``kv_tokens`` tokens in pages of ``page_size`` plus the
    padding page, ``nkv`` x ``head_dim`` per token, keys and values unless the model shares
    them) and recurrent state (``state_layers`` layers of ``layout``, ``max_rows`` rows, its
    verify scratch or replay record for ``d`` tokens): ``{"weights", "kv", "state"}``."""
    esize = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    pages = -(-kv_tokens // page_size) + 1  # + the padding page
    kv = kv_layers * (1 if model.shared_kv else 2) * pages * page_size * nkv * head_dim * esize
    state = sum(RowStatePool.nbytes_of(layout, state_layers, max_rows, d, dtype, commit_design).values()) \
        if state_layers else 0
    return {"weights": weights, "kv": kv, "state": state}


def check_fits(who: str, parts: dict[str, int], workspace: int, budget: int) -> int:
    """``parts`` (:func:`pool_bytes`) plus ``workspace`` bytes, or ValueError naming each when
    they exceed ``budget`` (bytes)."""
    need = sum(parts.values()) + workspace
    if need > budget:
        raise ValueError(
            f"{who} needs {gib(need)} (weights {parts['weights'] / 2**30:.2f}, KV {parts['kv'] / 2**30:.2f}, "
            f"state + verify scratch {parts['state'] / 2**30:.2f}) but its memory budget is {gib(budget)}: "
            f"lower --max-rows / --kv-tokens or raise the budget"
        )
    return need
