"""End to end over real processes and loopback gRPC: PP 2-4 x speculation none / ngram /
mtp give the tokens of PP1 without speculation; the check catches the commit bugs;
random delays change nothing; rows come back; failures end in clear errors."""
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from cluster import DEMO, Cluster, free_port, sharegpt_prompts, wait_health
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.runner import FAULTS

N_PROMPTS, MAX_TOKENS = 32, 48
TIE_GAP = 1e-4  # docs/DESIGN.md, "Correctness": fp32 near-tie threshold on the reference's top-2 logit gap

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["random_uneven", "demo"])
def reference(request, make_ckpt):
    """Model, prompts, and the PP1 no-speculation reference with its top-2 gaps."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio2_7l") if request.param == "random_uneven" else DEMO
    assert os.path.isfile(os.path.join(path, "config.json")), f"missing checkpoint {path}"
    prompts = sharegpt_prompts(AutoTokenizer.from_pretrained(path), N_PROMPTS)
    llm = LLM(path, max_rows=N_PROMPTS, kv_tokens=32768)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2))
    gaps = [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs]
    return path, prompts, [o.token_ids for o in outs], gaps


async def _complete(url, prompts, max_tokens=MAX_TOKENS, **extra):
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(p):
            r = await client.post(url + "/v1/completions", json=dict(
                prompt=p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_token_ids=True, **extra))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        return await asyncio.gather(*(one(p) for p in prompts))


def complete(url, prompts, **kw):
    return asyncio.run(_complete(url, prompts, **kw))


def divergences(outs, ref, gaps):
    """(real divergences, tolerated near-tie divergences)."""
    real, ties = [], 0
    for i, (o, r) in enumerate(zip(outs, ref)):
        if o == r:
            continue
        j = next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
        if j < len(gaps[i]) and gaps[i][j] < TIE_GAP:
            ties += 1
        else:
            real.append((i, j))
    return real, ties


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("spec", ["none", "ngram", "mtp"])
def test_pipeline_matches_pp1_without_speculation(reference, pp, spec, tmp_path):
    """Over the default data plane: shared memory between stages (stage_server/dataplane.py)."""
    path, prompts, ref, gaps = reference
    with Cluster(path, pp, spec, log_dir=str(tmp_path)) as c:
        outs = complete(c.url, prompts)
        infos = c.wait_rows_free()
        assert [i.transport for i in infos] == ["shm"] * (pp - 1) + [""]
    real, ties = divergences(outs, ref, gaps)
    print(f"PP{pp} {spec}: {ties} near-tie divergences of {len(prompts)} requests")
    assert not real, f"divergences beyond near-ties at (request, position) {real}"
    assert all(i.rows_in_use == 0 for i in infos) and all(i.kv_pages_used == 0 for i in infos)


def test_a_short_kv_pool_preempts_over_grpc_and_changes_no_token(reference, tmp_path):
    """PP3 with MTP and a KV pool a third of what the requests' whole lives need: rows are
    preempted (released on every stage between micro-batches) and recomputed, and every
    output is still PP1's without speculation."""
    from prometheus_client.parser import text_string_to_metric_families

    path, prompts, ref, gaps = reference
    lives = [-(-(len(p) + MAX_TOKENS + 8) // 16) * 16 for p in prompts]
    kv_tokens = max(max(lives), sum(lives) // 3)
    with Cluster(path, 3, "mtp", kv_tokens=kv_tokens, log_dir=str(tmp_path)) as c:
        outs = complete(c.url, prompts)
        infos = c.wait_rows_free()
        text = httpx.get(c.url + "/metrics", timeout=10).text
    preempted = next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "ppspec:num_preemptions_total")
    real, ties = divergences(outs, ref, gaps)
    print(f"kv_tokens {kv_tokens}: {preempted:.0f} preemptions, {ties} near-tie divergences")
    assert preempted > 0
    assert not real, f"divergences beyond near-ties at (request, position) {real}"
    assert all(i.rows_in_use == 0 for i in infos) and all(i.kv_pages_used == 0 for i in infos)


@pytest.fixture(scope="module")
def random_ref(make_ckpt):
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio2_7l")
    prompts = sharegpt_prompts(AutoTokenizer.from_pretrained(path), 16, seed=1)
    outs = LLM(path, max_rows=32).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2))
    gaps = [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs]
    return path, prompts, [o.token_ids for o in outs], gaps


