"""The commit at stable rows, speculative rejection sampling, and bad input."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ppspec.kernels.commit import commit_accept
from ppspec.kernels.commit.naive import commit_accept_ref
from ppspec.kernels.gdn import gdn_recurrent
from ppspec.proto.messages import SamplingSpec
from ppspec.router.llm import LLM
from ppspec.router.scheduler import Scheduler
from ppspec.router.types import ContextLengthError, InvalidRequestError, SamplingParams
from ppspec.stage_server.config import CheckpointError
from ppspec.stage_server.loader import load_stage_model
from ppspec.stage_server.sampler import filter_probs, verify_and_sample


def _verify_inputs(B, D, g):
    H, HV, K, V = 2, 4, 8, 8
    return (torch.randn(B, D, H, K, generator=g), torch.randn(B, D, H, K, generator=g),
            torch.randn(B, D, HV, V, generator=g), -torch.rand(B, D, HV, generator=g),
            torch.rand(B, D, HV, generator=g))


def test_commit_of_two_micro_batches_uses_their_own_rows():
    """Two micro-batches verify back to back (disjoint stable rows), then commit. The stable
    commit equals running each request alone; swapping in positional scratch rows (0..B-1)
    or the other micro-batch's rows gives a different state."""
    g = torch.Generator().manual_seed(0)
    rows_n, D = 10, 4
    state0 = torch.randn(rows_n + 1, 4, 8, 8, generator=g)
    state, scratch = state0.clone(), torch.zeros(rows_n + 1, D, 4, 8, 8)
    mb = {0: torch.tensor([7, 2, 5]), 1: torch.tensor([1, 9, 3])}
    inputs = {m: _verify_inputs(3, D, g) for m in mb}
    acc = {0: torch.tensor([2, 4, 1]), 1: torch.tensor([3, 1, 2])}
    for m in mb:
        gdn_recurrent(*inputs[m], state, mb[m], scratch)
    # reference: each request alone, decoding its accepted prefix in place
    expect = state0.clone()
    for m in mb:
        for b, row in enumerate(mb[m].tolist()):
            a = int(acc[m][b])
            q, k, v, gg, beta = (x[b : b + 1, :a] for x in inputs[m])
            gdn_recurrent(q, k, v, gg, beta, expect, torch.tensor([row]))
    stable = state.clone()[None]
    for m in mb:
        commit_accept(stable, scratch[None], mb[m], acc[m])
    assert torch.allclose(stable[0], expect, atol=1e-6)
    # the two bugs: positional rows, and another micro-batch's rows
    for wrong_rows in (torch.arange(3), mb[1]):
        bad = state.clone()[None]
        bad[:, mb[0]] = scratch[None][:, wrong_rows, acc[0] - 1]
        assert not torch.allclose(bad[0][mb[0]], expect[mb[0]], atol=1e-3)


def test_commit_rejects_bad_rows_before_writing():
    state, scratch = torch.zeros(1, 5, 3), torch.ones(1, 5, 4, 3)
    for rows, acc, err in [([5], [1], IndexError), ([-1], [1], IndexError), ([1, 1], [1, 2], IndexError),
                           ([1], [0], ValueError), ([1], [5], ValueError), ([1, 2], [1], ValueError)]:
        with pytest.raises(err):
            commit_accept(state, scratch, torch.tensor(rows), torch.tensor(acc))
    assert state.abs().sum() == 0
    commit_accept_ref(state, scratch, torch.tensor([2]), torch.tensor([3]))
    assert state[0, 2].sum() == 3


@pytest.mark.parametrize("spec", [SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.7, top_k=4),
                                  SamplingSpec(temperature=1.3, top_p=0.8), SamplingSpec(temperature=1.0, min_p=0.1)])
