"""The two commit designs of a stage's GDN state (``StageRunner(commit_design=)``) give the
same states and logits on the same runner inputs, and both match Hugging Face
transformers on the sequences the accepted tokens spell.

``copy``: the verify writes the state after each step into a scratch, the commit copies
``scratch[row, accept_length - 1]``. ``replay`` (docs/DESIGN.md, "Commit rule"): the verify keeps only
its step inputs, the commit records the accept length, and the row's next verify, decode
or continuing prefill applies those steps; a new request's prefill drops them.
"""
import pytest
import torch

from ppspec.kernels.gdn.naive_replay import replay_pending_ref
from ppspec.proto.messages import StepInput
from ppspec.stage_server.pools import StatePool, state_pool_nbytes
from ppspec.stage_server.runner import StageRunner

CKPT = "qwen3_5_ratio2_7l"  # 7 layers, 4 value heads per 2 key heads
D = 4
TOL_DESIGNS = 1e-5  # copy vs replay, fp32
TOL_HF = 1e-4       # either vs transformers (as tests/test_model_reference.py)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def committed_ssm(runner) -> torch.Tensor:
    """``[L, rows + 1, HV, K, V]``: the committed state of every row; for the replay design
    the stored state with each row's pending accepted steps applied (nothing is written)."""
    st = runner.state
    if st.replay is None:
        return st.ssm.clone()
    rows = torch.arange(st.ssm.shape[1])
    return torch.stack([replay_pending_ref(st.ssm[i].float(), b, rows) for i, b in enumerate(st.replay)])


def step(runner, *args, **kw):
    """Run one micro-batch on a one-stage pipeline; all logits ``[T, vocab]`` fp32."""
    _, h = runner.forward_hidden(StepInput(*args, **kw))
    return runner.model.logits(h)


@pytest.fixture(scope="module")
def sequences():
    g = torch.Generator().manual_seed(3)
    return {name: torch.randint(0, 256, (n,), generator=g).tolist() for name, n in (("a", 48), ("b", 20), ("c", 20))}


@pytest.fixture(scope="module")
def hf_reference(make_ckpt, sequences):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = make_ckpt(CKPT)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return path, {k: hf(torch.tensor([s])).logits[0] for k, s in sequences.items()}


