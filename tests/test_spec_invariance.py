"""Greedy tokens are identical with and without speculation, in one process, with
requests joining and leaving at different steps, PP slices and micro-batches in flight.

Besides n-gram and MTP drafts (which rarely hit on a random checkpoint), an *oracle*
drafter proposes the reference continuation with seeded corruption, so that every
accept length from 1 to D occurs and the cases other engines got wrong are forced: a
batch where some requests have drafts and others none, a request with no draft right
after a round that accepted drafts, and rounds where nothing is accepted.

Every check runs under both commit designs of the GDN state (``StageRunner(commit_design=)``):
``copy`` (per-step state scratch, the commit copies one back) and ``replay`` (the verify
keeps only its step inputs, the commit records the accept length, the next verify or
decode of the row replays it; docs/DESIGN.md, "Commit rule").
"""
import random

import pytest
import torch

from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.runner import FAULTS

CKPT = "qwen3_5_ratio2_7l"
N_REQ = 16
DESIGNS = ["copy", "replay"]


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def workload(seed=0):
    rnd = random.Random(seed)
    reqs = []
    for i in range(N_REQ):
        n = rnd.choice([3, 9, 17, 40, 70, 100])
        prompt = [rnd.randrange(256) for _ in range(n)]
        if i % 4 == 0:  # repetitive prompts give the n-gram drafter something to find
            prompt = (prompt[:6] * 20)[:n]
        reqs.append(dict(prompt=prompt, max_tokens=rnd.randint(12, 40), join_step=rnd.randint(0, 12)))
    return reqs


def drive(llm, reqs, logprobs=None):
    """Add requests at their join step, step until all finish; returns token lists."""
    ids, step = {}, 0
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i]["join_step"])
    while pending or llm.has_unfinished():
        while pending and reqs[pending[0]]["join_step"] <= step:
            i = pending.pop(0)
            p = SamplingParams(temperature=0.0, max_tokens=reqs[i]["max_tokens"], ignore_eos=True, logprobs=logprobs)
            ids[i] = llm.add_request(reqs[i]["prompt"], p, request_id=f"r{i}")
        llm.step()
        step += 1
    return [llm.completions[ids[i]].token_ids for i in range(len(reqs))]


class Oracle:
    """Drafts from the reference continuation: per (request, position) a seeded choice of
    no draft, all correct, first draft wrong, or a wrong token at a random position."""

    def __init__(self, reference, seed=0):
        self.ref, self.seed = reference, seed
        self.log = []  # (request_id, output_len, kind)

    def __call__(self, req, k):
        i = int(req.request_id[1:])
        L = len(req.output_ids)
        truth = self.ref[i][L : L + k]
        kind = random.Random(hash((self.seed, i, L))).choice(["none", "all", "first_wrong", "mid_wrong", "all"])
        self.log.append((req.request_id, L, kind))
        if kind == "none" or not truth:
            return []
        drafts = list(truth)
        if kind == "first_wrong":
            drafts[0] = (drafts[0] + 1) % 256
        elif kind == "mid_wrong":
            j = random.Random(hash((self.seed, i, L, 1))).randrange(len(drafts))
            drafts[j] = (drafts[j] + 7) % 256
        return drafts


def check_design(llm, design):
    """Every stage runs ``design``: replay stages hold no per-step state scratch but
    replay buffers, and they did commit through them (some row had pending steps)."""
    for r in llm.pipeline.runners:
        assert r.info()["commit_design"] == design
        if r.state is None:
            continue
        if design == "replay":
            assert r.state.ssm_scratch is None and r.state.replay is not None
        else:
            assert r.state.replay is None and r.state.ssm_scratch is not None


