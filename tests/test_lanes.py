"""Lanes (micro-batches in flight) by default: one per compute unit that can run at once,
stages sharing one GPU (the same ``device_uuid`` in ``Info``) counted once
(``router.engine.compute_units`` / ``default_lanes``, docs/DESIGN.md "Lanes")."""
import asyncio

import pytest
import torch

from ppspec.proto.codec import info_from_pb, info_to_pb
from ppspec.router.engine import Engine, compute_units, default_lanes
from ppspec.router.llm import LLM
from ppspec.router.pipeline import InProcessPipeline
from ppspec.router.types import SamplingParams


def test_compute_units_count_a_shared_gpu_once_and_each_cpu_stage():
    cpu = {"device_uuid": ""}
    assert compute_units([cpu, cpu, cpu]) == 3
    assert compute_units([{"device_uuid": "GPU-a"}, {"device_uuid": "GPU-a"}]) == 1
    assert compute_units([{"device_uuid": "GPU-a"}, {"device_uuid": "GPU-b"}, {"device_uuid": "GPU-a"}]) == 2
    assert compute_units([{"device_uuid": "GPU-a"}, cpu, {}]) == 3  # a stage of an older version reports none


def test_default_lanes_follow_the_units():
    assert [default_lanes(units) for units in (1, 2, 4)] == [1, 2, 4]


def test_device_uuid_crosses_the_wire():
    info = {"pp_rank": 0, "device_type": "cuda", "device_uuid": "GPU-5f1c"}
    assert info_from_pb(info_to_pb(info))["device_uuid"] == "GPU-5f1c"


@pytest.mark.parametrize("shared,lanes", [(False, 2), (True, 1)])
def test_a_pipeline_on_one_gpu_runs_one_lane(make_ckpt, shared, lanes):
    """The served engine over PP2 without speculation: two lanes where the stages compute
    apart, one where both report the same GPU (a UUID patched into their ``Info``: the CPU
    has none); the greedy tokens of PP1 either way."""
    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio2_7l")
    prompts = [[5, 9, 2, 7], [3] * 9, [11, 4, 8], [1, 2]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [c.token_ids for c in LLM(path, max_rows=8).generate(prompts, params)]
    pipe = InProcessPipeline.build(path, 2, max_rows=8, kv_tokens=4096)
    if shared:
        info = pipe.info

        async def same_gpu():
            return [dict(i, device_type="cuda", device_uuid="GPU-shared") for i in await info()]
        pipe.info = same_gpu

    async def run():
        engine = Engine(pipe, model_name="t", tokenizer=None)
        await engine.start()
        try:
            got = await asyncio.gather(*(_tokens(engine, f"r{k}", p, params) for k, p in enumerate(prompts)))
            return engine.scheduler.num_lanes, got
        finally:
            await engine.close()

    num_lanes, got = asyncio.run(run())
    assert num_lanes == lanes
    assert got == want


async def _tokens(engine, rid, prompt, params):
    ids = []
    async for out in engine.generate(rid, prompt, params):
        ids += out.new_token_ids
    return ids


def test_a_hit_rides_in_the_micro_batch_its_lane_forms_now():
    """Two lanes, lane 1's micro-batch in flight: a request that hits the prefix cache,
    arriving when lane 0 forms its next micro-batch, rides in it beside lane 0's decodes with
    its restore (lane 0 then holds one request more than lane 1), not in lane 1 a round
    later; one that hits nothing goes to the lane with the fewest requests, as before."""
    from ppspec.router.prefix_cache import PrefixCache
    from ppspec.router.scheduler import Scheduler

    s = Scheduler(max_rows=8, kv_tokens=1 << 14, max_context=1024, num_lanes=2, max_num_batched_tokens=256,
                  prefix_cache=PrefixCache(8))
    p = SamplingParams(temperature=0.0, max_tokens=50)
    system = [(7 * i + 3) % 200 for i in range(40)]
    for rid, prompt in (("a", system), ("b", [1, 2, 3]), ("c", [4, 5, 6])):
        s.add(rid, prompt, p)
    b0, b1 = s.schedule(0), s.schedule(1)
    assert [r.request_id for r in b0.requests] == ["a", "c"] and [r.request_id for r in b1.requests] == ["b"]
    assert b0.snapshot_slots[0] >= 0  # the end of a's prompt, filed with the token sampled there
    s.process(b0, [[5], [5]])  # lane 0's result is back, lane 1's is not
    s.add("d", system + [5, 8, 9, 10, 11], p)  # hits a's prompt (filed with the token 5 after it)
    s.add("e", [12, 13, 14, 15], p)  # hits nothing
    b0 = s.schedule(0)
    assert [r.request_id for r in b0.requests] == ["a", "c", "d"] and (b0.mode, b0.num_prefill) == ("decode", 1)
    assert b0.extend_lens == [1, 1, 5] and b0.seq_lens[2] == 40 and s.requests["d"].cached_tokens == 40
    assert b0.restore_slots[:2] == [-1, -1] and b0.restore_slots[2] >= 0
    assert s.requests["e"].lane == 1 and not s.requests["e"].in_flight
    s.process(b1, [[5]])
    s.process(b0, [[6], [6], [9]])
    assert [s.requests[r].output_ids for r in "abcd"] == [[5, 6], [5], [5, 6], [9]]