@pytest.mark.parametrize("design", ["copy", "replay"])
@pytest.mark.parametrize("fault", FAULTS)
def test_pipeline_check_catches_commit_faults(random_ref, fault, design, tmp_path):
    path, prompts, ref, gaps = random_ref
    with Cluster(path, 3, "ngram", fault=fault, log_dir=str(tmp_path), commit_design=design) as c:
        outs = complete(c.url, prompts, max_tokens=32)
    real, _ = divergences(outs, ref, gaps)
    assert real, f"fault {fault} went unnoticed"


@pytest.mark.parametrize("design", ["copy", "replay"])
def test_random_message_delays_leave_outputs_unchanged(random_ref, design, tmp_path):
    """Commits and verifies reach the stages in random order, under either commit design
    of the GDN state (``--commit-design``; replay: the next verify applies the commit)."""
    path, prompts, ref, gaps = random_ref
    with Cluster(path, 3, "mtp", delay_ms=30, log_dir=str(tmp_path), commit_design=design) as c:
        outs = complete(c.url, prompts, max_tokens=32)
        infos = c.wait_rows_free()
    real, _ = divergences(outs, ref, gaps)
    assert not real
    assert all(i.rows_in_use == 0 and i.pending_commits == 0 for i in infos)
    assert [i.commit_design for i in infos] == [design] * 3
    assert [i.prefill_attention for i in infos] == ["torch"] * 3  # CPU stages: the plain-torch reference