def spy_replay_commits(llm):
    """Count replay commits that recorded accepted steps (pending > 0) on every stage."""
    seen = [0]
    for r in llm.pipeline.runners:
        if r.state is None or r.state.replay is None:
            continue
        orig = r.state.commit

        def commit(rows, acc, _orig=orig, _st=r.state):
            _orig(rows, acc)
            seen[0] += int((_st.replay_pending[:, rows] > 0).sum())

        r.state.commit = commit
    return seen


def record_rounds(llm):
    rounds = []
    orig = llm.scheduler.process

    def process(batch, *a, **kw):
        up = orig(batch, *a, **kw)
        if batch.mode in ("verify", "decode") and batch.round:
            rounds.append((batch.mode, [r.request_id for r in batch.requests], list(batch.num_drafts), list(up.accept_lengths)))
        return up

    llm.scheduler.process = process
    return rounds


@pytest.fixture(scope="module")
def setup(make_ckpt):
    path = make_ckpt(CKPT)
    reqs = workload()
    ref = drive(LLM(path, max_rows=N_REQ), reqs)
    return path, reqs, ref


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("spec,steps,pp", [("ngram", 3, 1), ("mtp", 3, 1), ("mtp", 1, 1), ("ngram", 4, 1),
                                           ("ngram", 3, 2), ("mtp", 3, 2)])
