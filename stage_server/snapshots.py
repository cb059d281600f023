"""The stage's prefix-cache snapshots: a row's state after a prefix, kept in a slot.

A hybrid model's recurrent state cannot be cut back to a prefix, so the prefix cache
(``router.prefix_cache``) keeps copies: after ``length`` tokens of a row, each recurrent
layer's state (every tensor its family declares: GDN's recurrent state and conv window),
and the KV pages of those tokens (attention layers and the MTP head's pool), held by
reference (``KVPool.hold``), not copied.
Slots are addressed by stable ids the router hands out, never by batch position,
exactly like rows (docs/DESIGN.md, "Prefix caching").

- :meth:`SnapshotPool.take`: a prefill chunk's rows after the chunk (their state is
  committed: a prefill writes it in place), or a finished row before its release (the
  stage server releases a row only after its last verify's commit; the replay design's
  pending steps are applied first).
- :meth:`SnapshotPool.restore`: a new request's row gets a copy of the state and shares
  the whole KV pages; a partial last page is copied (the row writes after the prefix).
- :meth:`SnapshotPool.drop`: the pages go back to the pool when no row shares them.
"""
from __future__ import annotations

import torch

from ppspec.kernels.checks import known

from .pools import KVPool, PoolExhaustedError, RowStatePool, alloc_state, device_int64

# Fault injection, for the tests that prove the prefix-cache tests catch these bugs.
FAULT_SNAPSHOT_WRONG_SLOT = "snapshot_wrong_slot"  # restore copies another slot's state
FAULT_SNAPSHOT_BEFORE_COMMIT = "snapshot_before_commit"  # a finished row's snapshot misses its last commit


def snapshot_nbytes(state: RowStatePool | None) -> int:
    """Bytes of one slot: one row of every recurrent layer's state tensors."""
    if state is None:
        return 0
    return sum(t[:, 0].numel() * t.element_size() for t in state.state.values())


def slots_for_budget(budget_bytes: int, per_slot: int, max_slots: int = 4096) -> int:
    """Slots that ``budget_bytes`` holds (``max_slots`` on a stage without linear layers).

    Raises ValueError naming both numbers when the budget holds not even one."""
    if per_slot == 0:
        return max_slots
    n = budget_bytes // per_slot
    if n < 1:
        raise ValueError(f"--prefix-cache-gb {budget_bytes / 2**30:.4g} GiB ({budget_bytes} bytes) holds no snapshot: "
                         f"one takes {per_slot} bytes ({per_slot / 2**30:.4g} GiB) on this stage")
    return min(n, max_slots)


