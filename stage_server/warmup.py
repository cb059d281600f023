"""A stage's warm-up: every kind of step serving meets, run once before the stage serves.

A Triton kernel compiles on its first launch with a new specialisation (a constexpr, an
integer argument divisible by 16 or equal to 1), FlashInfer plans on its first prefill, and
the first sampled step builds the sampler's buffers: on the H200 the first request after
start took 47 s. The CUDA graphs of decode / verify / short prefills are captured when the
runner starts; this runs what they do not cover, eagerly, on scratch rows: prefill chunks
of several lengths (one and several sequences, a first chunk and a continued one, a chunk
that does not end its prompt), decode at one request and at a full micro-batch, and with
speculation a verify round (greedy, which takes the fused MTP round, and sampled) and its
commit, and with a prefix cache the snapshots of finished rows. Every row is released and
every snapshot dropped at the end: the stage is left as it started (no row in use, no KV
page or snapshot taken, no verify awaiting its commit, busy time unchanged).
"""
from __future__ import annotations

import logging
import time

import torch

from ppspec.proto.messages import DECODE, PREFILL, VERIFY, SamplingSpec, StepInput

log = logging.getLogger("ppspec.stage")

# prefill chunk lengths run (tokens): 1, odd and multiples of 16 on both sides of the short
# (one-launch) GDN prefill's reach, and the router's default chunk
PREFILL_LENGTHS = (1, 17, 64, 65, 200, 512)
# on CPU nothing compiles: a cheap run of the same sequence (it checks the warm-up itself)
CPU_PREFILL_LENGTHS, CPU_ROWS = (1, 17), 4


def warm_rows(runner) -> list[int]:
    # a full micro-batch (each row takes a few KV pages)
    return list(range(min(runner.max_rows, 64 if runner.device.type == "cuda" else CPU_ROWS)))


class _Steps:
    """Builds and runs the warm-up's micro-batches on ``runner`` (ids from a fixed seed,
    hidden states for a stage after the first)."""

    def __init__(self, runner):
        self.runner = runner
        self.gen = torch.Generator().manual_seed(0)
        self.round = 0
        self.D = runner.num_steps + 1

    def _ids(self, n: int) -> list[int]:
        return torch.randint(0, self.runner.cfg.vocab_size, (n,), generator=self.gen).tolist()

    def run(self, mode: str, rows: list[int], seq_lens: list[int], extend_lens: list[int], *,
            temperature: float = 0.0, sample: bool = True):
        r = self.runner
        self.round += 1
        T, B = sum(extend_lens), len(rows)
        num_drafts = [self.D - 1] * B if mode == VERIFY else [0] * B
        inp = StepInput(
            micro_batch_id=-1, round=self.round, mode=mode, req_pool_indices=list(rows), seq_lens=list(seq_lens),
            extend_lens=list(extend_lens), input_ids=self._ids(T), num_drafts=num_drafts, sample=[sample] * B,
            next_token_ids=[-1] * B if sample else self._ids(B),
            sampling=[SamplingSpec(temperature=temperature, seed=b) for b in range(B)], output_lens=[1] * B,
        )
        if not r.is_first:
            inp.hidden_states = (0.02 * torch.randn(T, r.cfg.hidden_size, generator=self.gen)).to(r.device, r.dtype)
        out = r.step(inp)
        if mode == VERIFY:
            accept = [len(t) for t in out.output_ids] if r.is_last else [1] * B
            r.commit_accept(-1, self.round, list(rows), accept)
            return [s + a for s, a in zip(seq_lens, accept)]
        return [s + e for s, e in zip(seq_lens, extend_lens)]


def warm_up(runner) -> float:
    """Run every kind of step on scratch rows of ``runner`` (a ``StageRunner``), then
    release them; returns the seconds it took. Raises what a step raises (a stage that
    cannot run its own warm-up cannot serve)."""
    t0 = time.perf_counter()
    busy, fault = runner.busy_seconds, runner.fault
    runner.fault = None  # injected faults are for the served rounds (tests), not this
    steps = _Steps(runner)
    rows = warm_rows(runner)
    limit = runner.max_context - steps.D - 1
    try:
        # prefill: one sequence per chunk length (first chunk, then a continued one that does
        # not end its prompt), then several sequences in one chunk
        for n in PREFILL_LENGTHS if runner.device.type == "cuda" else CPU_PREFILL_LENGTHS:
            n = min(n, limit // 2)
            if n < 1:
                continue
            lens = steps.run(PREFILL, rows[:1], [0], [n])
            steps.run(PREFILL, rows[:1], lens, [n], sample=False)
            runner.release(rows[:1])
        lens = steps.run(PREFILL, rows, [0] * len(rows), [min(3, limit)] * len(rows))
        # decode: a full micro-batch, greedy and sampled, and one request
        lens = steps.run(DECODE, rows, lens, [1] * len(rows))
        lens = steps.run(DECODE, rows, lens, [1] * len(rows), temperature=1.0)
        lens[:1] = steps.run(DECODE, rows[:1], lens[:1], [1])
        if runner.num_steps:
            # verify and its commit: greedy (the fused MTP round where the stage has one), sampled
            lens = steps.run(VERIFY, rows, lens, [steps.D] * len(rows))
            lens = steps.run(VERIFY, rows, lens, [steps.D] * len(rows), temperature=1.0)
            lens[:1] = steps.run(VERIFY, rows[:1], lens[:1], [steps.D])
        snap = runner.snapshots
        if snap is not None:
            # the prefix cache's snapshots of finished rows (after a verify: the replay design's
            # flush runs first, its tile size chosen by the number of rows): one, a few, the rest
            free = [s for s in range(snap.num_slots) if s not in snap.lens]
            for group in (rows[:1], rows[1:5], rows[5:]):
                group, slots, free = group[: len(free)], free[: len(group)], free[len(group):]
                if group:
                    runner.release(group, snapshot_slots=slots)
    finally:
        if runner.snapshots is not None:
            runner.snapshots.drop(list(runner.snapshots.lens))
        runner.release(list(range(runner.max_rows)))
        runner.fault = fault
        runner.busy_seconds = busy
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0
