"""A mixed micro-batch (decodes or verifies, then one request's long prefill chunk) in one
graph (``stage_server.graphs.MixedGraphs``: a ``MixedMeta`` over the head's padded bucket
followed by the chunk's long bucket), its static padded path run eagerly on the CPU with
the reference GDN: hidden states equal the eager stage's mixed forward and the head and the
chunk run as separate steps (fp32, 1e-5), sampled tokens and MTP drafts equal theirs; and
an ``LLM`` whose decoders meet a long prompt's chunks, mixed graphs on, emits PP1's greedy
tokens without speculation.

The CPU has no long prefill buckets (they need fla and a captured graph): the tests give
``PrefillGraphs`` its long buckets of 192 and 320 tokens (``_long_tokens``), and the
stages ``mixed_graph_tokens=128``, so the 192-token bucket's two graphs (3 and 4 fla chunks)
get mixed graphs."""
import pytest
import torch

from ppspec.proto.messages import StepInput
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server import graphs
from ppspec.stage_server.runner import StageRunner, split_layers


@pytest.fixture(autouse=True)
def _long_buckets(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(graphs.PrefillGraphs, "_long_tokens", staticmethod(lambda capture, max_kv_len: [192, 320]))


def _spy(monkeypatch):
    """The keys of every mixed graph run."""
    seen = []
    run = graphs.MixedGraphs.run

    def spy(self, rows, seq_lens, ids, row, seq, chunk_ids, *a):
        seen.append((self.steps.mode, self.bucket(len(rows), len(chunk_ids))))
        return run(self, rows, seq_lens, ids, row, seq, chunk_ids, *a)
    monkeypatch.setattr(graphs.MixedGraphs, "run", spy)
    return seen


def _step_all(stages, inp):
    """One micro-batch through the stages: stage 0's hidden states (None at PP1), the output."""
    h0, h = None, None
    for k, st in enumerate(stages):
        out = st.step(StepInput(**{**vars(inp), "hidden_states": h}))
        h = out.hidden_states
        if k == 0:
            h0 = h
    return h0, out


def _step_parts(stages, inp):
    """The micro-batch's head and chunk as two steps: stage 0's hidden states joined, the
    outputs joined in request order."""
    res = [_step_all(stages, p) for p in inp.parts()]
    h0 = None if res[0][0] is None else torch.cat([h for h, _ in res])
    outs = [o for _, o in res]
    ids = [t for o in outs for t in o.output_ids]
    drafts = [d for o in outs for d in (o.drafts or [[]] * len(o.output_ids))] if any(o.drafts for o in outs) else []
    return h0, ids, drafts


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_mixed_graph_equals_eager_and_separate_steps(make_ckpt, monkeypatch, spec, pp):
    """Decodes (or MTP verifies) of 3 requests (bucket 4) beside a new prompt's 150-token
    chunk (bucket (2, 192, 4)), then of 5 requests (bucket 8) beside its continuing
    128-token chunk (bucket (2, 192, 3)), its last: one mixed graph replay each, none eager.
    Stage 0's hidden states equal the eager stage's and the two parts run as their own
    steps; the last stage's tokens and drafts equal both."""
    path = make_ckpt("qwen3_5_ratio2_7l")
    mtp = spec == "mtp"
    mode, D = ("verify", 3) if mtp else ("decode", 1)
    layers = split_layers(7, pp)
    kw = dict(max_rows=12, num_speculative_steps=D - 1, use_mtp=mtp)

    def stages(bs):
        return [StageRunner(path, k, pp, layer_range=layers[k], cuda_graph_max_bs=bs, mixed_graph_tokens=128, **kw)
                for k in range(pp)]
    graphed, eager, apart = stages(8), stages(0), stages(0)
    assert sorted(graphed[0].mixed_graphs) == sorted({"decode", mode})
    assert {k[1] for k in graphed[0].mixed_graphs[mode].keys} == {(2, 192, 3), (2, 192, 4)}
    seen = _spy(monkeypatch)
    g = torch.Generator().manual_seed(6)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    heads, lens = [4, 7, 2, 1, 3], [12, 9, 9, 5, 14]
    prompt = rand(278)
    first = StepInput(0, 0, "prefill", heads, [0] * 5, lens, rand(sum(lens)))
    for st in (graphed, eager, apart):
        _step_all(st, first)
    for rnd, (B, seq, T) in enumerate([(3, 0, 150), (5, 150, 128)], start=1):
        last = seq + T == len(prompt)
        inp = StepInput(0, rnd, mode, heads[:B] + [9], lens[:B] + [seq], [D] * B + [T],
                        rand(B * D) + prompt[seq:seq + T], num_drafts=[D - 1] * B + [0], sample=[True] * B + [last],
                        next_token_ids=[-1] * B + [-1 if last else prompt[seq + T]], num_prefill=1)
        h_g, out_g = _step_all(graphed, inp)
        h_e, out_e = _step_all(eager, inp)
        h_a, ids_a, drafts_a = _step_parts(apart, inp)
        if pp == 2:
            assert h_g.shape == (B * D + T, graphed[0].cfg.hidden_size)
            torch.testing.assert_close(h_g, h_e, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(h_g, h_a, atol=1e-5, rtol=1e-5)
        assert out_g.output_ids == out_e.output_ids == ids_a
        assert out_g.drafts == out_e.drafts == drafts_a
        assert len(out_g.output_ids) == B + 1 and bool(out_g.output_ids[-1]) == last
        if mtp:
            assert [len(d) for d in out_g.drafts] == [D - 1] * B + [D - 1 if last else 0]  # a chunk that samples drafts
            acc = [len(t) for t in out_e.output_ids[:B]]
            for st in (graphed, eager, apart):
                for r in st:
                    r.commit_accept(0, rnd, heads[:B], acc)
            lens[:B] = [n + a for n, a in zip(lens, acc)]
        else:
            lens[:B] = [n + 1 for n in lens[:B]]
    assert seen == [(mode, key) for key in ((4, (2, 192, 4)), (8, (2, 192, 3))) for _ in range(pp)]  # each stage
    for st in graphed:
        assert st.forwards == {"graph": 3}  # the first prefill (a short bucket), then one replay per round


@pytest.mark.parametrize("pp,spec", [(1, "none"), (2, "mtp")])
def test_llm_decoders_beside_a_long_prompt_match_pp1(make_ckpt, monkeypatch, pp, spec):
    """Four short prompts (33 tokens) start decoding while a 579-token prompt is still
    prefilled beside them: after its first 223 tokens (the rest of the 256-token budget) in
    chunks of 128, 128 and 100 (``mixed_prefill_tokens=128``; the 192-token bucket's two
    graphs, 3 and 4 fla chunks, have mixed graphs). Those micro-batches replay mixed graphs,
    and every request's greedy tokens equal PP1's without speculation (eager)."""
    path = make_ckpt("qwen3_5_ratio2_7l")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 12, 5, 9, 579)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [c.token_ids for c in LLM(path, max_rows=8).generate(prompts, params)]
    llm = LLM(path, pp_size=pp, speculative_algorithm=spec, num_speculative_steps=2, max_rows=8, cuda_graph_max_bs=8,
              max_num_batched_tokens=256, mixed_prefill_tokens=128)
    seen = _spy(monkeypatch)
    assert [c.token_ids for c in llm.generate(prompts, params)] == want
    chunks = [k[1] for _, k in seen[::pp]]  # each round's, once (every stage runs it)
    assert chunks == [(2, 192, 3), (2, 192, 3), (2, 192, 4)] and len(seen) == 3 * pp, seen
    assert set(llm.rows_in_use()) == {0}  # every stage


def test_a_prompts_last_chunk_pads_into_the_mixed_graph(make_ckpt, monkeypatch):
    """With chunks of 256 beside the decodes (the 320-token bucket's graphs), a prompt's last
    chunk of 170 tokens, whose own bucket (192) has no mixed graph, pads into the 320-token
    one (170 of its 320 tokens are the chunk's, 150 padding: fla chunk variant 3 + 3 = 6);
    one of 100 keeps the two replays. Greedy tokens equal PP1's without speculation."""
    path = make_ckpt("qwen3_5_ratio2_7l")
    g = torch.Generator().manual_seed(9)
    # 33 tokens of short prompts and 479 of the long one fill the first 512-token round
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 12, 5, 9, 479 + 256 + 170)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [c.token_ids for c in LLM(path, max_rows=8).generate(prompts, params)]
    llm = LLM(path, max_rows=8, cuda_graph_max_bs=8, max_num_batched_tokens=512, mixed_prefill_tokens=256)
    seen = _spy(monkeypatch)
    assert [c.token_ids for c in llm.generate(prompts, params)] == want
    assert [k[1] for _, k in seen] == [(2, 320, 5), (2, 320, 6)], seen
    mg = llm.pipeline.runners[0].mixed_graphs["decode"]
    assert mg.bucket(4, 100) is None and mg.bucket(4, 160) == (4, (2, 320, 6)) and mg.bucket(4, 320) is None