def test_rows_free_after_aborts_and_bad_requests_get_400(random_ref, tmp_path):
    path, prompts, _, _ = random_ref
    with Cluster(path, 2, "mtp", log_dir=str(tmp_path)) as c:
        async def abort_midstream(p):
            async with httpx.AsyncClient(timeout=60) as client:
                async with client.stream("POST", c.url + "/v1/completions", json=dict(
                        prompt=p, max_tokens=200, temperature=0.0, ignore_eos=True, stream=True)) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data:")
                        if n >= 3:
                            return n  # leaving the block closes the connection mid-stream

        async def scenario():
            return await asyncio.gather(*(abort_midstream(p) for p in prompts[:6]),
                                        _complete(c.url, prompts[6:10], max_tokens=8))

        asyncio.run(scenario())
        infos = c.wait_rows_free()
        assert all(i.rows_in_use == 0 and i.pending_commits == 0 and i.kv_pages_used == 0 for i in infos), infos
        for body in ({"prompt": [1, 2], "max_tokens": -3}, {"prompt": [1, 2], "temperature": "hot"},
                     {"max_tokens": 3}, {"prompt": [1, 2], "max_tokens": 10 ** 7}):
            r = httpx.post(c.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 400, (body, r.text)
            assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_unreachable_stage_at_start_names_it(random_ref):
    path = random_ref[0]
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "ppspec.cli", "router", "--model", path, "--stages",
                        f"127.0.0.1:{port}", "--port", str(free_port()), "--connect-timeout", "2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert f"stage 0 at 127.0.0.1:{port}" in p.stderr


def test_stage_death_gives_503_and_health_names_the_stage(random_ref, tmp_path):
    path, prompts, _, _ = random_ref
    # a step timeout far past the client's: the requests can only end through the stage's death
    with Cluster(path, 3, "none", log_dir=str(tmp_path), router_args=["--step-timeout", "3600"]) as c:
        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                tasks = [asyncio.ensure_future(client.post(c.url + "/v1/completions", json=dict(
                    prompt=p, max_tokens=1500, temperature=0.0, ignore_eos=True))) for p in prompts[:8]]
                await asyncio.sleep(3.0)
                c.kill("stage1")
                return await asyncio.gather(*tasks)
        res = asyncio.run(scenario())
        for r in res:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "service_unavailable"
        assert c.procs["router"].poll() is None, "the router died with the stage"
        wait_health(c.url, 503, "stage 1", timeout=10)
        r = httpx.post(c.url + "/v1/completions", json=dict(prompt=[5, 6, 7], max_tokens=4), timeout=30)
        assert r.status_code == 503


def test_router_recovers_when_a_dead_stage_comes_back(random_ref, tmp_path):
    """A stage dies with verifies in flight (their rows pending on the stages that ran
    them), then comes back on its port: the router abandons the failed rounds' commits,
    releases every row and serves again, with the same greedy tokens as before. Meanwhile
    stage 0 reports not serving (it cannot relay), so the router resumes only once stage
    0's own channel reaches the new stage 1, not at the first step it relays. Stage 0 attaches
    to the new stage 1 (shared memory again), and no segment of either is left in /dev/shm."""
    path, prompts, ref, gaps = random_ref
    with Cluster(path, 2, "mtp", log_dir=str(tmp_path), router_args=["--step-timeout", "20"]) as c:
        async def scenario():
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.ensure_future(client.post(c.url + "/v1/completions", json=dict(
                    prompt=p, max_tokens=1500, temperature=0.0, ignore_eos=True))) for p in prompts[:8]]
                await asyncio.sleep(3.0)
                c.kill("stage1")
                return await asyncio.gather(*tasks)
        assert all(r.status_code == 503 for r in asyncio.run(scenario()))
        killed = str(c.procs["stage1"].pid)
        c.procs["stage1"].wait(10)
        wait_health(c.url, 503, f"stage 0 (127.0.0.1:{c.stage_ports[0]}) is not serving: the next stage at "
                                f"127.0.0.1:{c.stage_ports[1]} does not answer", timeout=30)
        c.start_stage(1)
        deadline = time.monotonic() + 90
        while httpx.get(c.url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the router did not recover after the stage came back"
            time.sleep(0.5)
        outs = complete(c.url, prompts[:6], max_tokens=32)
        c.wait_rows_free()
        # the new stage 1 rejoined the data plane: stage 0 attached to it again
        assert c.stage_infos()[0].transport == "shm"
        assert "data plane: shm" in httpx.get(c.url + "/health", timeout=5).text
        with open(tmp_path / "stage0.log") as f:
            assert f.read().count(": data plane to stage 1 at") == 2
        assert _segments({killed, str(c.procs["stage0"].pid), str(c.procs["stage1"].pid)}) == []
    real, _ = divergences(outs, ref[:6], gaps[:6])
    assert not real, real


def test_steps_go_on_the_stage_sockets_a_restart_reattaches_and_grpc_hops_still_serve(random_ref, tmp_path):
    """PP2 with MTP: the router's steps to stage 0 and stage 0's relay to stage 1 go on the
    stages' Unix sockets (proto/local.py), as Info, /health and the log say, with PP1's
    greedy tokens. Stage 1 killed and started again: stage 0 relays on the new process's
    socket. A stage 1 started with ``--control-channel grpc`` gets its steps on the gRPC
    stream, the hop saying why, with the same tokens."""
    path, prompts, ref, gaps = random_ref
    with Cluster(path, 2, "mtp", log_dir=str(tmp_path)) as c:
        outs = complete(c.url, prompts[:8], max_tokens=32)
        infos = c.wait_rows_free()
        assert [(i.control, i.control_detail) for i in infos] == [("socket", ""), ("", "")]
        assert all(i.control_socket.startswith("@ppspec-steps-") for i in infos)
        assert "data plane: shm; control: socket" in httpx.get(c.url + "/health", timeout=5).text
        old = infos[1].control_socket
        c.kill("stage1")
        c.procs["stage1"].wait(10)
        wait_health(c.url, 503, "is not serving", timeout=30)
        c.start_stage(1)
        wait_health(c.url, 200, "control: socket", timeout=90)
        again = complete(c.url, prompts[:8], max_tokens=32)
        infos = c.wait_rows_free()
        assert infos[0].control == "socket" and infos[1].control_socket not in ("", old)
        with open(tmp_path / "stage0.log") as f:
            log = f.read()
        assert log.count("stage 0 -> stage 1: steps on the stage's socket @ppspec-steps-") == 2, log
    real, _ = divergences(outs + again, ref[:8] * 2, gaps[:8] * 2)
    assert not real, real
    with Cluster(path, 2, "mtp", log_dir=str(tmp_path), control_channel=[None, "grpc"]) as c:
        outs = complete(c.url, prompts[:8], max_tokens=32)
        infos = c.wait_rows_free()
        assert infos[0].control == "grpc" and infos[0].control_detail.startswith("the next stage offers no step socket")
        assert infos[1].control_socket == "" and infos[0].control_socket
        health = httpx.get(c.url + "/health", timeout=5).text
        assert "control: router -> stage 0 socket; stage 0 -> 1 grpc (the next stage offers no step socket" in health
    real, _ = divergences(outs, ref[:8], gaps[:8])
    assert not real, real


def test_inline_steps_under_delays_give_pp1s_tokens_concurrent_and_alone(random_ref, tmp_path):
    """PP3 with MTP, every stage running short steps inline on its event loop when its
    compute queue is idle (``--inline-steps on``, the CUDA default; stage_server/compute.py),
    under random injected delays (commits and verifies arriving in either order): requests
    at once and then one at a time give PP1's greedy tokens, every stage ran jobs inline,
    and no row is left held."""
    path, prompts, ref, gaps = random_ref
    with Cluster(path, 3, "mtp", delay_ms=3, log_dir=str(tmp_path), stage_args=["--inline-steps", "on"]) as c:
        outs = complete(c.url, prompts[:8], max_tokens=32)
        alone = [complete(c.url, [p], max_tokens=32)[0] for p in prompts[8:11]]
        infos = c.wait_rows_free()
        assert all(i.inline_jobs > 0 for i in infos), [i.inline_jobs for i in infos]
        assert [(i.rows_in_use, i.pending_commits) for i in infos] == [(0, 0)] * 3
    real, _ = divergences(outs + alone, ref[:11], gaps[:11])
    assert not real, real


def _segments(pids):
    """Data-plane segments in /dev/shm made by ``pids``."""
    return [n for n in os.listdir("/dev/shm") if n.startswith("ppspec-") and n.split("-")[1] in pids]


def _mapped_segments(pid) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("/dev/shm/ppspec-" in line for line in f)


def test_each_hop_on_its_data_plane_and_no_segment_left(random_ref, tmp_path):
    """PP4 with a hop per transport: 0 -> 1 shared memory, 1 -> 2 inline bytes (``--data-plane
    bytes``), 2 -> 3 falls back to bytes (stage 3 acts as if on another host, and stage 2 asks
    for ``--data-plane shm``, not ``auto``, which would go ``dist``). Greedy tokens
    are PP1's; Info, the router's /health and the stage log say how each hop runs. The
    stages map their slots while /dev/shm lists none (unlinked once mapped), and none is
    left after they stop."""
    path, prompts, ref, gaps = random_ref
    with Cluster(path, 4, "mtp", log_dir=str(tmp_path), data_plane=[None, "bytes", "shm", None],
                 stage_env={3: {"PPSPEC_HOST_ID": "elsewhere/1"}}) as c:
        outs = complete(c.url, prompts[:8], max_tokens=32)
        infos = c.wait_rows_free()
        assert [(i.transport, bool(i.transport_detail)) for i in infos] == [
            ("shm", False), ("bytes", False), ("bytes", True), ("", False)]
        assert infos[2].transport_detail.startswith("the next stage is on another host (elsewhere/1; this stage is on")
        health = httpx.get(c.url + "/health", timeout=5).json()["detail"]
        assert ("data plane: stage 0 -> 1 shm; stage 1 -> 2 bytes; stage 2 -> 3 bytes (fell back: the next stage "
                "is on another host (elsewhere/1;") in health, health
        with open(tmp_path / "stage2.log") as f:
            assert "data plane to stage 3" in f.read()
        pids = {str(c.procs[f"stage{k}"].pid) for k in range(4)}
        assert _mapped_segments(c.procs["stage0"].pid) >= 1 and _mapped_segments(c.procs["stage1"].pid) >= 1
        assert _segments(pids) == []
        for k in range(4):
            c.kill(f"stage{k}", signal.SIGTERM)
        assert all(c.procs[f"stage{k}"].wait(30) == 0 for k in range(4))
        assert _segments(pids) == []
    real, _ = divergences(outs, ref[:8], gaps[:8])
    assert not real, real


@pytest.mark.parametrize("pp", [2, 3])
def test_stages_on_several_hosts_go_dist_and_a_restarted_stage_rejoins(random_ref, pp, tmp_path):
    """PP2 and PP3 with ngram, each stage acting as if on a host of its own (``PPSPEC_HOST_ID``):
    under ``--data-plane auto`` every hop goes ``dist`` (a gloo group over loopback,
    stage_server/dataplane_dist.py), concurrent requests give PP1's greedy tokens, and Info,
    /health and the log say so. The last stage is killed and started again: the stage
    before it attaches to the new process on a fresh group and the same prompts give the
    same tokens."""
    path, prompts, ref, gaps = random_ref
    hosts = {k: {"PPSPEC_HOST_ID": f"host{k}/{k}"} for k in range(pp)}
    last, before = f"stage{pp - 1}", pp - 2
    with Cluster(path, pp, "ngram", log_dir=str(tmp_path), stage_env=hosts) as c:
        outs = complete(c.url, prompts[:8], max_tokens=32)
        infos = c.wait_rows_free()
        assert [(i.transport, i.transport_detail) for i in infos] == [("dist", "")] * (pp - 1) + [("", "")]
        assert "data plane: dist" in httpx.get(c.url + "/health", timeout=5).text
        c.kill(last)
        c.procs[last].wait(10)
        wait_health(c.url, 503, "is not serving", timeout=30)
        c.start_stage(pp - 1)
        wait_health(c.url, 200, "data plane: dist", timeout=90)
        again = complete(c.url, prompts[:8], max_tokens=32)
        infos = c.wait_rows_free()
        assert [(i.transport, i.transport_detail) for i in infos] == [("dist", "")] * (pp - 1) + [("", "")]
        with open(tmp_path / f"stage{before}.log") as f:
            attached = f": data plane to stage {pp - 1} at 127.0.0.1:{c.stage_ports[pp - 1]}: dist"
            assert f.read().count(attached) == 2
    for o in (outs, again):
        real, _ = divergences(o, ref[:8], gaps[:8])
        assert not real, real


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_new_router_resets_the_stages_an_old_one_left_mid_stream(random_ref, tmp_path, sig):
    """The router dies (SIGKILL) or is stopped (SIGTERM) while streams run, its rows held
    and verifies pending on the stages; a stopped router gives its rows back itself, and a
    new router on the same stages releases whatever is left before it reports healthy, then
    serves the greedy tokens of PP1 without speculation."""
    path, prompts, ref, gaps = random_ref
    with Cluster(path, 2, "mtp", log_dir=str(tmp_path)) as c:
        async def scenario():
            async with httpx.AsyncClient(timeout=60) as client:
                async def one(p):
                    try:
                        await client.post(c.url + "/v1/completions", json=dict(
                            prompt=p, max_tokens=1500, temperature=0.0, ignore_eos=True))
                    except httpx.HTTPError:
                        pass
                tasks = [asyncio.ensure_future(one(p)) for p in prompts[:8]]
                deadline = time.monotonic() + 30
                while not any(i.rows_in_use for i in c.stage_infos()):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.2)
                await asyncio.sleep(1.0)
                c.kill("router", sig)
                c.procs["router"].wait(30)
                await asyncio.gather(*tasks)
        asyncio.run(scenario())
        c.procs.pop("router")
        infos = c.stage_infos()
        if sig == signal.SIGTERM:
            assert all(i.rows_in_use == 0 and i.pending_commits == 0 for i in infos), infos
        else:  # a killed router leaves its rows behind; the new one must not trip on them
            assert any(i.rows_in_use for i in infos), infos
        c.start_router("router2")
        c.wait_healthy(120)
        infos = c.stage_infos()  # healthy means reset: nothing left of the old router
        assert all(i.rows_in_use == 0 and i.pending_commits == 0 and i.kv_pages_used == 0 for i in infos), infos
        outs = complete(c.url, prompts[:8], max_tokens=32)
        infos = c.wait_rows_free()
        assert all(i.rows_in_use == 0 and i.pending_commits == 0 and i.kv_pages_used == 0 for i in infos), infos
    real, _ = divergences(outs, ref[:8], gaps[:8])
    assert not real, real


