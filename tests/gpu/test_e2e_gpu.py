"""End to end on CUDA, stages sharing one GPU (in one process, micro-batches interleaved):
fp32 greedy tokens identical to PP1 without speculation (divergence only at near-ties of
the reference, docs/DESIGN.md, "Correctness"); bf16 at least 99% of tokens identical. On CUDA the
stages commit with the replay design by default; the copy design is checked too.

The references run eagerly (``cuda_graph_max_bs=0``); every pipeline under test replays
CUDA graphs for decode and verify (the CUDA default), batches padded to 1, 2, 4, 8, 16."""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "models", "qwen35-demo")
N, MAX_TOKENS, TIE = 16, 48, 1e-4


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO)
    texts = ["Explain how a hash map works.", "Write a short poem about the sea.", "What is 17 times 23?",
             "Give me three tips for learning Python.", "Summarize the plot of Hamlet.", "How do vaccines work?",
             "Translate 'good morning' into French and Spanish.", "List the planets of the solar system."]
    return [tok.apply_chat_template([{"role": "user", "content": t * (1 + i % 3)}], add_generation_prompt=True)
            for i, t in enumerate(texts * 2)][:N]


def _ids(x):
    return x if isinstance(x, list) else list(x["input_ids"])


@pytest.fixture(scope="module")
def reference(prompts):
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    llm = LLM(DEMO, device="cuda", max_rows=N, cuda_graph_max_bs=0)
    assert not any(r.graphs for r in llm.pipeline.runners)
    outs = llm.generate([_ids(p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2))
    return [o.token_ids for o in outs], [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs]


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("spec", ["none", "ngram", "mtp"])
def test_fp32_identical_to_pp1(prompts, reference, pp, spec):
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    ref, gaps = reference
    llm = LLM(DEMO, device="cuda", pp_size=pp, speculative_algorithm=spec, max_rows=N)
    assert all(i["commit_design"] == "replay" for i in llm.pipeline.info_sync())  # the CUDA default
    assert all(r.graphs["decode"].graphs for r in llm.pipeline.runners)  # captured
    outs = llm.generate([_ids(p) for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    _check_near_ties(outs, ref, gaps)


def test_fp32_stages_on_their_own_gpus_identical_to_pp1(prompts, reference):
    """PP2 + MTP with a device per stage: on a machine with two GPUs each stage on its
    own (hidden states copied between them, each stage's kernels and graphs on its device);
    on one GPU the same list names it twice."""
    import torch

    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    ref, gaps = reference
    last = torch.cuda.device_count() - 1
    llm = LLM(DEMO, device=f"cuda:0,cuda:{min(1, last)}", pp_size=2, speculative_algorithm="mtp", max_rows=N)
    assert [str(r.device) for r in llm.pipeline.runners] == ["cuda:0", f"cuda:{min(1, last)}"]
    outs = llm.generate([_ids(p) for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    _check_near_ties(outs, ref, gaps)


def test_fp32_penalties_on_cuda_identical_to_pp1_on_cuda(prompts):
    """Presence / frequency / repetition penalties and logit_bias, applied to CUDA logits
    (``sampler.adjust_logits``) with graphs and MTP drafts: PP2 + MTP gives PP1's tokens
    without speculation; near-ties judged on PP1's penalised logprobs."""
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.4,
                       frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={13: -1.5})
    ps = [_ids(x) for x in prompts]
    ref = LLM(DEMO, device="cuda", max_rows=N, cuda_graph_max_bs=0).generate(
        ps, SamplingParams(**{**p.to_dict(), "logprobs": 2}))
    gaps = [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in ref]
    llm = LLM(DEMO, device="cuda", pp_size=2, speculative_algorithm="mtp", max_rows=N)
    outs = llm.generate(ps, p)
    _check_near_ties(outs, [o.token_ids for o in ref], gaps)
    plain = llm.generate(ps, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert any(a.token_ids != b.token_ids for a, b in zip(outs, plain)), "the penalties changed nothing"


@pytest.mark.parametrize("pp,spec", [(2, "mtp"), (4, "ngram")])
def test_fp32_seeded_sampling_on_cuda_identical_to_pp1_without_speculation(prompts, reference, pp, spec):
    """Seeded sampling (temperature 0.8, top-p / top-k variants) with graphs and
    speculation gives the tokens of PP1 without speculation, request for request: each
    position's token is the Gumbel-max pick under noise keyed by (seed, position)
    (``stage_server/sampler.py``). Half the requests are greedy, so batches mix the fused
    greedy round's requests with sampled ones; the greedy ones keep PP1's greedy tokens
    (divergence only at near-ties, as the other fp32 tests)."""
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    ref_greedy, gaps = reference
    ps = [_ids(x) for x in prompts]
    variants = [dict(top_p=0.95), dict(top_k=40), dict()]
    params = [SamplingParams(temperature=0.8 if i % 2 else 0.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=100 + i,
                             **variants[i % 3]) for i in range(len(ps))]
    ref = LLM(DEMO, device="cuda", max_rows=N).generate(ps, params)
    outs = LLM(DEMO, device="cuda", pp_size=pp, speculative_algorithm=spec, max_rows=N).generate(ps, params)
    sampled, greedy = range(1, len(ps), 2), range(0, len(ps), 2)
    diff = [i for i in sampled if outs[i].token_ids != ref[i].token_ids]
    assert not diff, diff
    assert all(ref[i].token_ids != ref_greedy[i] for i in sampled), "sampling gave the greedy tokens"
    _check_near_ties([outs[i] for i in greedy], [ref_greedy[i] for i in greedy], [gaps[i] for i in greedy])


def test_sampling_noise_is_the_same_on_cuda_and_cpu():
    """The noise is integer arithmetic (then one log): CUDA and the CPU agree."""
    from ppspec.stage_server.sampler import exponential_noise

    cpu = exponential_noise(2**63 + 5, [0, 7, 1000], 248320, "cpu")
    assert torch.allclose(exponential_noise(2**63 + 5, [0, 7, 1000], 248320, "cuda").cpu(), cpu, rtol=1e-14, atol=0)


def _check_near_ties(outs, ref, gaps):
    for i, (o, r) in enumerate(zip(outs, ref)):
        if o.token_ids != r:
            j = next(j for j, (a, b) in enumerate(zip(o.token_ids, r)) if a != b)
            assert gaps[i][j] < TIE, f"request {i} diverges at {j} with top-2 gap {gaps[i][j]:.2e}"


@pytest.mark.parametrize("pp,spec", [(2, "mtp"), (4, "ngram")])
def test_fp32_copy_design_identical_to_pp1(prompts, reference, pp, spec):
    """The per-step scratch + copy commit (``commit_design="copy"``) on CUDA."""
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    ref, gaps = reference
    llm = LLM(DEMO, device="cuda", pp_size=pp, speculative_algorithm=spec, max_rows=N, commit_design="copy")
    assert all(i["commit_design"] == "copy" for i in llm.pipeline.info_sync())
    outs = llm.generate([_ids(p) for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    _check_near_ties(outs, ref, gaps)


def test_replay_and_copy_states_agree_on_cuda():
    """One stage per design on CUDA (Triton paths): prefill, verify, commit; the replay
    state with its pending steps applied (on a copy) equals the copied state; the next
    decode (which applies them itself) gives the same logits and states."""
    from ppspec.kernels.gdn import replay_flush
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 1000, (n,), generator=g).tolist() for n in (40, 30))
    runs = {d: StageRunner(DEMO, max_rows=8, num_speculative_steps=3, device="cuda", commit_design=d)
            for d in ("copy", "replay")}
    for r in runs.values():
        r.forward_hidden(StepInput(0, 0, "prefill", [6, 1], [0, 0], [32, 22], a[:32] + b[:22]))
        r.forward_hidden(StepInput(0, 1, "verify", [6, 1], [32, 22], [4, 4], a[32:36] + b[22:26], num_drafts=[3, 3]))
        r.commit_accept(0, 1, [6, 1], [2, 4])
    rep, cp = runs["replay"].state, runs["copy"].state
    rows = torch.tensor([6, 1], device="cuda")
    assert rep.replay_pending[:, rows].tolist() == [[2, 4]] * rep.ssm.shape[0]
    for i, bufs in enumerate(rep.replay):
        flushed = rep.ssm[i].clone()
        replay_flush(flushed, bufs._replace(pending=bufs.pending.clone()), rows)
        assert (flushed[rows] - cp.ssm[i, rows]).abs().max() < 1e-4, i
    logits = {}
    for d, r in runs.items():
        _, h = r.forward_hidden(StepInput(0, 2, "decode", [6, 1], [34, 26], [1, 1], [a[34], b[26]]))
        logits[d] = r.model.logits(h)
    assert (logits["copy"] - logits["replay"]).abs().max() < 1e-4
    assert int(rep.replay_pending.abs().sum()) == 0
    assert (rep.ssm[:, rows] - cp.ssm[:, rows]).abs().max() < 1e-4


@pytest.fixture(scope="module")
def bf16_reference(prompts):
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    llm = LLM(DEMO, device="cuda", dtype="bfloat16", max_rows=N, cuda_graph_max_bs=0)
    outs = llm.generate([_ids(p) for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs]


def _prefix_agreement(outs, ref):
    """Tokens up to each request's first divergence (after it the contexts differ), as a fraction."""
    same = sum(next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, ref))
    return same / sum(len(r) for r in ref)


@pytest.mark.parametrize("pp,spec", [(2, "mtp"), (4, "ngram"), (2, "none")])
def test_bf16_tokens_mostly_identical_to_bf16_pp1(prompts, bf16_reference, reference, pp, spec):
    """bf16 PP x spec against bf16 PP1 without speculation: at least 99% identical. The
    agreement of bf16 with fp32 is printed (it measures bf16 rounding, not the pipeline)."""
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    llm = LLM(DEMO, device="cuda", dtype="bfloat16", pp_size=pp, speculative_algorithm=spec, max_rows=N)
    outs = llm.generate([_ids(p) for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    agree = _prefix_agreement([o.token_ids for o in outs], bf16_reference)
    print(f"bf16 PP{pp} {spec}: {agree:.3f} of bf16 PP1, {_prefix_agreement(bf16_reference, reference[0]):.3f} bf16 vs fp32")
    assert agree >= 0.99, f"bf16 agreement with bf16 PP1 {agree:.3f}"


def test_stage_asked_for_missing_cuda_device_fails_clearly():
    from ppspec.stage_server.runner import StageRunner

    with pytest.raises(Exception, match="(?i)cuda|device"):
        StageRunner(DEMO, device=f"cuda:{torch.cuda.device_count() + 3}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_structured_output_on_cuda_with_graphs_and_mtp(prompts, dtype):
    """JSON-schema requests mixed with plain ones on CUDA, graphs and MTP: a micro-batch
    holding a constrained request leaves the fused greedy round (its in-graph argmax takes
    raw logits) for the host sampler, which masks the CUDA logits with the grammar at every
    verified position. Every constrained answer parses and follows the schema; in fp32 PP2 +
    MTP gives PP1's tokens (eager, no speculation), near-ties aside. Every MTP draft chain of
    a constrained row is one the grammar accepts after the row's outputs (the chain of a
    micro-batch with a constrained request runs eagerly, masked step by step)."""
    import json

    import xgrammar as xgr

    from transformers import AutoTokenizer

    from ppspec.router.llm import LLM
    from ppspec.router.protocol import CompletionRequest
    from ppspec.router.structured import request_grammar
    from ppspec.router.types import SamplingParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    grammar = request_grammar(CompletionRequest(prompt="x", guided_json=schema))
    tok = AutoTokenizer.from_pretrained(DEMO)
    ps = [_ids(x) for x in prompts]
    params = [SamplingParams(temperature=0, max_tokens=2 * MAX_TOKENS, grammar=grammar) if i % 2 == 0
              else SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(len(ps))]
    ref = LLM(DEMO, device="cuda", dtype=dtype, max_rows=N, cuda_graph_max_bs=0).generate(
        ps, [SamplingParams(**{**p.to_dict(), "logprobs": 2}) for p in params])  # near-ties judged on these
    llm = LLM(DEMO, device="cuda", dtype=dtype, pp_size=2, speculative_algorithm="mtp", max_rows=N)
    assert llm.pipeline.runners[-1].round_graphs  # the fused greedy round exists: plain batches take it
    steps = []
    step_sync = llm.pipeline.step_sync
    llm.pipeline.step_sync = lambda inp: steps.append((inp, step_sync(inp))) or steps[-1][1]
    outs = llm.generate(ps, params)
    compiled = llm.pipeline.runners[-1].grammars.compiler.compile_grammar(grammar)
    emitted, constrained, checked = {}, {}, 0
    for inp, res in steps:
        for b, row in enumerate(inp.req_pool_indices):
            if inp.is_prefill(b) and inp.seq_lens[b] == 0:
                emitted[row], constrained[row] = [], False
            constrained[row] = constrained[row] or bool(inp.sampling[b].grammar)
            emitted[row] += res.output_ids[b]
            if not constrained[row] or not res.drafts or not res.drafts[b] or tok.eos_token_id in emitted[row]:
                continue
            m = xgr.GrammarMatcher(compiled)
            assert all(m.accept_token(t) for t in emitted[row])
            for t in res.drafts[b]:
                if m.is_terminated():
                    break
                assert m.accept_token(t), (emitted[row], res.drafts[b])
                checked += 1
    assert checked > 0
    for o in outs[::2]:
        assert o.finish_reason == "stop"
        obj = json.loads(tok.decode(o.token_ids, skip_special_tokens=True))
        assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and 0 <= obj["age"] <= 120
    if dtype == "float32":
        gaps = [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in ref]
        _check_near_ties(outs, [o.token_ids for o in ref], gaps)


@pytest.mark.parametrize("pp", [1, 2])
def test_fp32_following_verifies_identical_to_pp1(prompts, reference, pp):
    """Async scheduling of MTP verify rounds (docs/DESIGN.md, "Async scheduling") on CUDA:
    the engine that serves HTTP, over in-process stages replaying the fused greedy MTP round
    in CUDA graphs, sends each round before the last one's result and the first stage fills
    in its ids, position and commit: PP1's tokens without speculation."""
    import asyncio
    from types import SimpleNamespace

    from ppspec.router.engine import Engine
    from ppspec.router.pipeline import InProcessPipeline
    from ppspec.router.types import SamplingParams

    ref, gaps = reference
    follows = []

    async def run():
        pipe = InProcessPipeline.build(DEMO, pp, device="cuda", max_rows=N, kv_tokens=65536, num_speculative_steps=3,
                                       use_mtp=True, dtype=torch.float32)
        engine = Engine(pipe, model_name="demo", tokenizer=None)
        step = pipe.step

        async def spied(inp, *commit):
            follows.append(inp.mode == "verify" and inp.follows_round > 0)
            return await step(inp, *commit)

        pipe.step = spied
        await engine.start()

        async def one(i, p):
            out = []
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            async for o in engine.generate(f"r{i}", _ids(p), params):
                out += o.new_token_ids
            return SimpleNamespace(token_ids=out)
        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.close()

    outs = asyncio.run(run())
    _check_near_ties(outs, ref, gaps)
    assert sum(follows) > 0, "no verify round followed the one before it"
