"""What the first stage keeps of each micro-batch's last round, for async scheduling
(docs/DESIGN.md, "Async scheduling").

The router may send round ``r + 1`` of a micro-batch before round ``r``'s result came back
to it (``StepInput.follows_round``): a continuing request's input id is then the token its
row emits in round ``r``, which only the last stage knows. Every result passes through the
first stage on its way to the router (the last stage itself at PP 1, the relay chain's
answer at PP > 1), so the first stage notes each round's emitted tokens here, and a step
that follows that round waits for them instead of a router round trip.

One entry per (router, micro-batch): its latest round and each row's last emitted token,
or that the round failed (a step that follows a failed round is refused: its tokens do
not exist).
"""
from __future__ import annotations

import asyncio


class FollowError(ValueError):
    """The round a step follows failed, or the micro-batch is past it: the step is refused,
    nothing changed."""


class SampledRounds:
    """Each micro-batch's last round on the first stage: ``(round, {row: token})``, or
    ``(round, None)`` when it failed. Keyed by ``(router_id, micro_batch_id)``: a new router
    starts its rounds again from 1, and must never take an earlier router's tokens."""

    def __init__(self):
        self._last: dict[tuple[str, int], tuple[int, dict[int, int] | None]] = {}
        self._cond: asyncio.Condition | None = None  # made in the serving event loop

    @property
    def _changed(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def ended(self, key: tuple[str, int], round: int, emitted: dict[int, int] | None) -> None:
        """Round ``round`` of micro-batch ``key`` ended: ``emitted`` (row -> last token it
        emitted), or None when it failed."""
        async with self._changed:
            self._last[key] = (round, emitted)
            self._changed.notify_all()

    async def wait(self, key: tuple[str, int], round: int, timeout: float | None) -> dict[int, int]:
        """The tokens round ``round`` of micro-batch ``key`` emitted, once it ended.

        Raises:
            FollowError: that round failed, or the micro-batch already ended a later one.
            asyncio.TimeoutError: it did not end within ``timeout`` seconds.
        """
        def ended() -> bool:
            return key in self._last and self._last[key][0] >= round

        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(ended), timeout)
            last, emitted = self._last[key]
        if last != round:
            raise FollowError(f"follows_round {round} of micro-batch {key[1]}, but its last round is {last}")
        if emitted is None:
            raise FollowError(f"follows round {round} of micro-batch {key[1]}, which failed")
        return emitted
