"""The row lifecycle of a stage: which rows hold a request, how many tokens each holds,
which verify awaits its commit, which rows a failed step left undefined; the KV pages a
step takes, all or nothing; what a failed step undoes
(docs/DESIGN.md, "Failure and recovery")."""
from __future__ import annotations

from contextlib import contextmanager

from ppspec.proto.messages import PREFILL, VERIFY, StepInput

from .pools import PoolExhaustedError
from .validation import RowStateError, brief


class RowTable:
    """The rows of one stage (``req_pool_index`` in ``[0, max_rows)``) and their state.

    rows_in_use: rows holding a request. row_lens: tokens each holds (committed).
    broken_rows: rows whose state a failed step left undefined (refused until released).
    touched: the running step has started writing pools (set by the stage as it does).

    Args:
        kv, mtp_kv: the stage's KV pools (None where absent); snapshots: its prefix-cache
        snapshots or None; grammars: the last stage's grammar matchers or None;
        num_steps: drafts per round; strict_lengths: refuse ``seq_lens`` other than a
        row holds (``StageRunner``).
    """

    def __init__(self, max_rows: int, num_steps: int, strict_lengths: bool, kv, mtp_kv, snapshots, grammars):
        self.max_rows, self.num_steps, self.strict_lengths = max_rows, num_steps, strict_lengths
        self.kv, self.mtp_kv, self.snapshots, self.grammars = kv, mtp_kv, snapshots, grammars
        self.rows_in_use: set[int] = set()
        self.row_lens: dict[int, int] = {}  # tokens each row in use holds (committed)
        self._verify_open: dict[int, tuple[int, int]] = {}  # row -> (seq_len, most tokens a commit accepts)
        self.broken_rows: set[int] = set()  # state undefined after a failed step: release them
        self.touched = False  # the running step has started writing pools

    def check_state(self, inp: StepInput, parts: list[StepInput] | None = None) -> None:
        """The rows' state admits the step (in the compute order: after earlier steps and
        commits); ``parts``: ``inp.parts()`` where the caller has them. Raises RowStateError."""
        for part in parts or inp.parts():
            self._check_part_rows(part)

    def _check_part_rows(self, inp: StepInput) -> None:
        restore = inp.restore_slots or [-1] * len(inp.req_pool_indices)
        for r, s, slot in zip(inp.req_pool_indices, inp.seq_lens, restore):
            if r in self.broken_rows:
                raise RowStateError(f"row {r}: a failed step left its state undefined; release the row")
            if slot >= 0:  # a new request from a snapshot of its first s tokens
                if r in self.rows_in_use:
                    raise RowStateError(f"row {r} starts a new request but is still in use (not released)")
                if self.snapshots.lens.get(slot) != s:
                    raise RowStateError(f"row {r}: restore of snapshot slot {slot} at seq_lens {s}, but the slot "
                                        f"holds {self.snapshots.lens.get(slot, 'no')} tokens")
            elif inp.mode == PREFILL and s == 0:
                if r in self.rows_in_use:
                    raise RowStateError(f"row {r} starts a new request but is still in use (not released)")
            elif r not in self.rows_in_use:
                raise RowStateError(
                    f"row {r}: {inp.mode} at seq_lens {s}, but the row holds no request (start one with a "
                    f"prefill at seq_lens 0)"
                )
            elif self.strict_lengths and self.row_lens.get(r) != s:
                raise RowStateError(f"seq_lens: row {r} holds {self.row_lens.get(r)} tokens, the {inp.mode} says {s}")

    def reserve_pages(self, inp: StepInput) -> None:
        """KV pages for the whole step in every pool, taken all or nothing. The MTP head's
        pool gets room for its draft chain too (``num_steps - 1`` positions past the step).

        Raises PoolExhaustedError (no page taken)."""
        rows = inp.req_pool_indices
        lens = [s + e for s, e in zip(inp.seq_lens, inp.extend_lens)]
        plan = [(self.kv, lens, "KV pool")] if self.kv else []
        if self.mtp_kv:
            plan.append((self.mtp_kv, [n + max(self.num_steps - 1, 0) for n in lens], "MTP KV pool"))
        needs = [pool.pages_needed(rows, want) for pool, want, _ in plan]
        for (pool, _, name), need in zip(plan, needs):
            if sum(need) > len(pool.free_pages):
                raise PoolExhaustedError(f"{name}: need {sum(need)} pages, {len(pool.free_pages)} free")
        for (pool, want, _), need in zip(plan, needs):
            pool.ensure(rows, want, need)

    @contextmanager
    def applying(self, inp: StepInput, parts: list[StepInput] | None = None):
        """Around the part of a step that writes pools: checks the rows' state and takes
        the step's KV pages first; if the body raises, undoes what can be undone (rows the
        step started are released) and marks rows it continued as broken (a decode or
        prefill may have half-advanced their state; a verify leaves committed state as it
        was). On success, records the rows' new lengths."""
        parts = parts or inp.parts()  # the caller's, where it has them (each call copies the step's lists)
        self.check_state(inp, parts)
        if inp.snapshot_slots:
            self.snapshots.check(inp.snapshot_slots, "snapshot_slots", occupied=False)
        restored = []
        if inp.restore_slots:
            restored = self.snapshots.restore(inp.req_pool_indices, inp.restore_slots)
        try:
            self.reserve_pages(inp)
        except BaseException:
            for r in restored:
                self.forget(r)
            raise
        new = [r for p in parts if p.mode == PREFILL for r, s in zip(p.req_pool_indices, p.seq_lens) if s == 0] + restored
        self.touched = False
        try:
            yield
        except BaseException:
            for r in new:
                self.forget(r)
            if self.touched:
                self.broken_rows.update(r for p in parts if p.mode != VERIFY for r in p.req_pool_indices if r not in new)
            raise
        for p in parts:
            for b, (r, s, e) in enumerate(zip(p.req_pool_indices, p.seq_lens, p.extend_lens)):
                if p.mode == VERIFY:
                    # the last stage accepts at most the real drafts (none when not given) + 1
                    self._verify_open[r] = (s, (p.num_drafts[b] if p.num_drafts else 0) + 1)
                else:
                    self.row_lens[r] = s + e

    def forget(self, r: int) -> None:
        """Row ``r`` holds nothing any more: its KV pages, grammar, lengths go."""
        if self.snapshots is not None:
            self.snapshots.forget(r)
        self.rows_in_use.discard(r)
        self.row_lens.pop(r, None)
        self._verify_open.pop(r, None)
        self.broken_rows.discard(r)
        if self.grammars is not None:
            self.grammars.drop(r)
        if self.kv:
            self.kv.release(r)
        if self.mtp_kv:
            self.mtp_kv.release(r)

    def mark_broken(self, req_pool_indices: list[int]) -> None:
        """The rows' state is undefined (a later stage refused a step this stage applied):
        refuse steps on them until they are released."""
        self.broken_rows.update(r for r in req_pool_indices if r in self.rows_in_use)

    def check_commit(self, micro_batch_id, round, rows, accept_lengths) -> None:
        """A commit fits the rows: lengths agree, the stage speculates, rows in range and
        distinct, accept lengths in ``[1, D]`` and at most the row's verified drafts + 1.
        Raises ValueError / IndexError / RowStateError (nothing changed)."""
        what = f"commit of micro-batch {micro_batch_id} round {round}"
        if len(rows) != len(accept_lengths):
            raise ValueError(f"{what}: {len(rows)} req_pool_indices but {len(accept_lengths)} accept_lengths")
        if not rows:
            return
        if self.num_steps == 0:
            raise RowStateError(f"{what}: this stage was started without speculative decoding: nothing to commit")
        if min(rows) < 0 or max(rows) >= self.max_rows:
            bad = [r for r in rows if not 0 <= r < self.max_rows]
            raise IndexError(f"{what}: req_pool_indices {brief(bad)} outside [0, {self.max_rows})")
        if len(set(rows)) != len(rows):
            raise IndexError(f"{what}: req_pool_indices repeat rows {brief(rows)}")
        d = self.num_steps + 1
        if min(accept_lengths) < 1 or max(accept_lengths) > d:
            raise ValueError(f"{what}: accept_lengths must be in [1, {d}], got {brief(accept_lengths)}")
        for r, a in zip(rows, accept_lengths):
            most = self._verify_open.get(r, (0, d))[1]
            if a > most:
                raise ValueError(
                    f"{what}: accept_lengths: row {r} was verified with {most - 1} drafts, so at most {most} "
                    f"tokens can be accepted, got {a}"
                )

    def committed(self, rows: list[int], accept_lengths: list[int]) -> None:
        """A commit happened: each row's length grows to the tokens its verify started from
        plus the accepted ones."""
        for r, a in zip(rows, accept_lengths):
            base = self._verify_open.pop(r, None)
            if base is not None:
                self.row_lens[r] = base[0] + a
