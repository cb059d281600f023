"""The Mamba2 hybrids, Kimi Linear and Qwen3-Next's MoE stages through the CUDA graphs'
padded decode / verify path (``stage_server.graphs.StepGraphs``, run eagerly on the CPU:
``capture=False``) with ``PPSPEC_FAMILY_GRAPHS=1``: the hidden states of every decode and
verify step and the committed state after a commit equal the unpadded eager forward's,
three requests at rows that are not batch positions padded to the bucket of four (NemotronH's,
Kimi Linear's, Granite's and Qwen3-Next's MoE layers among them: their experts run without
a host read on CUDA); every Mamba2 / KDA stage with the switch off
(``PPSPEC_FAMILY_GRAPHS=0``) stays eager."""
import pytest
import torch

from ppspec.proto.messages import StepInput
from ppspec.stage_server.runner import StageRunner

KINDS = ["nemotron_h_c", "nemotron_h_a", "nemotron_h_b", "falcon_h1_a", "granite_b", "granite_a", "bamba_a",
         "kimi_dense_4l", "kimi_moe_5l", "qwen3_next_moe"]
# the families whose expert runs are the layers.moe ones (CUDA: grouped GEMM or dense)
MOE_KINDS = ["nemotron_h_a", "nemotron_h_b", "kimi_moe_5l", "granite_a", "qwen3_next_moe"]


def _steps(r: StageRunner, prompts: list[list[int]], rows: list[int]) -> list[torch.Tensor]:
    """Prefill, decode, a verify of D = 4, its commit (accept lengths 4, 1, 2), a decode:
    each step's hidden states ``[T, hidden]``, then every state tensor of the pool at ``rows``
    (the replay design's pending steps applied)."""
    B = len(rows)
    seq = [len(p) for p in prompts]
    out = []

    def run(rnd, mode, ext, ids, **kw):
        out.append(r.forward_hidden(StepInput(0, rnd, mode, rows, list(seq), [ext] * B, ids, **kw))[1].clone())

    out.append(r.forward_hidden(StepInput(0, 0, "prefill", rows, [0] * B, seq, sum(prompts, [])))[1].clone())
    run(1, "decode", 1, [7, 3, 11])
    seq = [s + 1 for s in seq]
    run(2, "verify", 4, [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4], num_drafts=[3, 3, 3])
    acc = [4, 1, 2]
    r.commit_accept(0, 2, rows, acc)
    seq = [s + a for s, a in zip(seq, acc)]
    run(3, "decode", 1, [13, 14, 15])
    idx = torch.tensor(rows, device=r.device)
    if r.state.replay is not None:  # the pending steps applied, as before a snapshot
        for i in range(len(r.model.state_layers)):
            r.model.layer_family.flush(r.state.layer(i), idx)
    out += [t[:, idx].clone() for t in r.state.state.values()]
    return out


@pytest.mark.parametrize("design", ["replay", "copy"])
@pytest.mark.parametrize("kind", KINDS)
def test_padded_graph_path_equals_eager(make_ckpt, monkeypatch, kind, design):
    torch.set_num_threads(1)
    monkeypatch.setenv("PPSPEC_FAMILY_GRAPHS", "1")
    path = make_ckpt(kind)
    runners = {n: StageRunner(path, max_rows=6, num_speculative_steps=3, cuda_graph_max_bs=n, commit_design=design)
               for n in (0, 4)}
    g = runners[4]
    assert not runners[0].graphs and set(g.graphs) == {"decode", "verify"}
    # the Mamba2 and KDA prefill reads sequence bounds on the host: eager; GDN's is graphed
    assert (g.prefill_graphs is None) == (not getattr(g.model, "prefill_capturable", True))
    assert g.graphs["decode"].bucket(3) == 4  # three requests and one padding entry
    runs = []
    for mode in ("decode", "verify"):
        orig = g.graphs[mode].run
        g.graphs[mode].run = lambda rows, *a, _o=orig, _m=mode: runs.append((_m, len(rows))) or _o(rows, *a)
    prompts = [[5, 9, 2, 7, 7, 1], [3] * 9, [11, 4, 8]]
    rows = [4, 0, 2]
    want = _steps(runners[0], prompts, rows)
    got = _steps(g, prompts, rows)
    assert runs == [("decode", 3), ("verify", 3), ("decode", 3)]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"tensor {i}: {m}")


@pytest.mark.parametrize("run", ["experts_grouped", "experts_dense"])
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_padded_graph_path_with_the_cuda_expert_runs_equals_eager(make_ckpt, monkeypatch, kind, run):
    """MoE layers with the expert runs CUDA takes (here on the CPU) through the padded graph
    path: the padding entry's tokens routed to experts leave every real row's output and
    state as the unpadded eager forward's."""
    from ppspec.stage_server.layers import moe

    monkeypatch.setattr(moe, "pick_experts", lambda x, experts, _fn=getattr(moe, run): _fn)
    test_padded_graph_path_equals_eager(make_ckpt, monkeypatch, kind, "replay")


def test_with_the_switch_off_the_families_stay_eager(make_ckpt, monkeypatch):
    monkeypatch.setenv("PPSPEC_FAMILY_GRAPHS", "0")
    r = StageRunner(make_ckpt("falcon_h1_a"), max_rows=2, num_speculative_steps=1, cuda_graph_max_bs=2)
    assert not r.model.capturable and not r.graphs
    monkeypatch.setenv("PPSPEC_FAMILY_GRAPHS", "yes")
    with pytest.raises(ValueError, match="PPSPEC_FAMILY_GRAPHS must be 0 or 1, got 'yes'"):
        StageRunner(make_ckpt("falcon_h1_a"), max_rows=2, cuda_graph_max_bs=2)


@pytest.mark.parametrize("kind", ["nemotron_h_c", "nemotron_h_a", "kimi_dense_4l", "granite_a", "qwen3_next_moe"])
def test_pp2_speculation_through_the_padded_graphs_equals_pp1(make_ckpt, monkeypatch, kind):
    """Greedy tokens of PP2 with drafts of the reference continuation, some wrong
    (``test_spec_invariance.Oracle``), requests joining at different steps, every verify
    through the graphs' padded path (NemotronH's second stage has no attention layer; "a"'s
    holds its MoE block), equal PP1 without speculation run eagerly; drafts are accepted."""
    torch.set_num_threads(1)
    from test_spec_invariance import Oracle, drive

    from ppspec.router.llm import LLM

    path = make_ckpt(kind)
    reqs = [dict(prompt=p, max_tokens=12, join_step=j) for p, j in
            (([5, 9, 2, 7] * 6, 0), ([3, 1, 4, 1, 5, 9, 2, 6], 0), ([11, 4, 8], 3))]
    want = drive(LLM(path, max_rows=4), reqs)
    monkeypatch.setenv("PPSPEC_FAMILY_GRAPHS", "1")
    llm = LLM(path, max_rows=4, pp_size=2, speculative_algorithm="ngram", drafter=Oracle(want, seed=1),
              cuda_graph_max_bs=4)
    runs = []
    for r in llm.pipeline.runners:
        orig = r.graphs["verify"].run
        r.graphs["verify"].run = lambda rows, *a, _o=orig: runs.append(len(rows)) or _o(rows, *a)
    assert drive(llm, reqs) == want
    assert runs and any(a > 1 for c in llm.completions.values() for a in c.accept_lengths)