class SnapshotPool:
    """``num_slots`` snapshots of a stage's rows.

    ``saved[name]`` ``[L, S, *shape]`` for each state tensor of the pool (laid out as
    there: ``RowStatePool``), ``L`` recurrent layers, ``S`` slots; ``lens[slot]`` tokens and
    ``pages[slot]`` the KV pages held in each of ``kvs`` (the attention pool, the MTP
    head's pool).
    """

    def __init__(self, num_slots: int, state: RowStatePool | None, kvs: list[KVPool], fault: str | None = None):
        self.num_slots, self.state, self.kvs, self.fault = num_slots, state, kvs, fault
        self.saved: dict[str, torch.Tensor] = {}
        if state is not None:
            # uninitialised: take() writes a slot before any restore reads it, and a CPU stage
            # touches only the slots it uses (zeroing 4 GiB took seconds and all of it at start)
            self.saved = {s.name: alloc_state(s, (state.state[s.name].shape[0], num_slots), state.state[s.name].dtype,
                                              state.state[s.name].device, zero=False) for s in state.layout.state}
        self.lens: dict[int, int] = {}
        self.pages: dict[int, list[list[int]]] = {}
        self._precommit: dict[int, dict[str, torch.Tensor]] = {}  # FAULT_SNAPSHOT_BEFORE_COMMIT

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved.values())

    @property
    def used(self) -> int:
        return len(self.lens)

    def check(self, slots: list[int], what: str, occupied: bool) -> None:
        """Raise ValueError for a slot outside ``[0, num_slots)``, repeated, or (``occupied``)
        empty / (not) holding a snapshot."""
        real = [s for s in slots if s >= 0]
        bad = [s for s in real if s >= self.num_slots]
        if bad:
            raise ValueError(f"{what}: snapshot slots {bad[:8]} outside [0, {self.num_slots})")
        if len(set(real)) != len(real):
            raise ValueError(f"{what}: snapshot slots repeat: {real[:16]}")
        wrong = [s for s in real if (s in self.lens) != occupied]
        if wrong:
            raise ValueError(f"{what}: snapshot slots {wrong[:8]} {'hold no snapshot' if occupied else 'are in use'}")

    def take(self, rows: list[int], slots: list[int], lengths: list[int], pending: bool = True) -> None:
        """Snapshot ``rows`` after their first ``lengths`` tokens into empty ``slots``
        (-1: none). The rows' state must be committed. ``pending``: the rows may have a
        replay design's pending steps (a finished row's last verify), applied here first;
        False after a prefill chunk, which flushed them before it wrote the state.

        On the device: one host-to-device copy of the indices (no wait for the device), then
        per state tensor one gather and one scatter over every layer (and with ``pending``
        the family's flush). No device read."""
        pick = [(r, s, n) for r, s, n in zip(rows, slots, lengths) if s >= 0]
        if not pick:
            return
        rows, slots, lengths = map(list, zip(*pick))
        st = self.state
        if st is not None:
            if self.fault == FAULT_SNAPSHOT_BEFORE_COMMIT and any(r in self._precommit for r in rows):
                for r, s in zip(rows, slots):
                    kept = self._precommit.get(r) or {k: t[:, r] for k, t in st.state.items()}
                    for k, t in self.saved.items():
                        t[:, s] = kept[k]
            else:
                rows_t, slots_t = self._indices(rows, slots)
                if pending and st.replay is not None:
                    st.flush(rows_t)
                for k, t in self.saved.items():  # one gather, one scatter over all layers
                    t[:, slots_t] = st.state[k][:, rows_t]
        for r, s, n in zip(rows, slots, lengths):
            held = []
            for kv in self.kvs:
                pages = kv.row_pages.get(r, [])[: -(-n // kv.page_size)]
                kv.hold(pages)
                held.append(pages)
            self.lens[s], self.pages[s] = n, held

    def restore(self, rows: list[int], slots: list[int]) -> list[int]:
        """Give each row (holding nothing) the snapshot in its slot (-1: none): the state
        copied, the KV pages shared. Returns the rows restored. All or nothing: raises
        PoolExhaustedError (a partial page found no free page) with no row changed.

        On the device, whatever the rows and layers: per KV pool one page-table write and
        one copy of the partial pages (``KVPool.share``), one host-to-device copy of the
        indices, per state tensor one gather and one scatter. No device read."""
        pick = [(r, s) for r, s in zip(rows, slots) if s >= 0]
        if not pick:
            return []
        rows_r, slots_r = [r for r, _ in pick], [s for _, s in pick]
        for kv in self.kvs:  # every pool's copies checked before any pool is touched
            need = sum(1 for s in slots_r if self.lens[s] % kv.page_size)
            if need > len(kv.free_pages):
                raise PoolExhaustedError(f"KV pool: need {need} pages, {len(kv.free_pages)} free")
        for i, kv in enumerate(self.kvs):
            kv.share(rows_r, [self.pages[s][i] for s in slots_r], [self.lens[s] for s in slots_r])
        st = self.state
        if st is not None:
            if self.fault == FAULT_SNAPSHOT_WRONG_SLOT:
                others = sorted(self.lens)
                slots_r = [next((o for o in others if o != s), s) for s in slots_r]
            rows_t, slots_t = self._indices(rows_r, slots_r)
            # one gather, one scatter per tensor (advanced indexing: index_copy_ into a conv
            # window's transposed view took ~20x longer on a CPU)
            for k, t in self.saved.items():
                st.state[k][:, rows_t] = t[:, slots_t]
            if st.replay_pending is not None:
                st.drop_pending(rows_t)  # the previous request's pending steps
        return rows_r

    def drop(self, slots: list[int]) -> None:
        """Free ``slots`` (an empty one is no error) and let go of their pages."""
        for s in slots:
            if self.lens.pop(s, None) is None:
                continue
            for kv, pages in zip(self.kvs, self.pages.pop(s)):
                kv.unhold(pages)

    def before_commit(self, rows: list[int]) -> None:
        """FAULT_SNAPSHOT_BEFORE_COMMIT: remember the rows' state as the commit finds it."""
        if self.fault == FAULT_SNAPSHOT_BEFORE_COMMIT and self.state is not None:
            for r in rows:
                self._precommit[r] = {k: t[:, r].clone() for k, t in self.state.state.items()}

    def _indices(self, rows: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, slots)`` int64 on the pool's device in one copy that does not wait for
        the device, with the rows' bounds stated (``kernels.checks.known``) so that the
        flush's and reset's row checks read no value back."""
        n = len(rows)
        idx = device_int64(rows + slots, next(iter(self.state.state.values())).device)
        return known(idx[:n], min=min(rows), max=max(rows)), idx[n:]

    def forget(self, row: int) -> None:
        self._precommit.pop(row, None)