def test_rejection_sampling_keeps_the_target_distribution(spec):
    """Chi-square: the first emitted token of a verify with one (deterministic) draft is
    distributed as the filtered target, whichever token is drafted."""
    V, N = 6, 4000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])
    target = filter_probs(logits[None], spec)[0].double().numpy()
    target = target / target.sum()
    for draft in (0, 3):
        specs = [SamplingSpec(**{**spec.__dict__, "seed": 1000 + i}) for i in range(N)]
        res = verify_and_sample(logits.expand(N, 2, V).contiguous(), torch.full((N, 1), draft), [1] * N, specs, [0] * N)
        counts = np.bincount([r.tokens[0] for r in res], minlength=V)
        support = target > 0
        assert counts[~support].sum() == 0
        p = chisquare(counts[support], target[support] / target[support].sum() * counts.sum()).pvalue
        assert p > 1e-3, (draft, counts, target)


def test_sampling_is_a_function_of_seed_and_position():
    logits = torch.randn(1, 1, 50, generator=torch.Generator().manual_seed(0))
    a = verify_and_sample(logits, torch.zeros(1, 0, dtype=torch.long), [0], [SamplingSpec(1.0, seed=5)], [3])
    b = verify_and_sample(logits, torch.zeros(1, 0, dtype=torch.long), [0], [SamplingSpec(1.0, seed=5)], [3])
    assert a[0].tokens == b[0].tokens