def test_ngram_and_mtp_match_no_speculation(setup, spec, steps, pp, design):
    path, reqs, ref = setup
    llm = LLM(path, pp_size=pp, max_rows=N_REQ, speculative_algorithm=spec, num_speculative_steps=steps,
              commit_design=design)
    check_design(llm, design)
    rounds = record_rounds(llm)
    committed = spy_replay_commits(llm)
    assert drive(llm, reqs) == ref
    assert any(m == "verify" for m, *_ in rounds), "speculation never verified anything"
    assert all(u == 0 for u in llm.rows_in_use())
    if design == "replay":
        assert committed[0] > 0, "no replay commit recorded accepted steps"


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("steps,pp,lanes", [(1, 1, 1), (3, 1, 1), (4, 1, 1), (3, 2, 2), (4, 3, 3)])
def test_oracle_drafts_every_accept_length_match(setup, steps, pp, lanes, design):
    path, reqs, ref = setup
    oracle = Oracle(ref, seed=steps)
    llm = LLM(path, pp_size=pp, num_micro_batches=lanes, max_rows=N_REQ, speculative_algorithm="ngram",
              num_speculative_steps=steps, drafter=oracle, commit_design=design)
    check_design(llm, design)
    rounds = record_rounds(llm)
    assert drive(llm, reqs) == ref
    verify = [r for r in rounds if r[0] == "verify"]
    accepts = [a for _, _, _, acc in verify for a in acc]
    # every accept length 1..D occurred, and the cases other engines got wrong happened
    assert set(accepts) == set(range(1, steps + 2))
    assert any(0 in nd and any(nd) for _, _, nd, _ in verify), "no batch mixed drafts and no drafts"
    assert any(a == 1 and d > 0 for _, _, nd, acc in verify for d, a in zip(nd, acc)), "no round accepted nothing"
    after = {}
    for _, rids, nd, acc in verify:
        for rid, d, a in zip(rids, nd, acc):
            after.setdefault(rid, []).append((d, a))
    assert any(
        prev[1] > 1 and cur[0] == 0 for seq in after.values() for prev, cur in zip(seq, seq[1:])
    ), "no request went draft-less right after accepting drafts"
    assert all(u == 0 for u in llm.rows_in_use())


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("fault", FAULTS)
def test_invariance_catches_the_commit_bugs(setup, fault, design):
    """The same check fails when a non-last stage skips its commit, commits from positional
    scratch rows (replay: commits the batch positions' rows), or pairs a commit with another
    micro-batch's rows (docs/DESIGN.md, "The failure"), under either commit design."""
    path, reqs, ref = setup
    llm = LLM(path, pp_size=2, num_micro_batches=2, max_rows=N_REQ, speculative_algorithm="ngram",
              num_speculative_steps=3, drafter=Oracle(ref, seed=3), fault=fault, commit_design=design)
    check_design(llm, design)
    out = drive(llm, reqs)
    wrong = sum(o != r for o, r in zip(out, ref))
    assert wrong > 0, f"fault {fault} went unnoticed"


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("spec,pp", [("mtp", 1), ("mtp", 2), ("none", 2)])
def test_chunked_prefill_through_graphs_matches(setup, spec, pp, design):
    """Chunked prefill (20-token chunks) through the prefill graphs' padded static path (run
    eagerly on CPU): chunks that start a row and chunks that continue one (whose pending
    replay steps are applied before the graph, on the replay design), several requests per
    chunk; tokens equal PP1 without speculation."""
    path, reqs, ref = setup
    llm = LLM(path, pp_size=pp, max_rows=N_REQ, commit_design=design, cuda_graph_max_bs=8, chunk_size=20,
              speculative_algorithm=spec, num_speculative_steps=3)
    seen = []
    for r in llm.pipeline.runners:
        orig = r.prefill_graphs.run
        r.prefill_graphs.run = lambda rows, seq, *a, _o=orig: seen.append((len(rows), min(seq))) or _o(rows, seq, *a)
    assert drive(llm, reqs) == ref
    assert any(s > 0 for _, s in seen), "no continuing chunk took a prefill graph"
    assert any(s == 0 for _, s in seen) and any(n > 1 for n, _ in seen)
    assert all(u == 0 for u in llm.rows_in_use())


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("spec,pp,lanes", [("none", 1, 1), ("oracle", 1, 1), ("mtp", 2, 2), ("oracle", 3, 2)])
def test_padded_graph_path_matches(setup, spec, pp, lanes, design):
    """Decode and verify through the CUDA graphs' padded static path (run eagerly on CPU,
    ``cuda_graph_max_bs``): batches padded to 1, 2, 4 or 8 rows with the padding row and
    the KV padding page, larger batches eager; MTP drafts from the graphed chain (the head
    over all D positions); tokens equal PP1 without speculation. Padding that wrote into a
    real row's state or a real KV page (page 0 is the first request's) would change them."""
    from ppspec.stage_server.graphs import StepGraphs

    path, reqs, ref = setup
    kw = dict(speculative_algorithm="ngram", num_speculative_steps=3, drafter=Oracle(ref, seed=5)) if spec == "oracle" \
        else dict(speculative_algorithm=spec, num_speculative_steps=3)
    llm = LLM(path, pp_size=pp, num_micro_batches=lanes, max_rows=N_REQ, commit_design=design, cuda_graph_max_bs=8, **kw)
    runs = []
    for r in llm.pipeline.runners:
        assert r.graphs and all(g.sizes == [1, 2, 4, 8] for g in r.graphs.values())
        assert bool(r.mtp_graphs) == bool(r.round_graphs) == (spec == "mtp" and r.is_last)
        for kind, graphs in (("layers", r.graphs), ("mtp", r.mtp_graphs), ("round", r.round_graphs)):
            for g in graphs.values():
                orig = g.run

                def run(rows, *a, _orig=orig, _key=(kind, g.mode)):
                    runs.append((*_key, len(rows)))
                    return _orig(rows, *a)

                g.run = run
        orig = r.prefill_graphs.run
        r.prefill_graphs.run = lambda rows, *a, _o=orig: runs.append(("prefill", "prefill", len(rows))) or _o(rows, *a)
        assert (r.commit_graphs is not None) == (spec != "none")
        if r.commit_graphs is not None:  # every stage's commit, from the padded static buffer
            orig = r.commit_graphs.run
            r.commit_graphs.run = lambda rows, acc, _o=orig: runs.append(("commit", "verify", len(rows))) or _o(rows, acc)
    assert drive(llm, reqs) == ref
    assert ("prefill", "prefill") in {k[:2] for k in runs}, "no prefill took a graph"
    sizes = {n for *_, n in runs}
    assert sizes - {1, 2, 4, 8}, "no batch was padded"
    if spec != "none":
        assert ("layers", "verify") in {k[:2] for k in runs}
        assert {n for k, _, n in runs if k == "commit"} - {1, 2, 4, 8}, "no commit was padded"
    if spec == "mtp":
        # greedy rounds: layers, acceptance and MTP chain in one graph on the last stage
        assert ("round", "verify") in {k[:2] for k in runs}, "no round took the fused greedy graph"
        # a prefill's last position and its draft chain: the decode chain's graph
        assert ("mtp", "decode") in {k[:2] for k in runs}, "no prefill drafted from the chain's graph"
        # same drafts as the eager head: every round accepts as many tokens
        eager = LLM(path, pp_size=pp, num_micro_batches=lanes, max_rows=N_REQ, commit_design=design, **kw)
        assert not eager.pipeline.runners[-1].mtp_graphs
        drive(eager, reqs)
        accepts = lambda e: [e.completions[f"r{i}"].accept_lengths for i in range(N_REQ)]  # noqa: E731
        assert accepts(llm) == accepts(eager)
        assert max(a for acc in accepts(llm) for a in acc) > 1
        # requests that want logprobs take the host sampler, then the graphed MTP chain
        runs.clear()
        again = LLM(path, pp_size=pp, num_micro_batches=lanes, max_rows=N_REQ, commit_design=design,
                    cuda_graph_max_bs=8, **kw)
        for g in again.pipeline.runners[-1].mtp_graphs.values():
            orig = g.run
            g.run = lambda rows, *a, _o=orig: runs.append(len(rows)) or _o(rows, *a)
        assert drive(again, reqs, logprobs=1) == ref
        assert runs and accepts(again) == accepts(eager)
    assert all(u == 0 for u in llm.rows_in_use())


