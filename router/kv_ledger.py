"""The scheduler's KV budget, page by page: what every stage's KV pool holds, mirrored.

A stage's pool (``stage_server.pools.KVPool``) hands out whole pages and counts their
holders: a request's row, and prefix-cache snapshots (``stage_server.snapshots``), which
hold a row's pages by reference and share their whole pages with the rows restored from
them (copy on write of a partial last page). A page shared by a snapshot and 64 rows is
one page of the pool, so the budget must charge it once, not per holder, or the cache
would keep requests out that fit. The ledger keeps the same holders over virtual page
ids: the pages in use are those with a holder, whoever holds them.

A row holds what the scheduler reserved for it (``Scheduler._kv_need``: whole pages, up
to its next micro-batch's verify overhang), at least what its stage rows hold. Holders
are ``("row", req_pool_index)`` and ``("slot", snapshot slot)``.
"""
from __future__ import annotations

import itertools
import operator
from collections import Counter
from typing import Callable

Holder = tuple[str, int]


class PageLedger:
    """Virtual KV pages of ``page_size`` tokens and their holders. Token figures are whole
    pages (multiples of ``page_size``)."""

    def __init__(self, page_size: int = 1):
        self.page_size = max(1, page_size)
        self.pages: dict[Holder, list[int]] = {}
        self.refs: dict[int, int] = {}
        self._ids = itertools.count()

    @property
    def used(self) -> int:
        """Tokens of the pages that have a holder."""
        return len(self.refs) * self.page_size

    def held(self, h: Holder) -> int:
        return len(self.pages.get(h, ())) * self.page_size

    def grow(self, h: Holder, tokens: int) -> int:
        """New pages for ``h`` up to ``tokens``; returns the tokens added."""
        have = self.pages.setdefault(h, [])
        n = -(-tokens // self.page_size) - len(have)
        for _ in range(max(0, n)):
            p = next(self._ids)
            self.refs[p] = 1
            have.append(p)
        return max(0, n) * self.page_size

    def _hold(self, h: Holder, pages: list[int]) -> None:
        if self.pages.get(h):
            raise ValueError(f"{h} holds pages already")
        for p in pages:
            self.refs[p] += 1
        self.pages[h] = list(pages)

    def share(self, h: Holder, src: Holder, tokens: int) -> None:
        """``h`` (holding nothing) starts from ``src``'s first ``tokens``: their whole pages
        shared (a partial last page is ``h``'s own, taken by :meth:`grow`; a stage copies it)."""
        self._hold(h, self.pages[src][: tokens // self.page_size])

    def take(self, h: Holder, src: Holder, tokens: int) -> None:
        """``h`` (a snapshot) holds ``src``'s pages of its first ``tokens``, a partial last one
        included: no new page."""
        self._hold(h, self.pages[src][: -(-tokens // self.page_size)])

    def release(self, h: Holder) -> int:
        """``h`` lets go of its pages; returns the tokens of those no one holds now."""
        freed = 0
        for p in self.pages.pop(h, ()):
            self.refs[p] -= 1
            if not self.refs[p]:
                del self.refs[p]
                freed += 1
        return freed * self.page_size

    def freed_by(self, holders) -> int:
        """Tokens that would be free once every one of ``holders`` let go (changes nothing)."""
        return Letting(self, holders).freed

    def holders(self, kind: str) -> list[Holder]:
        return [h for h in self.pages if h[0] == kind]


class Letting:
    """Holders about to let go of their pages, as a plan (the ledger is not changed): what
    they free together, and what one more would add, each in that holder's pages alone."""

    def __init__(self, ledger: PageLedger, holders=()):
        self.ledger, self.count, self.freed = ledger, Counter(), 0
        for h in set(holders):
            self.add(h)

    def gain(self, h: Holder) -> int:
        """Tokens that ``h`` letting go too would free beyond :attr:`freed`: its pages whose
        other holders all let go (``refs - count == 1``), counted in C (an eviction asks this
        of every cached snapshot in turn, each holding a prompt's pages; a generator over the
        pages with ``Counter`` lookups cost ~150 ns a page)."""
        pages = self.ledger.pages.get(h, ())
        left = map(operator.sub, map(self.ledger.refs.__getitem__, pages), map(self.count.get, pages,
                                                                                itertools.repeat(0)))
        return list(left).count(1) * self.ledger.page_size

    def together(self, group) -> "Callable[[Holder], int]":
        """``gain(h)`` for each ``h`` of ``group``: the tokens of ``h``'s pages that the whole
        ``group`` letting go together would free beyond :attr:`freed` (two snapshots holding
        the same pages free them only together). The group's pages are counted once, so
        asking it of every member costs the group's pages, not their square."""
        refs, count, pages = self.ledger.refs, self.count, self.ledger.pages
        extra = Counter(p for o in set(group) for p in pages.get(o, ()))
        return lambda h: sum(1 for p in pages.get(h, ()) if count[p] + extra[p] == refs[p]) * self.ledger.page_size

    def add(self, h: Holder) -> None:
        refs, count = self.ledger.refs, self.count
        for p in self.ledger.pages.get(h, ()):
            count[p] += 1
            if count[p] == refs[p]:
                self.freed += self.ledger.page_size
