"""A graphed step (``stage_server.graphs``, its padded static path run eagerly on the CPU)
returns what the eager step returns: the fused greedy MTP round on the last stage
(layers, acceptance, MTP chain) against the host sampler and eager MTP head, with drafts
that are all right, drafts beyond ``num_drafts`` that would be right, and no drafts."""
import pytest
import torch

from ppspec.proto.codec import info_from_pb, info_to_pb
from ppspec.proto.messages import StepInput
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.runner import StageRunner


def test_fused_greedy_round_equals_eager_step(make_ckpt):
    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio2_7l")
    prompts = [[5, 9, 2, 7, 7, 1], [3] * 9, [11, 4, 8]]
    ref = LLM(path, max_rows=4).generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    cont = [r.token_ids for r in ref]  # the greedy continuation: right drafts
    runners = {n: StageRunner(path, max_rows=4, num_speculative_steps=3, use_mtp=True, cuda_graph_max_bs=n)
               for n in (0, 4)}
    assert not runners[0].round_graphs and set(runners[4].round_graphs) == {"decode", "verify"}
    outs = {}
    for n, r in runners.items():
        rows, lens = [2, 0, 3], [len(p) for p in prompts]
        pre = r.step(StepInput(0, 0, "prefill", rows, [0] * 3, lens, sum(prompts, [])))
        assert [o[0] for o in pre.output_ids] == [c[0] for c in cont]
        ids = sum(([c[0], c[1], c[2], c[3]] for c in cont), [])
        ver = r.step(StepInput(0, 1, "verify", rows, lens, [4] * 3, ids, num_drafts=[3, 1, 0]))
        outs[n] = (ver.output_ids, ver.drafts)
    assert outs[4] == outs[0]
    assert [len(o) for o in outs[0][0]] == [4, 2, 1]  # drafts past num_drafts are never accepted
    assert all(len(d) == 3 for d in outs[0][1])


def test_prefill_graph_padding_within_a_short_context(make_ckpt):
    """A prefill bucket's padding sequence (on the padding row) must fit the KV rows a short
    ``max_context`` gives: three prompts of 32 tokens in all pad to the 64-token bucket, whose
    32-token padding sequence reads the padding row's page table past its one page at
    ``max_context=15``. Tokens equal the eager path's; short chunks still take a graph."""
    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio2_7l")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    batches = [[[5] * 11, [7, 8] * 5 + [1], [9, 3] * 5], [[3, 1, 4, 1, 5]]]
    eager = LLM(path, max_rows=4, max_context=15)
    llm = LLM(path, max_rows=4, max_context=15, cuda_graph_max_bs=8)
    ran = []
    pg = llm.pipeline.runners[0].prefill_graphs
    orig = pg.run
    pg.run = lambda rows, *a: ran.append(len(rows)) or orig(rows, *a)
    for prompts in batches:
        want = [c.token_ids for c in eager.generate(prompts, params)]
        assert [c.token_ids for c in llm.generate(prompts, params)] == want
    assert ran, "no prefill chunk took a graph"
    assert llm.rows_in_use() == [0]


@pytest.mark.parametrize("design", ["copy", "replay"])
def test_prefill_graph_bucket_edges_and_reused_rows(make_ckpt, design):
    """Prefill chunks at the buckets' edges, through the graphs' padded path with MTP: 7
    requests of 57 tokens (the 8 x 64 bucket, one padding sequence), one prompt of 63
    tokens (2 x 64), 65 tokens in two requests (the batched 8 x 136 bucket: 71 padding
    tokens over six sequences), 62 in two (4 x 64) and
    1-token prompts; 7 rows, so every later request takes a row released just before, whose
    previous request committed verify rounds (on the replay design: steps still pending). Tokens equal PP1 without speculation."""
    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio2_7l")
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    batches = [[rand(n) for n in (1, 1, 5, 9, 9, 16, 16)], [rand(63)], [rand(64), [7]], [[9], rand(61)]]
    ref = LLM(path, max_rows=8)
    llm = LLM(path, max_rows=7, speculative_algorithm="mtp", num_speculative_steps=2, commit_design=design,
              cuda_graph_max_bs=8)
    seen, verified = [], 0
    pg = llm.pipeline.runners[0].prefill_graphs
    orig = pg.run
    pg.run = lambda rows, seq, ext, *a: seen.append(pg.bucket(len(rows), sum(ext))) or orig(rows, seq, ext, *a)
    for prompts in batches:
        # requests that end while others still verify leave their row with committed steps
        params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
        want = [c.token_ids for c in ref.generate(prompts, params)]
        got = llm.generate(prompts, params)
        assert [c.token_ids for c in got] == want
        verified += sum(len(c.accept_lengths) for c in got)
    assert seen == [(8, 64), (2, 64), (8, 136), (4, 64)]
    assert verified  # rows were released after verify rounds (replay: with pending steps)
    assert llm.rows_in_use() == [0]


