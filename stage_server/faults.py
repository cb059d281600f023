"""Fault injection: the commit bugs of docs/DESIGN.md, "The failure", made on purpose, so
that the tests prove the invariance tests catch them. Never set in production (the stage's
``--inject-fault`` is hidden).

Each fault changes what a non-last stage commits; the last stage commits right, so its
output looks sane while the earlier stages' state drifts, exactly the production bug.
The prefix cache's faults (``snapshots.SNAPSHOT_FAULTS``) live with the snapshots.
"""
from __future__ import annotations

import torch

from .batch import BatchMeta
from .pools import RowStatePool
from .snapshots import FAULT_SNAPSHOT_BEFORE_COMMIT, FAULT_SNAPSHOT_WRONG_SLOT

FAULT_SKIP_COMMIT = "skip_commit"            # non-last stages never commit
FAULT_POSITIONAL_SCRATCH = "positional_scratch"  # scratch copied to rows 0..B-1, commit reads them
#   (replay design: the commit marks rows 0..B-1, the verify's batch positions, not the real rows)
FAULT_STALE_ROWS = "stale_rows"              # commit uses the rows of the latest verify on this stage
FAULTS = (FAULT_SKIP_COMMIT, FAULT_POSITIONAL_SCRATCH, FAULT_STALE_ROWS)
SNAPSHOT_FAULTS = (FAULT_SNAPSHOT_WRONG_SLOT, FAULT_SNAPSHOT_BEFORE_COMMIT)  # the prefix cache's


class CommitFaults:
    """The faulty commit of a stage started with ``fault`` (one of :data:`FAULTS`; None or a
    snapshot fault: the right commit, ``RowStatePool.commit``). ``fault`` may be changed
    later (the warm-up turns it off while it runs)."""

    def __init__(self, fault: str | None, is_last: bool, state: RowStatePool | None):
        self.fault, self.is_last, self.state = fault, is_last, state
        self._positional_rows: dict[int, int] = {}  # FAULT_POSITIONAL_SCRATCH: row -> batch position
        self._pos_scratch: dict[str, torch.Tensor] = {}  # ... the copy design's scratch at positions
        self._last_verify_rows: list[int] = []  # FAULT_STALE_ROWS

    def after_verify(self, meta: BatchMeta) -> None:
        """What a faulty stage remembers of each verify (called after every verify)."""
        if self.fault == FAULT_STALE_ROWS:
            self._last_verify_rows = meta.rows.tolist()
        elif self.fault == FAULT_POSITIONAL_SCRATCH and self.state is not None:
            self._positional_rows = {r: i for i, r in enumerate(meta.rows.tolist())}
            if self.state.commit_design == "replay":
                return  # replay design: the commit itself goes to the positions
            # Emulate a kernel that wrote the scratch at batch positions 0..B-1.
            if not self._pos_scratch:
                self._pos_scratch = {k: torch.zeros_like(t) for k, t in self.state.scratch.items()}
            B = meta.batch_size
            for name, scratch in self._pos_scratch.items():
                scratch[:, :B] = self.state.scratch[name][:, meta.rows]

    def commit(self, rows: list[int], accept_lengths: list[int]) -> None:
        """Commit ``rows`` (validated by the stage) as the fault has it."""
        st = self.state
        if self.is_last or self.fault not in FAULTS:
            st.commit(rows, accept_lengths)
        elif self.fault == FAULT_SKIP_COMMIT:
            return
        elif self.fault == FAULT_STALE_ROWS:
            rows = self._last_verify_rows[: len(rows)]
            st.commit(rows, accept_lengths[: len(rows)])
        elif st.commit_design == "replay":  # FAULT_POSITIONAL_SCRATCH
            # the commit lands on the verify's batch positions 0..B-1 instead of the rows
            pos = [self._positional_rows.get(r, i) for i, r in enumerate(rows)]
            if len(set(pos)) < len(pos):
                pos = list(range(len(rows)))
            st.commit(pos, accept_lengths)
        else:  # FAULT_POSITIONAL_SCRATCH, copy design: the scratch read at the positions
            dev = st.device
            pos, rows_t, acc = torch.tensor([[self._positional_rows.get(r, 0) for r in rows], rows, accept_lengths],
                                            dtype=torch.long, device=dev).unbind(0)
            for name, scratch in self._pos_scratch.items():
                st.state[name][:, rows_t] = scratch[:, pos, acc - 1]
