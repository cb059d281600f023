"""The router overlaps scheduling with compute (docs/DESIGN.md, "Scheduling"): it forms
and sends micro-batch i + 1 while micro-batch i is still in the pipeline, so a stage that
finishes one finds the next queued. Checked on an injected pipeline that holds every
step's result until the test lets it go and records the order of the calls (no timing)."""
from __future__ import annotations

import asyncio

from ppspec.proto.messages import StepInput, StepOutput
from ppspec.router.engine import Engine
from ppspec.router.pipeline import Pipeline
from ppspec.router.types import SamplingParams

EOS = 0


class HeldPipeline(Pipeline):
    """One stage that answers each step only when the test releases it; every call is
    logged as ``("step", micro_batch_id, round)`` / ``("result", ...)``, in order.
    Each request emits token 7 per step."""

    def __init__(self, rows: int = 8):
        self.rows = rows
        self.log: list[tuple] = []
        self.held: list[tuple[StepInput, asyncio.Event]] = []
        self.stepped = asyncio.Event()

    async def info(self) -> list[dict]:
        return [dict(pp_rank=0, pp_size=1, layer_start=0, layer_end=1, num_layers=1, num_speculative_steps=0,
                     has_mtp=False, vocab_size=16, max_rows=self.rows, max_context=256, kv_tokens=4096,
                     kv_pages_total=0, kv_pages_used=0, eos_token_ids=[EOS], rows_in_use=0, pending_commits=0,
                     busy_seconds=0.0)]

    async def step(self, inp: StepInput) -> StepOutput:
        go = asyncio.Event()
        self.log.append(("step", inp.micro_batch_id, inp.round))
        self.held.append((inp, go))
        self.stepped.set()
        await go.wait()
        self.log.append(("result", inp.micro_batch_id, inp.round))
        return StepOutput(inp.micro_batch_id, inp.round, output_ids=[[7] for _ in inp.req_pool_indices],
                          drafts=[[] for _ in inp.req_pool_indices], stage_seconds=[0.0])

    async def commit_accept(self, c) -> list[float]:
        return [0.0]

    async def release(self, r) -> None:
        self.log.append(("release", tuple(r.req_pool_indices)))

    def health(self):
        return True, "held"

    async def close(self) -> None:
        pass

    async def wait_steps(self, n: int) -> None:
        """Until ``n`` steps have been sent, or fail (the engine never sends them)."""
        async def until():
            while len(self.held) < n:
                self.stepped.clear()
                await self.stepped.wait()
        await asyncio.wait_for(until(), 10.0)


async def _consume(engine, rid, n):
    out = []
    async for o in engine.generate(rid, [1, 2, 3], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
        out += o.new_token_ids
    return out


def test_next_micro_batch_is_sent_before_the_previous_result():
    """Default settings, one stage, two requests: the second micro-batch reaches the stage
    while the first is held (the synchronous loop, one micro-batch per stage, sends the
    next only after the result); and every later step goes out before the result ahead of
    it is released, so the stage always has one queued (the last one excepted)."""

    async def run():
        pipe = HeldPipeline()
        engine = Engine(pipe, model_name="m", tokenizer=None)
        await engine.start()
        try:
            tasks = [asyncio.ensure_future(_consume(engine, f"r{i}", 3)) for i in range(2)]
            await pipe.wait_steps(2)
            assert pipe.log == [("step", 0, 1), ("step", 1, 1)]  # both out, no result yet
            # release results one at a time: before each, the other lane's micro-batch is queued
            for k in range(6):  # 2 requests x (prefill + 2 decodes)
                if k < 5:  # the step behind it goes out while step k is still held
                    await pipe.wait_steps(k + 2)
                pipe.held[k][1].set()
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
            assert outs == [[7, 7, 7], [7, 7, 7]]
        finally:
            await engine.close()

    asyncio.run(run())