@pytest.mark.parametrize("seq,T", [(0, 150), (40, 100), (7, 250)])
def test_a_lone_chunk_in_a_long_bucket_equals_eager(make_ckpt, seq, T):
    """One request's prefill chunk alone (no decodes) in a long bucket, whose positions and
    KV slots the bucket derives on the device from its row, cached length and
    ``cu_seqlens``: stage 0's hidden states and the sampled token equal the eager stage's
    (PP2, fp32), with a prefix already cached (``seq`` > 0) and without."""
    path = make_ckpt("qwen3_5_ratio2_7l")
    layers = split_layers(7, 2)

    def stages(bs):
        return [StageRunner(path, k, 2, layer_range=layers[k], cuda_graph_max_bs=bs, max_rows=12) for k in range(2)]
    graphed, eager = stages(8), stages(0)
    g = torch.Generator().manual_seed(seq + T)
    prompt = torch.randint(0, 256, (seq + T,), generator=g).tolist()
    if seq:
        first = StepInput(0, 0, "prefill", [5], [0], [seq], prompt[:seq], sample=[False], next_token_ids=[prompt[seq]])
        for st in (graphed, eager):
            _step_all(st, first)
    inp = StepInput(0, 1, "prefill", [5], [seq], [T], prompt[seq:], sample=[True], next_token_ids=[-1])
    h_g, out_g = _step_all(graphed, inp)
    h_e, out_e = _step_all(eager, inp)
    assert graphed[0].prefill_graphs.bucket(1, T)[:2] == ((2, 192) if T < 192 else (2, 320))
    torch.testing.assert_close(h_g, h_e, atol=1e-5, rtol=1e-5)
    assert out_g.output_ids == out_e.output_ids