def test_replay_and_copy_give_the_same_state_and_logits(hf_reference, sequences):
    """Chunked prefill, verify + commit with different accept lengths, decode, a second
    verify + commit, then one batch that continues row 5's prefill (its pending steps must
    be applied first) and starts a new request in row 2, released with steps pending (they
    must be dropped), then verify + commit + decode again. After every step both designs
    agree on logits and committed states, and logits match transformers."""
    path, ref = hf_reference
    a, b, c = sequences["a"], sequences["b"], sequences["c"]
    runners = {d: StageRunner(path, max_rows=8, num_speculative_steps=D - 1, commit_design=d) for d in ("copy", "replay")}
    assert runners["replay"].state.ssm_scratch is None and runners["copy"].state.replay is None
    rep = runners["replay"].state

    def run_both(*args, expect, **kw):
        """Same step on both; their logits agree, and each request's first tokens match
        transformers: ``expect`` has one ``(sequence, positions)`` per request (padding
        tokens after the drafts are not checked)."""
        got = {d: step(r, *args, **kw) for d, r in runners.items()}
        assert (got["copy"] - got["replay"]).abs().max() < TOL_DESIGNS
        start = 0
        for (name, pos), n in zip(expect, args[5]):  # args[5]: extend_lens
            want = ref[name][pos]
            for lg in got.values():
                assert (lg[start : start + want.shape[0]] - want).abs().max() < TOL_HF, (name, pos)
            start += n

    def states_agree(rows):
        s_copy, s_rep = committed_ssm(runners["copy"]), committed_ssm(runners["replay"])
        assert (s_copy[:, rows] - s_rep[:, rows]).abs().max() < TOL_DESIGNS
        assert torch.equal(runners["copy"].state.conv[:, rows], rep.conv[:, rows])

    # prefill in two chunks: a in row 5, b in row 2 (stable rows, not batch positions)
    run_both(0, 0, "prefill", [5, 2], [0, 0], [16, 6], a[:16] + b[:6], expect=[("a", slice(0, 16)), ("b", slice(0, 6))])
    run_both(0, 1, "prefill", [5, 2], [16, 6], [8, 4], a[16:24] + b[6:10], expect=[("a", slice(16, 24)), ("b", slice(6, 10))])
    states_agree([5, 2])
    # verify D tokens each (the true continuation: logits at all D positions are checkable)
    run_both(0, 2, "verify", [5, 2], [24, 10], [D, D], a[24:28] + b[10:14], num_drafts=[3, 3],
             expect=[("a", slice(24, 28)), ("b", slice(10, 14))])
    for r in runners.values():
        r.commit_accept(0, 2, [5, 2], [3, 1])
    # replay: nothing moved yet, the commit only recorded the accept lengths
    assert rep.replay_pending[:, 5].tolist() == [3] * rep.ssm.shape[0]
    assert rep.replay_pending[:, 2].tolist() == [1] * rep.ssm.shape[0]
    assert (rep.ssm[:, 5] - runners["copy"].state.ssm[:, 5]).abs().max() > 1e-3
    states_agree([5, 2])
    # decode from the committed state: a has 27 tokens, b has 11; decode applies pending steps
    run_both(0, 3, "decode", [5, 2], [27, 11], [1, 1], [a[27], b[11]], expect=[("a", [27]), ("b", [11])])
    assert int(rep.replay_pending.abs().sum()) == 0
    assert (rep.ssm[:, [5, 2]] - runners["copy"].state.ssm[:, [5, 2]]).abs().max() < TOL_DESIGNS
    # second verify; b only has 2 drafts (padding after them)
    run_both(0, 4, "verify", [5, 2], [28, 12], [D, D], a[28:32] + b[12:15] + [0], num_drafts=[3, 2],
             expect=[("a", slice(28, 32)), ("b", slice(12, 15))])
    for r in runners.values():
        r.commit_accept(0, 4, [5, 2], [4, 2])  # a: 32 tokens, b: 14, both with steps pending
        r.release([2])
    assert int(rep.replay_pending[0, 2]) == 2 and int(rep.replay_pending[0, 5]) == 4
    states_agree([5])
    # one prefill batch: row 5 continues (flush its 4 pending steps), row 2 starts request c
    run_both(0, 5, "prefill", [5, 2], [32, 0], [6, 9], a[32:38] + c[:9], expect=[("a", slice(32, 38)), ("c", slice(0, 9))])
    assert int(rep.replay_pending.abs().sum()) == 0
    assert (rep.ssm[:, [5, 2]] - runners["copy"].state.ssm[:, [5, 2]]).abs().max() < TOL_DESIGNS
    # the new request continues normally: verify (rows in another order), commit, decode
    run_both(0, 6, "verify", [2, 5], [9, 38], [D, D], c[9:13] + a[38:42], num_drafts=[3, 3],
             expect=[("c", slice(9, 13)), ("a", slice(38, 42))])
    for r in runners.values():
        r.commit_accept(0, 6, [2, 5], [2, 3])
    states_agree([2, 5])
    run_both(0, 7, "decode", [5, 2], [41, 11], [1, 1], [a[41], c[11]], expect=[("a", [41]), ("c", [11])])
    assert (rep.ssm[:, [5, 2]] - runners["copy"].state.ssm[:, [5, 2]]).abs().max() < TOL_DESIGNS