def test_batched_prefill_buckets_pick_and_pad(make_ckpt):
    """The batched buckets: the smallest that holds a chunk of several requests with no
    sequence, padding included, over ``BATCHED_PREFILL_SEQ_TOKENS``; none for one request
    (a long bucket's) or for a sequence over that length; the padding spread evenly."""
    from ppspec.stage_server.graphs import BATCHED_PREFILL_SEQ_TOKENS as S

    r = StageRunner(make_ckpt("qwen3_5_ratio2_7l"), max_rows=8, cuda_graph_max_bs=8)
    pg = r.prefill_graphs
    assert pg.bucket(13, 311, 40) == (16, 528)
    assert pg.bucket(64, 8192, 128) == (128, 8320)  # a full budget of prompts fits
    assert pg.bucket(16, 512, 100) == (32, 544)  # (16, 528) has no padding sequence left
    assert pg.bucket(15, 200, 30) == (16, 272)
    assert pg.bucket(63, 600, 20) == (128, 1152)  # (64, 1088): 488 padding tokens in one sequence
    assert pg.bucket(2, 300, 150) == (8, 520) and pg.bucket(2, 300, S + 1) is None
    assert pg.bucket(3, 60, 30) == (4, 64)  # a short bucket first
    assert pg.bucket(130, 4000, 40) is None  # more requests than any bucket's sequences
    with torch.inference_mode():  # as the stage fills it
        pg._fill((32, 544), list(range(15)), [0] * 15, [13] * 14 + [18], list(range(200)))
    ext = pg.views[(32, 544)]["ext"].tolist()
    assert ext[:15] == [13] * 14 + [18] and sum(ext) == 544 and max(ext[15:]) - min(ext[15:]) <= 1


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_many_prompts_prefill_in_one_batched_graph(make_ckpt, spec):
    """Several prompts of up to 256 tokens prefill in one batched bucket, alone and beside
    decodes (a mixed micro-batch: the decode graph, then the bucket), through the graphs'
    padded path (positions and KV slots derived on the device, the padding spread over
    padding sequences); a prompt over 256 tokens beside another takes none. Greedy tokens
    equal PP1 without speculation or graphs; every row is free after."""
    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio2_7l")
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    first = [rand(n) for n in (200, 150, 90, 30, 256, 5, 70)]
    later = [rand(n) for n in (120, 40, 66)]
    long = [rand(300), rand(20)]
    kw = dict(max_rows=8, max_num_batched_tokens=2048, mixed_prefill_tokens=512)
    ref = LLM(path, **kw)
    spec_kw = dict(speculative_algorithm="mtp", num_speculative_steps=2) if spec == "mtp" else {}
    llm = LLM(path, cuda_graph_max_bs=8, **spec_kw, **kw)
    seen = []
    pg = llm.pipeline.runners[0].prefill_graphs
    orig = pg.run
    pg.run = lambda rows, seq, ext, *a: seen.append(pg.bucket(len(rows), sum(ext), max(ext))) or orig(rows, seq, ext, *a)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(first))]
    want = [c.token_ids for c in ref.generate(first, params)]
    assert [c.token_ids for c in llm.generate(first, params)] == want
    assert seen[0] == (8, 1032)  # 801 tokens of 7 prompts, the longest 256
    # decodes running while three more prompts arrive: one mixed micro-batch holds their chunks
    seen.clear()
    reqs = [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for p in first[:3]]
    reqs += [(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in later]
    want = [c.token_ids for c in ref.generate([p for p, _ in reqs], [s for _, s in reqs])]
    got = _staggered(llm, reqs, after=3)
    assert got == want
    assert (8, 264) in seen  # 226 tokens of the three later prompts
    seen.clear()
    p2 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert [c.token_ids for c in llm.generate(long, p2)] == [c.token_ids for c in ref.generate(long, p2)]
    assert all(b is None or b[1] <= 64 or len(b) == 3 for b in seen)  # no batched bucket for 300 tokens
    assert llm.rows_in_use() == [0]


def _staggered(llm, reqs, after: int) -> list[list[int]]:
    """Greedy tokens of ``reqs`` through ``llm``'s engine: the first three submitted, the
    rest once those have decoded ``after`` rounds (so their prefill shares a micro-batch
    with the decodes)."""
    ids = [llm.add_request(p, s) for p, s in reqs[:3]]
    for _ in range(after):
        llm.step()
    ids += [llm.add_request(p, s) for p, s in reqs[3:]]
    while llm.has_unfinished():
        llm.step()
    return [llm.completions[i].token_ids for i in ids]


class _FakeCapture:
    """Stands in for ``torch.cuda.graph`` on the CPU: notes whether Python's cyclic garbage
    collector could run while the body (the capture) ran."""

    def __init__(self, log, fail):
        self.log, self.fail = log, fail

    def __call__(self, g, pool=None):
        return self

    def __enter__(self):
        self.log.append(("enter", __import__("gc").isenabled()))

    def __exit__(self, *exc):
        self.log.append(("exit", __import__("gc").isenabled()))
        if self.fail:
            raise RuntimeError("operation failed due to a previous error during capture")


@pytest.mark.parametrize("fail", [False, True])
def test_record_keeps_the_garbage_collector_out_of_the_capture(monkeypatch, fail):
    """A collection inside a capture can free another object's CUDA graph, an unsafe call
    that makes the capture fail (seen on the H200: test-gpu on a cold Triton cache). The
    collector is off while the body is captured, on for the warm-up, and back on after,
    also when the capture fails."""
    import gc
    import types

    from ppspec.stage_server import graphs

    log, seen = [], []
    fake = types.SimpleNamespace(
        Stream=lambda: types.SimpleNamespace(wait_stream=lambda s: None),
        current_stream=lambda: types.SimpleNamespace(wait_stream=lambda s: None),
        stream=lambda s: _FakeCapture([], False),
        CUDAGraph=lambda: types.SimpleNamespace(pool=lambda: "pool"),
        graph=_FakeCapture(log, fail),
    )
    monkeypatch.setattr(graphs.torch, "cuda", fake)
    assert gc.isenabled()

    def body():
        seen.append(gc.isenabled())
        return "out"

    if fail:
        with pytest.raises(RuntimeError, match="during capture"):
            graphs.record(body)
    else:
        _, out, pool = graphs.record(body)
        assert (out, pool) == ("out", "pool")
    assert seen == [True, False]  # warm-up with the collector, capture without
    assert log == [("enter", False), ("exit", False)]
    assert gc.isenabled()


def test_an_llm_closed_inside_another_event_loop_ends_its_tasks(make_ckpt):
    """An ``LLM`` closed (or collected) while another event loop runs on the thread, as a
    collection inside a served engine's loop does: its own loop cannot run there, so it
    closes on a thread of its own; its tasks end (closing the loop with them pending
    destroyed them mid-await: 'Exception ignored in Engine._output_loop') and every row is
    free on both stages."""
    import asyncio

    llm = LLM(make_ckpt("qwen3_5_ratio2_7l"), pp_size=2, max_rows=4, speculative_algorithm="mtp")
    llm.generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    loop, runners = llm._loop, llm.pipeline.runners

    async def elsewhere():
        llm.close()

    asyncio.run(elsewhere())
    assert loop.is_closed() and not [t for t in asyncio.all_tasks(loop) if not t.done()]
    assert [r.rows_in_use for r in runners] == [set(), set()]


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_dropped_llm_frees_its_stages_without_the_collector(make_ckpt, spec):
    """The graphs' forwards must not close over their runner: runner -> graphs -> closure ->
    runner is a cycle that only the cyclic collector frees, so a dropped ``LLM`` kept its
    stages' pools and CUDA graphs on the device until a collection, and one landing inside
    another capture broke that capture. With the collector off, dropping the last reference
    frees every stage (PP2, graphs on, the CPU's padded path)."""
    import gc
    import weakref

    path = make_ckpt("qwen3_5_ratio2_7l")
    kw = dict(pp_size=2, max_rows=4, speculative_algorithm=spec, cuda_graph_max_bs=4)
    LLM(path, **kw)  # the first build in a process imports modules lazily, whose frames form cycles
    gc.collect()
    gc.disable()
    try:
        llm = LLM(path, **kw)
        runners = [weakref.ref(r) for r in llm.pipeline.runners]
        assert all(r().graphs for r in runners)
        if spec == "mtp":
            assert all(r().round_graphs for r in runners if r().use_mtp)
        del llm
        assert [r() for r in runners] == [None, None]
    finally:
        gc.enable()



@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_mixed_micro_batch_runs_its_chunks_one_graph_each(make_ckpt, spec, monkeypatch):
    """A mixed micro-batch whose prefill chunks together fit no prefill bucket (40 + 40 +
    30 tokens > 64, the batched buckets left out: as chunks over their sequence length
    fit none) but each fit one replays the decode / verify graph and then one
    prefill graph per chunk. PP2: stage 0's hidden states equal the eager stage's (fp32,
    1e-5), stage 1's sampled tokens and MTP drafts equal the eager stage's. With more
    chunks than ``MAX_CHUNK_REPLAYS`` the micro-batch runs eagerly."""
    from ppspec.stage_server import graphs as graphs_mod, runner as runner_mod
    from ppspec.stage_server.runner import split_layers

    monkeypatch.setattr(graphs_mod, "BATCHED_PREFILL_TOKENS", ())

    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio2_7l")
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    mtp = spec == "mtp"
    layers = split_layers(7, 2)
    kw = dict(max_rows=12, num_speculative_steps=2 if mtp else 0, use_mtp=mtp)

    def pipeline(bs):
        return [StageRunner(path, k, 2, layer_range=layers[k], cuda_graph_max_bs=bs, **kw) for k in range(2)]
    eager, graphed = pipeline(0), pipeline(8)
    chunk_rows = []
    pg = graphed[0].prefill_graphs
    orig = pg.run
    pg.run = lambda rows, *a: chunk_rows.append(list(rows)) or orig(rows, *a)
    mode, D = ("verify", 3) if mtp else ("decode", 1)
    ids = rand(21) + rand(D) + rand(D) + rand(110)
    steps = [StepInput(0, 0, "prefill", [4, 7], [0, 0], [12, 9], ids[:21]),
             # rows 4 and 7 run mode; 1 and 2 start 40-token prompts, 9 a 30-token chunk
             StepInput(0, 1, mode, [4, 7, 1, 2, 9], [12, 9, 0, 0, 0], [D, D, 40, 40, 30], ids[21:],
                       num_drafts=[D - 1, D - 1, 0, 0, 0], sample=[True, True, True, True, False],
                       next_token_ids=[-1, -1, -1, -1, 5], num_prefill=3)]
    got = {}
    for name, stages in (("eager", eager), ("graphed", graphed)):
        got[name] = []
        for s in steps:
            h = stages[0].step(s).hidden_states
            s1 = StepInput(**{**vars(s), "hidden_states": h})
            out = stages[1].step(s1)
            got[name].append((h, out.output_ids, out.drafts))
    for (h0, t0, d0), (h1, t1, d1) in zip(got["eager"], got["graphed"]):
        torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
        assert (t1, d1) == (t0, d0)
    assert chunk_rows == [[4, 7], [1], [2], [9]]  # the first prefill (21 tokens in 2 rows) fits one bucket
    # how the forwards ran, as Info reports them (and the router's ppspec:stage_forwards)
    assert info_from_pb(info_to_pb(graphed[0].info()))["forwards"] == {"graph": 5}
    assert info_from_pb(info_to_pb(eager[0].info()))["forwards"] == {"eager": 2}

    chunk_rows.clear()
    runner_mod.MAX_CHUNK_REPLAYS, keep = 2, runner_mod.MAX_CHUNK_REPLAYS
    try:  # three chunks over a cap of two: eager
        s = StepInput(0, 2, mode, [4, 7, 3, 5, 6], [12 + D, 9 + D, 0, 0, 0], [D, D, 40, 40, 30], rand(2 * D + 110),
                      num_drafts=[D - 1, D - 1, 0, 0, 0], sample=[True] * 5, next_token_ids=[-1] * 5, num_prefill=3)
        if mtp:
            for st in graphed:
                st.commit_accept(0, 1, [4, 7], [1, 1])
            s.seq_lens[:2] = [13, 10]
        graphed[0].step(s)
    finally:
        runner_mod.MAX_CHUNK_REPLAYS = keep
    assert chunk_rows == [] and graphed[0].forwards == {"graph": 5, "eager": 1}