def test_every_bit_of_the_seed_counts():
    """torch's CPU generator keeps 32 bits of its seed; seeds 2^32 apart (and 2^63 apart)
    must still sample differently: 64 draws over 1000 flat tokens agree only by chance."""
    logits = torch.zeros(64, 1, 1000)
    none = torch.zeros(64, 0, dtype=torch.long)

    def draws(seed):
        return [r.tokens[0] for r in verify_and_sample(
            logits, none, [0] * 64, [SamplingSpec(1.0, seed=seed)] * 64, list(range(64)))]

    for seed in (0, 1, 12345):
        base = draws(seed)
        assert base == draws(seed)
        for other in (seed + (1 << 32), seed + (1 << 40), seed + (1 << 63)):
            assert sum(x == y for x, y in zip(base, draws(other))) < 8, (seed, other)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_fail_with_file_and_tensor(make_ckpt, tmp_path):
    src = make_ckpt("qwen3_5_ratio1")
    d = _copy(src, tmp_path / "missing")
    os.remove(d / "model.safetensors")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_stage_model(str(d))
    d = _copy(src, tmp_path / "mt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*unsupported model_type 'llama'"):
        load_stage_model(str(d))
    from safetensors.torch import load_file, save_file

    d = _copy(src, tmp_path / "shape")
    w = load_file(d / "model.safetensors")
    w["model.layers.1.linear_attn.out_proj.weight"] = torch.zeros(3, 3)
    save_file(w, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.1\.linear_attn\.out_proj\.weight' has shape \(3, 3\)"):
        load_stage_model(str(d))
    d = _copy(src, tmp_path / "gone")
    w = load_file(d / "model.safetensors")
    del w["model.layers.3.self_attn.k_norm.weight"]
    save_file(w, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.3\.self_attn\.k_norm\.weight' missing"):
        load_stage_model(str(d))
    (tmp_path / "nocfg").mkdir()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_stage_model(str(tmp_path / "nocfg"))


def test_over_long_prompt_allocates_nothing_and_excess_requests_wait(make_ckpt):
    torch.set_num_threads(1)
    llm = LLM(make_ckpt("qwen3_5_ratio1"), max_rows=2, max_context=64)
    free_before = list(llm.scheduler.free_rows)
    with pytest.raises(ContextLengthError, match="50 in the prompt, 20 for the completion"):
        llm.add_request(list(range(50)), SamplingParams(temperature=0, max_tokens=20))
    assert llm.scheduler.free_rows == free_before and not llm.scheduler.requests
    ids = [llm.add_request([i + 1, i + 2, i + 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)) for i in range(5)]
    peak = 0
    while llm.has_unfinished():
        llm.step()
        peak = max(peak, llm.scheduler.num_running)
        assert llm.scheduler.num_running <= 2
    assert peak == 2 and all(len(llm.completions[i].token_ids) == 5 for i in ids)
    assert llm.rows_in_use() == [0]


def test_scheduler_rejects_bad_parameters():
    s = Scheduler(max_rows=2, kv_tokens=1000, max_context=100)
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(min_tokens=9, max_tokens=3)):
        with pytest.raises(Exception, match="must"):
            s.add("x", [1, 2], SamplingParams(**bad))
    assert not s.requests and len(s.free_rows) == 2
    # wrong types are refused by name, not truncated or raised as a bare TypeError
    for bad, name in ((dict(max_tokens=2.5), "max_tokens"), (dict(top_k=2.5), "top_k"),
                      (dict(logprobs=True), "logprobs"), (dict(seed=1.5), "seed"), (dict(temperature="0"), "temperature"),
                      (dict(min_tokens=None), "min_tokens"), (dict(ignore_eos="yes"), "ignore_eos"),
                      (dict(stop_token_ids=[1.0]), "stop_token_ids"), (dict(stop_token_ids=7), "stop_token_ids")):
        with pytest.raises(InvalidRequestError, match=f"{name} must") as e:
            s.add("x", [1, 2], SamplingParams(**bad))
        assert e.value.param == name
    assert not s.requests and len(s.free_rows) == 2
    s.add("np", [1, 2], SamplingParams(max_tokens=np.int64(3), seed=np.int32(5), temperature=np.float32(0.5)))


def test_a_result_for_requests_failed_in_flight_is_dropped():
    """A stage failure ends every request (``fail_all``) while a micro-batch is out; its
    result, arriving after, must not resurrect or double-release them."""
    s = Scheduler(max_rows=2, kv_tokens=1000, max_context=100)
    s.add("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    batch = s.schedule(0)
    dropped, rows = s.fail_all()
    assert [r.request_id for r in dropped] == ["a"] and rows == [0]
    up = s.process(batch, [[7]])
    assert up.outputs == [] and up.release_rows == []
    s.free(rows)
    assert len(s.free_rows) == 2 and s.kv_reserved == 0 and not s.has_work()


def test_any_int64_seed_reaches_the_stages_as_its_uint64_bits():
    """The API takes seeds in [-2^63, 2^63) (plus the choice index with n > 1); the stage
    message holds a uint64. A negative seed once failed its whole micro-batch at encoding."""
    from ppspec.proto.codec import step_from_pb, step_to_pb

    s = Scheduler(max_rows=4, kv_tokens=1000, max_context=100)
    for rid, seed in (("neg", -1), ("min", -(1 << 63)), ("max", (1 << 63) - 1 + 3)):
        s.add(rid, [1, 2], SamplingParams(temperature=1.0, seed=seed))
    batch = s.schedule(0)
    assert [r.seed for r in batch.requests] == [(1 << 64) - 1, 1 << 63, (1 << 63) + 2]
    specs = step_from_pb(step_to_pb(batch.step_input([2]))).sampling
    assert [x.seed for x in specs] == [(1 << 64) - 1, 1 << 63, (1 << 63) + 2]


def test_sampling_values_the_api_accepts_reach_the_stage_meaning_the_same(make_ckpt):
    """Values the API accepts once failed their whole micro-batch (HTTP 500 for innocent
    requests too): stage.proto's float32 / int32 fields turned temperature 3.5e38 into
    inf, top_p 1e-46 into 0 and top_k 2^31 into an encoding error. The spec is now
    canonical on both sides of the wire: every value survives it, means what it meant,
    and the stage accepts it; temperatures below 1e-5 are greedy (vLLM's rule), as a
    tiny divisor overflows fp32 logits; a non-finite temperature is refused at the API."""
    from ppspec.proto.codec import step_from_pb, step_to_pb
    from ppspec.proto.messages import GREEDY_BELOW
    from ppspec.stage_server.runner import StageRunner

    s = Scheduler(max_rows=8, kv_tokens=1000, max_context=100)
    odd = [dict(temperature=3.5e38), dict(temperature=1.0, top_p=1e-46), dict(temperature=1.0, top_k=2**31),
           dict(temperature=1.0, top_k=3 * 10**30), dict(temperature=1e-38), dict(temperature=0.5, min_p=1e-46)]
    for i, kw in enumerate(odd):
        s.add(f"r{i}", [1, 2], SamplingParams(seed=i, **kw))
    inp = step_from_pb(step_to_pb(s.schedule(0).step_input([2])))
    specs = inp.sampling
    assert specs[0].temperature == pytest.approx(3.4028234663852886e38) and specs[1].top_p > 0
    assert specs[2].top_k == specs[3].top_k == 2**31 - 1 and specs[4].temperature == 0.0
    runner = StageRunner(make_ckpt("qwen3_5_ratio1"), max_rows=8)
    runner.check_input(inp, hidden=False)  # the stage accepts every one
    # and samples from them: uniform at a huge temperature, the top token at a tiny top_p
    logits = torch.randn(1, 1, 50)
    logits[0, 0, 7] = 30.0
    assert verify_and_sample(logits, torch.zeros(1, 0, dtype=torch.long), [0], [specs[1]], [0])[0].tokens == [7]
    assert torch.allclose(filter_probs(logits[0, 0], specs[0]), torch.full((50,), 1 / 50))
    assert verify_and_sample(logits, torch.zeros(1, 0, dtype=torch.long), [0], [specs[4]], [0])[0].tokens == [7]
    assert SamplingSpec(temperature=GREEDY_BELOW).temperature == GREEDY_BELOW  # the rule's edge: still sampled
    assert SamplingParams(temperature=9e-6).greedy and not SamplingParams(temperature=1e-5).greedy
    for t in (float("inf"), float("nan")):
        with pytest.raises(Exception, match="temperature must be a finite number >= 0"):
            s.add("bad", [1, 2], SamplingParams(temperature=t))


def test_the_fast_sampling_check_refuses_exactly_what_the_named_checks_refuse(make_ckpt):
    """check_input judges each request's sampling with one expression (it runs for every
    request of every step) and runs the field-by-field checks only to name a failure: the
    two must agree on every spec, edge values included, and a bad spec is refused naming
    its request and field."""
    import random

    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    runner = StageRunner(make_ckpt("qwen3_5_ratio1"), max_rows=4)
    V = runner.cfg.vocab_size
    nan, inf = float("nan"), float("inf")
    values = dict(temperature=[0.0, 1e-6, 0.7, 3e38, -0.5, nan, inf], top_p=[1.0, 0.5, 1e-30, 0.0, 1.5, -1.0, nan],
                  top_k=[0, -1, -2, 5, 2**31 - 1], min_p=[0.0, 0.3, 1.0, -0.1, 1.1, nan],
                  logprobs=[None, 0, 5, V, V + 1, -1], min_tokens=[0, 3, -1],
                  banned_until_min=[[], [0, V - 1], [V], [-1]])
    rng = random.Random(0)
    for _ in range(3000):
        spec = SamplingSpec(**{k: rng.choice(v) for k, v in values.items()})
        try:
            runner._check_sampling(0, spec)
            refused = False
        except ValueError:
            refused = True
        assert runner._sampling_ok(spec) is not refused, spec
    for field, bad in (("top_p", 0.0), ("min_tokens", -1), ("banned_until_min", [V])):
        inp = StepInput(0, 0, "prefill", [0, 1], [0, 0], [2, 2], [1, 2, 3, 4],
                        sampling=[SamplingSpec(), SamplingSpec(temperature=1.0, **{field: bad})])
        with pytest.raises(ValueError, match=rf"sampling\[1\]: {field}"):
            runner.check_input(inp)
    assert not runner.rows_in_use  # refused before anything ran


def test_a_spec_with_a_long_token_list_is_checked_once_and_masked_as_written(make_ckpt, monkeypatch):
    """A spec listing thousands of ``allowed_token_ids`` passes the full check once per
    object (a row's spec is the same read-only object every step), never a refused one, and
    its sampling mask is kept by the list's identity: every step masks exactly the list the
    spec holds, also when a new list takes a freed one's place."""
    import gc

    from ppspec.proto.messages import StepInput
    from ppspec.stage_server import sampler
    from ppspec.stage_server.runner import StageRunner

    runner = StageRunner(make_ckpt("qwen3_5_ratio1"), max_rows=4)
    V = runner.cfg.vocab_size
    full = []
    monkeypatch.setattr(runner.checker, "_check_sampling",
                        lambda b, spec, f=runner.checker._check_sampling: (full.append(spec), f(b, spec)))
    good = SamplingSpec(temperature=1.0, allowed_token_ids=list(range(0, V, 3)))
    bad = SamplingSpec(temperature=1.0, allowed_token_ids=[1, V])

    def step(spec):
        return StepInput(0, 0, "prefill", [0], [0], [2], [1, 2], sampling=[spec])

    for _ in range(3):
        runner.check_input(step(good))
    assert full == [good]  # once, whatever the steps
    runner.check_input(step(SamplingSpec(temperature=1.0, allowed_token_ids=list(range(0, V, 3)))))
    assert len(full) == 2  # an equal spec of another object: checked itself
    for _ in range(2):
        with pytest.raises(ValueError, match=r"sampling\[0\]: allowed_token_ids"):
            runner.check_input(step(bad))
    assert full[2:] == [bad, bad]  # refused every time, never remembered as checked

    torch.manual_seed(0)
    logits = torch.randn(2, 1, V)
    for trial in range(4):
        lists = [sorted(torch.randperm(V)[: 5 + trial].tolist()) for _ in range(2)]
        specs = [SamplingSpec(temperature=0.0, allowed_token_ids=ids) for ids in lists]
        got = sampler.adjust_logits(logits, [[], []], specs, [0, 0])
        want = torch.full_like(logits, float("-inf"))
        for b, ids in enumerate(lists):
            want[b, :, ids] = logits[b, :, ids]
        assert torch.equal(got, want), trial
        del specs, lists
        gc.collect()  # the next lists may take these lists' addresses


def test_stage_start_errors_are_clear(make_ckpt):
    from ppspec.stage_server.runner import StageRunner

    path = make_ckpt("qwen3_5_ratio1")
    with pytest.raises(ValueError, match=r"needs .* GiB .* memory budget is 0\.00 GiB"):
        StageRunner(path, memory_budget=1000)
    assert StageRunner(path, max_rows=2, memory_budget=1 << 30).max_rows == 2
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            StageRunner(path, device="cuda")


def test_memory_budget_counts_cuda_graphs(make_ckpt, monkeypatch):
    """The budget covers the graphs too: measured as the allocator's growth over the
    capture (faked here: a CPU stage allocates nothing on CUDA), refused right after it
    with the three parts named, and reported by ``memory_report``."""
    import ppspec.stage_server.runner as runner_mod
    from ppspec.stage_server.runner import StageRunner

    path = make_ckpt("qwen3_5_ratio1")
    fits = StageRunner(path, max_rows=2, memory_budget=1 << 30)
    need = sum(v for k, v in fits.memory_report().items() if k != "cuda_graphs")
    held = iter([0, (1 << 30) - need + 1])  # before and after the capture: one byte too many
    monkeypatch.setattr(runner_mod, "_reserved", lambda device: next(held))
    with pytest.raises(ValueError, match=r"pools 0\.\d+, CUDA graphs for batches up to 2 0\.98; its memory budget is 1\.00 GiB.*--cuda-graph-max-bs"):
        StageRunner(path, max_rows=2, memory_budget=1 << 30, cuda_graph_max_bs=2)
    held = iter([0, 4096])
    monkeypatch.setattr(runner_mod, "_reserved", lambda device: next(held))
    r = StageRunner(path, max_rows=2, memory_budget=1 << 30, cuda_graph_max_bs=2)
    assert r.memory_report()["cuda_graphs"] == 4096


def test_stage_cli_exits_with_one_clear_line(make_ckpt, tmp_path):
    import subprocess
    import sys

    from cluster import free_port

    path = make_ckpt("qwen3_5_ratio1")
    for extra, msg in ((["--memory-budget-gb", "0.000001"], "memory budget"),
                       (["--model", str(tmp_path)], "config.json: missing")):
        p = subprocess.run([sys.executable, "-m", "ppspec.cli", "stage", "--model", path, "--port", str(free_port())] + extra,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
    own = free_port()
    for extra, msg in ((["--next-stage", "foo"], "expected host:port, got 'foo'"),
                       (["--next-stage", f"127.0.0.1:{free_port()}"], "--next-stage given to the last stage"),
                       (["--pp-size", "2"], "--next-stage is required on every stage but the last"),
                       (["--pp-size", "2", "--next-stage", f"localhost:{own}"], "is this stage's own address")):
        p = subprocess.run([sys.executable, "-m", "ppspec.cli", "stage", "--model", path, "--port", str(own)] + extra,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, (extra, p.stderr)


def test_a_stage_wired_to_the_wrong_next_stage_exits_and_one_waiting_is_not_serving(make_ckpt, tmp_path):
    """``--next-stage`` names a stage that is not pp_rank + 1 of this pipeline: the stage
    exits with one line naming both; while the next stage does not answer, the stage's
    health for the stage service says NOT_SERVING (a router waits instead of relaying into
    nothing), and it turns SERVING once the right stage is up."""
    import subprocess
    import sys

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from cluster import free_port
    from ppspec.proto.stubs import STAGE_SERVICE

    path = make_ckpt("qwen3_5_ratio1")
    ports = [free_port() for _ in range(3)]

    def stage(rank, size, port, nxt=None):
        argv = [sys.executable, "-m", "ppspec.cli", "stage", "--model", path, "--port", str(port),
                "--pp-rank", str(rank), "--pp-size", str(size), "--num-threads", "1"]
        return subprocess.Popen(argv + (["--next-stage", f"127.0.0.1:{nxt}"] if nxt else []),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def health(port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                return health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=STAGE_SERVICE), timeout=2).status
            except grpc.RpcError:
                return None

    def wait_for(port, status, proc, timeout=60):
        import time
        deadline = time.monotonic() + timeout
        while health(port) != status:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"port {port} never {status}"
            time.sleep(0.3)

    other = stage(2, 3, ports[0])  # the last stage of another, 3-stage pipeline
    first = stage(0, 2, ports[1], nxt=ports[2])  # its next stage is not up yet
    procs = [other, first]
    try:
        wait_for(ports[0], health_pb2.HealthCheckResponse.SERVING, other)
        wait_for(ports[1], health_pb2.HealthCheckResponse.NOT_SERVING, first)
        second = stage(1, 2, ports[2])
        procs.append(second)
        wait_for(ports[1], health_pb2.HealthCheckResponse.SERVING, first)
        wrong = stage(0, 2, free_port(), nxt=ports[0])
        procs.append(wrong)
        _, err = wrong.communicate(timeout=120)
        assert wrong.returncode == 2, err
        assert f"--next-stage 127.0.0.1:{ports[0]} is stage 2 of 3" in err and "expected stage 1 of 2" in err, err
    finally:
        for p in procs:
            p.kill()
            p.communicate()


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_admission_reserves_whole_kv_pages(make_ckpt, spec):
    """Three 80-token prompts with 4 new tokens need 85 tokens each (255 of a 256-token
    pool) but 6 pages of 16 each (18 of 16): admission must count pages, so the requests
    wait their turn instead of exhausting a stage's pool mid-step."""
    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio1")
    prompts = [[5 + i] * 80 for i in range(3)]
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = LLM(path, max_rows=4, kv_tokens=256, speculative_algorithm=spec).generate(prompts, p)
    ref = LLM(path, max_rows=4).generate(prompts, p)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert all(len(o.token_ids) == 4 for o in outs)