def test_a_chunk_near_a_short_context_takes_the_long_bucket_past_it(make_ckpt):
    """A context shorter than the longest bucket (the 1.46B benchmark checkpoint's 8192
    tokens against the 8256-token bucket): the padding row's page table covers the bucket,
    so a 250-token chunk of a 260-token context replays the 320-token bucket (it ran
    eagerly when the bucket was left out) and equals the eager stage (PP2, fp32)."""
    path = make_ckpt("qwen3_5_ratio2_7l")
    layers = split_layers(7, 2)

    def stages(bs):
        return [StageRunner(path, k, 2, layer_range=layers[k], cuda_graph_max_bs=bs, max_rows=12, max_context=260)
                for k in range(2)]
    graphed, eager = stages(8), stages(0)
    prompt = torch.randint(0, 256, (250,), generator=torch.Generator().manual_seed(3)).tolist()
    inp = StepInput(0, 0, "prefill", [5], [0], [250], prompt, sample=[True], next_token_ids=[-1])
    assert graphed[0].prefill_graphs.bucket(1, 250)[:2] == (2, 320)
    assert graphed[0].kv.max_pages_per_row * graphed[0].kv.page_size >= 319
    small = StageRunner(path, 0, 2, layer_range=layers[0], cuda_graph_max_bs=8, max_rows=12, max_context=100)
    assert small.prefill_kv_len == 191  # to the bucket of a whole context's chunk, not the 320 never used
    h_g, out_g = _step_all(graphed, inp)
    h_e, out_e = _step_all(eager, inp)
    torch.testing.assert_close(h_g, h_e, atol=1e-5, rtol=1e-5)
    assert out_g.output_ids == out_e.output_ids