def record_batches(llm):
    """(mode, num_prefill, tokens) of every micro-batch the scheduler forms."""
    seen = []
    orig = llm.scheduler.schedule

    def schedule(lane):
        b = orig(lane)
        if b is not None:
            seen.append((b.mode, b.num_prefill, sum(b.extend_lens)))
        return b

    llm.scheduler.schedule = schedule
    return seen


@pytest.mark.parametrize("budget,spec,pp,lanes,design", [
    (64, "mtp", 1, 1, "copy"), (64, "oracle", 2, 2, "replay"), (64, "none", 4, 4, "copy"),
    (200, "mtp", 3, 2, "replay"), (1000, "ngram", 2, 1, "copy"), (8192, "mtp", 4, 2, "copy"),
])
def test_token_budget_and_mixed_batches_match(setup, budget, spec, pp, lanes, design):
    """Greedy tokens under a token budget per forward from 64 to 8192, decodes and verifies
    sharing their forward with prefill chunks, equal PP1 without speculation."""
    path, reqs, ref = setup
    kw = dict(speculative_algorithm="ngram", drafter=Oracle(ref, seed=7)) if spec == "oracle" \
        else dict(speculative_algorithm=spec)
    llm = LLM(path, pp_size=pp, num_micro_batches=lanes, max_rows=N_REQ, max_batch_size=N_REQ,
              max_num_batched_tokens=budget, commit_design=design, num_speculative_steps=3, **kw)
    batches = record_batches(llm)
    assert drive(llm, reqs) == ref
    assert max(t for *_, t in batches) <= budget
    mixed = {m for m, n, _ in batches if n}  # modes of the micro-batches that carried prefill chunks
    assert {"none": "decode", "oracle": "verify", "mtp": "verify"}.get(spec, "decode") in mixed
    if budget == 64:  # prompts of up to 100 tokens ran in several chunks
        assert max(t for *_, t in batches) == 64
    assert all(u == 0 for u in llm.rows_in_use())
