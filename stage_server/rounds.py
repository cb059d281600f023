"""What the first stage keeps of each micro-batch's last round, for async scheduling
(docs/DESIGN.md, "Async scheduling").

The router may send round ``r + 1`` of a micro-batch before round ``r``'s result came back
to it (``StepInput.follows_round``): a continuing request's input ids are then what its
row emits in round ``r`` (with MTP also the drafts, the position and the commit of that
verify), which only the last stage knows. Every result passes through the first stage on
its way to the router (the last stage itself at PP 1, the relay chain's answer at PP > 1),
so the first stage notes each round's result here (``messages.note_round``), and a step
that follows that round waits for it instead of a router round trip.

One entry per (router, micro-batch): its latest rounds, each row's ``RoundNote``, or that
the round failed (a step that follows a failed round is refused: its tokens do not
exist).
"""
from __future__ import annotations

import asyncio


class FollowError(ValueError):
    """The round a step follows failed, or the micro-batch is past it: the step is refused,
    nothing changed."""


class SampledRounds:
    """The rounds of each micro-batch that ended on the first stage, the last few kept:
    ``{round: {row: RoundNote}}``, ``None`` for a round that failed. Keyed by ``(router_id,
    micro_batch_id)``: a new router starts its rounds again from 1, and must never take an
    earlier router's tokens. Two rounds of one micro-batch can be in flight and end out of
    order (round r + 1 a prefill of other rows, round r still decoding): a step follows
    the round it names, not the last one to end."""

    KEEP = 4  # rounds kept per micro-batch: at most two of one micro-batch are in flight

    def __init__(self):
        self._ended: dict[tuple[str, int], dict[int, dict | None]] = {}
        self._running: dict[tuple[str, int], set[int]] = {}  # begun, not ended
        self._waiting: dict[tuple[tuple[str, int], int], int] = {}  # (key, round) -> steps waiting for it
        self._cond: asyncio.Condition | None = None  # made in the serving event loop

    @property
    def _changed(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def begin(self, key: tuple[str, int], round: int) -> None:
        """Round ``round`` of micro-batch ``key`` arrived (before anything awaits): a step
        that follows it waits for it even when a later round ends first."""
        self._running.setdefault(key, set()).add(round)

    async def ended(self, key: tuple[str, int], round: int, emitted: dict | None) -> bool:
        """Round ``round`` of micro-batch ``key`` ended: ``emitted`` (row -> its
        ``RoundNote``), or None when it failed. Returns whether a step waits for it (woken
        here: it runs once the caller yields)."""
        async with self._changed:
            self._running.get(key, set()).discard(round)
            rounds = self._ended.setdefault(key, {})
            rounds[round] = emitted
            for r in sorted(rounds)[:-self.KEEP]:
                del rounds[r]
            self._changed.notify_all()
            return (key, round) in self._waiting

    async def wait(self, key: tuple[str, int], round: int, timeout: float | None) -> dict:
        """What round ``round`` of micro-batch ``key`` left per row, once it ended.

        Raises:
            FollowError: that round failed, or the micro-batch is past it (a later round
                ended and this one is neither ended nor running here).
            asyncio.TimeoutError: it did not end within ``timeout`` seconds.
        """
        def settled() -> bool:
            rounds = self._ended.get(key, {})
            return round in rounds or (round not in self._running.get(key, ()) and any(r > round for r in rounds))

        async with self._changed:
            if not settled():
                self._waiting[key, round] = self._waiting.get((key, round), 0) + 1
                try:
                    # no task of its own (as wait_for makes): the step that follows resumes on
                    # the loop turn after the round's end notes it (``ended``)
                    async with asyncio.timeout(timeout):
                        await self._changed.wait_for(settled)
                finally:
                    n = self._waiting.pop((key, round)) - 1
                    if n:
                        self._waiting[key, round] = n
            rounds = self._ended[key]
        if round not in rounds:
            raise FollowError(f"follows_round {round} of micro-batch {key[1]}, but its last round is {max(rounds)}")
        if rounds[round] is None:
            raise FollowError(f"follows round {round} of micro-batch {key[1]}, which failed")
        return rounds[round]