def _router_exit(c, stages, timeout=120):
    """Run ``ppspec router`` on ``stages``; (exit code, stderr) once it exits (it must)."""
    p = subprocess.run([sys.executable, "-m", "ppspec.cli", "router", "--model", c.model, "--stages", stages,
                        "--port", str(free_port()), "--connect-timeout", "30"],
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stderr


def test_one_router_per_pipeline(random_ref, tmp_path):
    """A second router on stages a live router serves refuses to start (it would collide on
    rows and release the live one's), and the first router's streams finish with PP1's
    tokens; once the first is stopped (SIGTERM: it gives back only its own rows), a new
    router takes over."""
    path, prompts, ref, gaps = random_ref
    with Cluster(path, 2, "mtp", log_dir=str(tmp_path)) as c:
        async def scenario():
            work = asyncio.ensure_future(_complete(c.url, prompts[:6], max_tokens=32))
            second = await asyncio.get_running_loop().run_in_executor(None, _router_exit, c, c.stages)
            return await work, second

        outs, (code, err) = asyncio.run(scenario())
        assert code == 2 and "another router" in err and "one router per pipeline" in err, err
        c.kill("router", signal.SIGTERM)
        c.procs.pop("router").wait(30)
        infos = c.stage_infos()
        assert all(i.rows_in_use == 0 and i.pending_commits == 0 for i in infos)
        assert not any(i.routers or i.owner_router_id for i in infos)  # it said it left: no wait for the next
        c.start_router("router2")
        c.wait_healthy(120)
        again = complete(c.url, prompts[6:10], max_tokens=32)
    for got, (want, gap) in ((outs, (ref[:6], gaps[:6])), (again, (ref[6:10], gaps[6:10]))):
        real, _ = divergences(got, want, gap)
        assert not real, real


@pytest.mark.parametrize("new_owner", ["serves", "leaves"])
def test_a_paused_router_yields_to_the_one_that_took_over(random_ref, tmp_path, new_owner):
    """A router paused past the lease (SIGSTOP) looks dead: a new router takes the stages
    over. When the old one resumes it sees the claim and stops serving for good (/health
    503 saying so, requests 503) instead of colliding on rows; the new one serves PP1's
    tokens. "leaves": the new router exits cleanly before the old one resumes (the stages
    then own no router); the stages remember the takeover, so the old router stops
    serving all the same and claims nothing back, and a third router serves."""
    path, prompts, ref, gaps = random_ref
    with Cluster(path, 2, "mtp", log_dir=str(tmp_path)) as c:
        c.kill("router", signal.SIGSTOP)
        try:
            new_port = free_port()
            c.start_router("router2", port=new_port)
            url2 = f"http://127.0.0.1:{new_port}"
            wait_health(url2, 200, timeout=120)  # it took over
            if new_owner == "leaves":
                c.kill("router2", signal.SIGTERM)
                c.procs.pop("router2").wait(30)
                assert {i.owner_router_id for i in c.stage_infos()} == {""}
        finally:
            c.kill("router", signal.SIGCONT)
        wait_health(c.url, 503, "took over these stages", timeout=30)
        r = httpx.post(c.url + "/v1/completions", json=dict(prompt=prompts[0], max_tokens=4), timeout=30)
        assert r.status_code == 503, r.text
        if new_owner == "leaves":
            assert {i.owner_router_id for i in c.stage_infos()} == {""}  # it claimed nothing back
            c.kill("router", signal.SIGTERM)
            c.procs.pop("router").wait(30)
            c.start_router("router3")
            c.wait_healthy(120)
            url2 = c.url
        outs = complete(url2, prompts[:6], max_tokens=32)
        assert httpx.get(url2 + "/health", timeout=5).status_code == 200
    real, _ = divergences(outs, ref[:6], gaps[:6])
    assert not real, real


def test_the_router_checks_the_relay_chain_and_stage_restarts(random_ref, tmp_path):
    """Wiring the router cannot see in its own --stages: a stage that relays to another
    process than the router's next stage is refused at start; a stage that restarts with
    other settings between requests turns /health 503 naming the setting (requests get
    503, not a 500 per request); one that comes back with other layers turns stage 0 off
    and /health names stage 0's reason; back with its settings the pipeline serves again."""
    path, prompts, ref, gaps = random_ref
    x = Cluster(path, 2, "mtp", log_dir=str(tmp_path))
    y = Cluster(path, 2, "mtp", log_dir=str(tmp_path))
    y.procs = x.procs  # one set of processes to stop (y only lends its ports)
    try:
        for k in range(2):
            x.start_stage(k)
        y._spawn("ystage1", ["stage", "--model", path, "--pp-rank", "1", "--pp-size", "2", "--port",
                             str(y.stage_ports[1]), "--speculative-algorithm", "mtp", "--num-threads", "1"])
        crossed = f"127.0.0.1:{x.stage_ports[0]},127.0.0.1:{y.stage_ports[1]}"
        code, err = _router_exit(x, crossed)
        assert code == 2 and "relays to another process than stage 1" in err, err
        x.start_router()
        x.wait_healthy(120)
        assert complete(x.url, prompts[:2], max_tokens=16)
        x.kill("stage1")
        x.procs.pop("stage1").wait(10)
        x.steps = 1
        x.start_stage(1)
        wait_health(x.url, 503, "num_speculative_steps is 1, was 3")
        r = httpx.post(x.url + "/v1/completions", json=dict(prompt=prompts[0], max_tokens=4), timeout=30)
        assert r.status_code == 503, r.text
        x.kill("stage1")
        x.procs.pop("stage1").wait(10)
        # the middle stage of a 3-stage pipeline on stage 1's port: stage 0 stops serving
        x._spawn("stage1", ["stage", "--model", path, "--pp-rank", "1", "--pp-size", "3", "--port",
                            str(x.stage_ports[1]), "--next-stage", f"127.0.0.1:{free_port()}",
                            "--speculative-algorithm", "mtp", "--num-threads", "1"])
        wait_health(x.url, 503, f"stage 0 (127.0.0.1:{x.stage_ports[0]}) is not serving: --next-stage "
                                f"127.0.0.1:{x.stage_ports[1]} is stage 1 of 3", timeout=90)
        x.kill("stage1")
        x.procs.pop("stage1").wait(10)
        x.steps = 3
        x.start_stage(1)
        wait_health(x.url, 200, timeout=90)  # resumed with the stage as it was
        # the restarted stage owned no router: the router claims it again, so it fences too
        deadline = time.monotonic() + 15
        while True:
            owners = [i.owner_router_id for i in x.stage_infos()]
            if owners[0] and len(set(owners)) == 1:
                break
            assert time.monotonic() < deadline, owners
            time.sleep(0.3)
        outs = complete(x.url, prompts[:4], max_tokens=32)
    finally:
        x.stop()
    real, _ = divergences(outs, ref[:4], gaps[:4])
    assert not real, real


def test_a_stage_paused_briefly_keeps_its_data_plane_and_the_requests_in_flight(random_ref, tmp_path):
    """Stage 1 paused (SIGSTOP) while a step waits on it, long enough for stage 0's wiring
    check to find it not answering, then resumed: the same process, whose mappings of stage
    0's shared-memory slots are alive and which still has to read the step in flight. Stage
    0 used to take it for a new process and attach again, replacing the slots under that
    step: every request in flight ended with a 500 ("hidden_ref: slot 0 does not hold the
    step's tensor", or "cannot open slot 1"). Within the router's stall timeout the requests
    now go on and give the tokens they give undisturbed; a restarted stage 1 (a new
    process) is still attached again."""
    import grpc

    from ppspec.proto.stubs import pb, pb_grpc

    path, prompts, _, _ = random_ref
    with Cluster(path, 2, "mtp", log_dir=str(tmp_path), data_plane="shm",
                 router_args=["--stall-timeout", "300", "--wedge-timeout", "300"]) as c:
        ref = complete(c.url, prompts[:4], max_tokens=400)
        stage0 = pb_grpc.StageStub(grpc.insecure_channel(f"127.0.0.1:{c.stage_ports[0]}"))

        def not_serving():
            return stage0.Info(pb.InfoRequest(), timeout=10).not_serving

        def in_flight():
            m = httpx.get(c.url + "/metrics", timeout=10).text
            return float(next(ln.split()[-1] for ln in m.splitlines() if ln.startswith("ppspec:micro_batches_in_flight ")))

        assert "data plane: shm" in httpx.get(c.url + "/health", timeout=10).text
        results = []
        worker = threading.Thread(target=lambda: results.append(asyncio.run(_outcomes(c.url, prompts[:4], 400))))
        worker.start()
        deadline = time.monotonic() + 120
        while not any(i.rows_in_use for i in c.stage_infos()):
            assert time.monotonic() < deadline and worker.is_alive(), "the requests never ran"
            time.sleep(0.05)
        c.kill("stage1", signal.SIGSTOP)
        try:
            assert in_flight() > 0  # a step waits on the paused stage (the requests have 400 tokens to go)
            while "does not answer" not in not_serving():
                assert time.monotonic() < deadline, "stage 0 never found stage 1 not answering"
                time.sleep(0.1)
        finally:
            c.kill("stage1", signal.SIGCONT)
        while not_serving():
            assert time.monotonic() < deadline, "stage 0 never served again"
            time.sleep(0.1)
        worker.join(300)
        assert results and [code for code, _ in results[0]] == [200] * 4, results
        assert [ids for _, ids in results[0]] == ref
        assert "does not answer" in open(tmp_path / "stage0.log").read()
        assert "answers again (the same process: its data plane kept)" in open(tmp_path / "stage0.log").read()
        assert all(i.rows_in_use == 0 for i in c.wait_rows_free())


async def _outcomes(url, prompts, max_tokens):
    """(status, token ids or the error text) of each prompt's greedy completion."""
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(p):
            r = await client.post(url + "/v1/completions", json=dict(
                prompt=p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_token_ids=True))
            return r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text
        return await asyncio.gather(*(one(p) for p in prompts))


def test_wedged_stage_turns_health_503(random_ref, tmp_path):
    path, prompts, _, _ = random_ref
    with Cluster(path, 2, "none", log_dir=str(tmp_path), router_args=["--wedge-timeout", "3"]) as c:
        c.kill("stage1", signal.SIGSTOP)
        try:
            fut = subprocess.Popen([sys.executable, "-c", (
                "import httpx,sys; httpx.post(sys.argv[1] + '/v1/completions', json=dict(prompt=[3,4,5], "
                "max_tokens=4), timeout=60)"), c.url])
            deadline = time.monotonic() + 15
            while httpx.get(c.url + "/health", timeout=5).status_code != 503:
                assert time.monotonic() < deadline, "health stayed 200 while the pipeline was wedged"
                time.sleep(0.3)
        finally:
            c.kill("stage1", signal.SIGCONT)
        fut.wait(60)


def _wait_serving(serve, port, timeout=240.0):
    """Poll ``ppspec serve``'s /health until 200; AssertionError if serve exits first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert serve.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)


def test_serve_exits_nonzero_when_a_child_dies(random_ref):
    path = random_ref[0]
    ports = [free_port(), free_port()]
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "ppspec.cli", "serve", "--model", path, "--pp-size", "2",
                              "--stage-ports", ",".join(map(str, ports)), "--port", str(port), "--num-threads", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_serving(serve, port)
        pid = int(subprocess.check_output(["pgrep", "-f", f"ppspec.cli stage .*port {ports[1]}"]).split()[0])
        os.kill(pid, signal.SIGKILL)
        assert serve.wait(60) == 1
        out = serve.stdout.read()
        assert "stage 1 exited unexpectedly" in out
        assert subprocess.run(["pgrep", "-f", f"ppspec.cli stage .*port {ports[0]}"], capture_output=True).returncode == 1
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)


def test_serve_sigterm_ends_open_requests_with_a_message(random_ref):
    """SIGTERM to ``ppspec serve``: the router ends in-flight requests itself (503 body; a
    stream gets the error event and [DONE]) before the stages stop, and serve exits 0,
    removing the pipeline key it made for its children (a 0600 file they all name)."""
    path = random_ref[0]
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "ppspec.cli", "serve", "--model", path, "--pp-size", "2",
                              "--port", str(port), "--num-threads", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_serving(serve, port)
        kids = subprocess.check_output(["pgrep", "-a", "-P", str(serve.pid)], text=True).splitlines()
        keys = {line.split("--pipeline-key-file ")[1].split()[0] for line in kids}
        assert len(kids) == 3 and len(keys) == 1, kids
        key_file = keys.pop()
        assert os.stat(key_file).st_mode & 0o777 == 0o600

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as client:
                body = dict(prompt=[5, 6, 7], max_tokens=2000, temperature=0.0, ignore_eos=True)

                async def stream():
                    lines = []
                    async with client.stream("POST", url + "/v1/completions", json=dict(body, stream=True)) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                lines.append(line[6:])
                    return lines

                tasks = [asyncio.ensure_future(stream()),
                         asyncio.ensure_future(client.post(url + "/v1/completions", json=body))]
                await asyncio.sleep(3.0)
                os.kill(serve.pid, signal.SIGTERM)
                return await asyncio.gather(*tasks)

        lines, plain = asyncio.run(scenario())
        assert len(lines) >= 2 and lines[-1] == "[DONE]" and "shutting down" in lines[-2], (lines[-3:], plain.text)
        assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
        assert serve.wait(30) == 0
        assert not os.path.exists(key_file)
        # every serving process froze its startup heap before it served (ppspec.heap)
        out = serve.stdout.read()
        heaps = re.findall(r"startup heap frozen \((\d+) objects(?:\)|( here, (\d+) in the engine process))", out)
        counts = [int(n) for h in heaps for n in (h[0], h[2]) if n]
        assert len(heaps) == 3 and len(counts) == 4 and min(counts) > 10000, out
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)



@pytest.mark.parametrize("sig", ["SIGKILL", "SIGHUP"])
def test_serve_children_do_not_outlive_it(random_ref, sig):
    """``ppspec serve`` killed outright (no handler of its runs) or hung up on: its stages
    and router stop too, and the port is free again for a supervisor's restart."""
    path = random_ref[0]
    ports = [free_port(), free_port()]
    port = free_port()
    # a hang-up reaches serve as from a terminal: SIGHUP at its default disposition, not
    # the ignored one a test run under nohup would hand down (serve keeps an ignored SIGHUP)
    serve = subprocess.Popen([sys.executable, "-m", "ppspec.cli", "serve", "--model", path, "--pp-size", "2",
                              "--stage-ports", ",".join(map(str, ports)), "--port", str(port), "--num-threads", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    pattern = f"ppspec.cli (stage|router) .*--port ({ports[0]}|{ports[1]}|{port})( |$)"
    try:
        _wait_serving(serve, port)
        children = subprocess.check_output(["pgrep", "-f", pattern], text=True).split()
        assert len(children) == 4, children  # two stages, the router and its engine process
        os.kill(serve.pid, getattr(signal, sig))
        rc = serve.wait(60)
        if sig == "SIGHUP":
            assert rc == 0, rc  # handled: the orderly stop, not the default action's death
        deadline = time.monotonic() + 30
        while subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "children still running: " + subprocess.check_output(
                ["pgrep", "-af", pattern], text=True)
            time.sleep(0.25)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds (TIME_WAIT is no owner)
            s.bind(("127.0.0.1", port))  # free again
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", pattern])
