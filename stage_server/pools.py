"""Per-stage memory pools, every one addressed by ``req_pool_index`` (a stable row).

Row ``max_rows`` of each pool is the padding row. Rows are allocated by the router's
scheduler; a stage only checks them and tracks which are in use (for ``Info``).
"""
from __future__ import annotations

import torch

from ppspec.kernels.commit import commit_accept

from .model import LinearLayerState


class PoolExhaustedError(RuntimeError):
    """The KV pool has no free page for a request; nothing was allocated."""


class KVPool:
    """Paged KV cache of ``num_layers`` attention layers.

    k, v: ``[num_layers, num_pages, page_size, Hkv, hd]``; page_table: ``[rows + 1,
    max_pages_per_row]`` int64 (unused entries point at page 0, never read: attention
    only reads positions below each row's KV length).
    """

    def __init__(self, num_layers, max_rows, token_budget, page_size, nkv, hd, max_context, dtype, device):
        self.page_size = page_size
        self.num_pages = max(1, -(-token_budget // page_size))
        self.max_pages_per_row = -(-max_context // page_size)
        shape = (num_layers, self.num_pages, page_size, nkv, hd)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_table = torch.zeros(max_rows + 1, self.max_pages_per_row, dtype=torch.long, device=device)
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.row_pages: dict[int, list[int]] = {}

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    def ensure(self, rows: list[int], lengths: list[int]) -> None:
        """Give each row pages for ``length`` tokens. All or nothing.

        Raises:
            PoolExhaustedError: not enough free pages (no page is taken).
            ValueError: a length beyond the context the page table covers.
        """
        need = []
        for row, n in zip(rows, lengths):
            pages = -(-n // self.page_size)
            if pages > self.max_pages_per_row:
                raise ValueError(f"row {row}: {n} tokens exceed the context limit")
            need.append(max(0, pages - len(self.row_pages.get(row, ()))))
        if sum(need) > len(self.free_pages):
            raise PoolExhaustedError(f"KV pool: need {sum(need)} pages, {len(self.free_pages)} free")
        for row, k in zip(rows, need):
            have = self.row_pages.setdefault(row, [])
            for _ in range(k):
                page = self.free_pages.pop()
                self.page_table[row, len(have)] = page
                have.append(page)

    def release(self, row: int) -> None:
        self.free_pages.extend(reversed(self.row_pages.pop(row, [])))

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot of each token: ``[T]`` from per-token rows and positions."""
        return self.page_table[rows, positions // self.page_size] * self.page_size + positions % self.page_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]


class StatePool:
    """Recurrent state, conv window and verify scratch of ``num_layers`` GDN layers.

    ssm: ``[L, rows + 1, HV, K, V]`` fp32; conv: ``[L, rows + 1, C, W - 1]``;
    ssm_scratch: ``[L, rows + 1, D, HV, K, V]`` and conv_scratch: ``[L, rows + 1, D, C, W - 1]``,
    the state after each of the D verify steps (allocated only when D > 1).
    """

    def __init__(self, num_layers, max_rows, hv, dk, dv, conv_dim, conv_width, num_verify_tokens, dtype, device):
        n = max_rows + 1
        self.ssm = torch.zeros(num_layers, n, hv, dk, dv, dtype=torch.float32, device=device)
        self.conv = torch.zeros(num_layers, n, conv_dim, conv_width - 1, dtype=dtype, device=device)
        d = num_verify_tokens
        if d > 1:
            self.ssm_scratch = torch.zeros(num_layers, n, d, hv, dk, dv, dtype=torch.float32, device=device)
            self.conv_scratch = torch.zeros(num_layers, n, d, conv_dim, conv_width - 1, dtype=dtype, device=device)
        else:
            self.ssm_scratch = self.conv_scratch = None

    @property
    def nbytes(self) -> dict[str, int]:
        size = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        return {
            "state": size(self.ssm) + size(self.conv),
            "verify_scratch": size(self.ssm_scratch) + size(self.conv_scratch),
        }

    def layer(self, i: int) -> LinearLayerState:
        pick = lambda t: None if t is None else t[i]  # noqa: E731
        return LinearLayerState(self.conv[i], self.ssm[i], pick(self.conv_scratch), pick(self.ssm_scratch))

    def commit(self, rows: torch.Tensor, accept_lengths: torch.Tensor) -> None:
        """``state[row] = scratch[row, accept_length - 1]`` for every layer (DESIGN.md §4)."""
        if self.ssm_scratch is None:
            raise RuntimeError("commit without a verify scratch (the stage was started with D = 1)")
        commit_accept(self.ssm, self.ssm_scratch, rows, accept_lengths)
        commit_accept(self.conv, self.conv_scratch, rows, accept_lengths)
