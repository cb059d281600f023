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


@pytest.mark.parametrize("spec,async_scheduling,extra", [("none", True, 0), ("none", False, 1), ("mtp", True, 1),
                                                         ("ngram", True, 1)])
def test_default_lanes_follow_the_units(spec, async_scheduling, extra):
    for units in (1, 2, 4):
        assert default_lanes(units, spec, async_scheduling) == units + extra


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