def test_bf16_stage_replays_exactly_what_it_verified(make_ckpt, sequences):
    """bf16 stage: the replay buffers are fp32 (normalised key, delta, log decay: the
    model computes g in fp32, and the delta comes from the fp32 state), so the replayed
    state equals the copy design's fp32 scratch state and the next decode is identical."""
    path = make_ckpt(CKPT)
    a, b = sequences["a"], sequences["b"]
    runners = {d: StageRunner(path, max_rows=4, num_speculative_steps=D - 1, dtype=torch.bfloat16, commit_design=d)
               for d in ("copy", "replay")}
    bufs = runners["replay"].state.replay[0]
    assert all(t.dtype == torch.float32 for t in (bufs.k, bufs.delta, bufs.g))
    for r in runners.values():
        step(r, 0, 0, "prefill", [1, 3], [0, 0], [20, 10], a[:20] + b[:10])
        step(r, 0, 1, "verify", [1, 3], [20, 10], [D, D], a[20:24] + b[10:14], num_drafts=[3, 3])
        r.commit_accept(0, 1, [1, 3], [4, 2])
    s_copy, s_rep = committed_ssm(runners["copy"]), committed_ssm(runners["replay"])
    assert (s_copy[:, [1, 3]] - s_rep[:, [1, 3]]).abs().max() < TOL_DESIGNS
    out = {d: step(r, 0, 2, "decode", [1, 3], [24, 12], [1, 1], [a[24], b[12]]) for d, r in runners.items()}
    assert torch.equal(out["copy"], out["replay"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("design", ["copy", "replay"])
def test_state_pool_bytes_are_known_before_allocating(design, dtype):
    """``state_pool_nbytes`` (the memory-budget check) equals what ``StatePool`` allocates;
    the replay design's buffers are far smaller than the per-step state scratch."""
    args = (3, 10, 4, 32, 32, 192, 4, 4, dtype)
    pool = StatePool(*args, "cpu", num_k_heads=2, commit_design=design)
    plan = state_pool_nbytes(3, 10, 2, 4, 32, 32, 192, 4, 4, dtype, design)
    assert pool.nbytes == plan
    copy = state_pool_nbytes(3, 10, 2, 4, 32, 32, 192, 4, 4, dtype, "copy")
    if design == "replay":
        assert plan["verify_scratch"] < copy["verify_scratch"] / 3
        assert plan["state"] == copy["state"]
    no_verify = StatePool(3, 10, 4, 32, 32, 192, 4, 1, dtype, "cpu", commit_design=design)
    assert no_verify.nbytes["verify_scratch"] == 0
    with pytest.raises(RuntimeError, match="D = 1"):
        no_verify.commit(torch.tensor([1]), torch.tensor([1]))


def test_replay_commit_checks_rows_before_writing():
    pool = StatePool(2, 4, 2, 8, 8, 48, 4, 3, torch.float32, "cpu", num_k_heads=2, commit_design="replay")
    for rows, acc, err in [([5], [1], IndexError), ([1, 1], [1, 2], IndexError), ([1], [0], ValueError),
                           ([1], [4], ValueError), ([1, 2], [1], ValueError)]:
        with pytest.raises(err):
            pool.commit(torch.tensor(rows), torch.tensor(acc))
    assert int(pool.replay_pending.abs().sum()) == 0 and int(pool.replay_slot.abs().sum()) == 0
    pool.commit(torch.tensor([3, 0]), torch.tensor([2, 3]))
    assert pool.replay_pending.tolist() == [[3, 0, 0, 2, 0]] * 2 and pool.replay_slot.tolist() == [[1, 0, 0, 1, 0]] * 2
    # every layer's buffers see the one commit (views of the [L, R] counters)
    assert [int(b.pending[3]) for b in pool.replay] == [2, 2]


def test_commit_design_choice_and_errors(make_ckpt):
    path = make_ckpt(CKPT)
    r = StageRunner(path, max_rows=2, num_speculative_steps=2)
    assert r.commit_design == "copy" and r.info()["commit_design"] == "copy"  # CPU default
    r = StageRunner(path, max_rows=2, num_speculative_steps=2, commit_design="replay")
    assert r.info()["commit_design"] == "replay" and r.memory_report()["verify_scratch"] == r.state.nbytes["verify_scratch"]
    with pytest.raises(ValueError, match="copy, replay"):
        StageRunner(path, commit_design="scratch")
    with pytest.raises(ValueError, match="copy, replay"):
        StatePool(1, 2, 2, 8, 8, 48, 4, 3, torch.float32, "cpu", commit_design="")
    # the budget check counts the replay buffers, not a state scratch
    need = {}
    for d in ("copy", "replay"):
        with pytest.raises(ValueError, match="state \\+ verify scratch") as e:
            StageRunner(path, max_rows=20000, num_speculative_steps=3, commit_design=d, memory_budget=1)
        need[d] = float(str(e.value).split("state + verify scratch ")[1].split(")")[0])
    assert need["replay"] < need["copy"]


def test_cli_options_pass_the_design():
    from ppspec.launch.serve import build_parser as serve_parser
    from ppspec.stage_server.server import build_parser as stage_parser

    assert stage_parser().parse_args([]).commit_design is None
    assert stage_parser().parse_args(["--commit-design", "replay"]).commit_design == "replay"
    assert serve_parser().parse_args(["--commit-design", "copy"]).commit_design == "copy"
    with pytest.raises(SystemExit):
        stage_parser().parse_args(["--commit-design", "other"])
