"""The CUDA IPC data plane end to end: PP2 and PP4 as stage processes sharing one GPU, the
hidden states handed from stage to stage as device buffers exported by CUDA IPC (an
interprocess event orders the receiver's copy after the sender's), fp32 greedy tokens
identical to PP1 without speculation in one process (divergence only at near-ties of the
reference, docs/DESIGN.md, "Correctness"). The same prompts over inline bytes give the same tokens.
With two GPUs, the ``dist`` data plane (NCCL between a stage per GPU, as between hosts) too."""
import asyncio
import os
import sys

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster import DEMO, Cluster  # noqa: E402

pytestmark = pytest.mark.gpu

N, MAX_TOKENS, TIE = 16, 48, 1e-4


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tok = AutoTokenizer.from_pretrained(DEMO)
    texts = ["Explain how a hash map works.", "Write a short poem about the sea.", "What is 17 times 23?",
             "Give me three tips for learning Python.", "Summarize the plot of Hamlet.", "How do vaccines work?",
             "Translate 'good morning' into French and Spanish.", "List the planets of the solar system."]
    prompts = [tok.encode(t * (1 + i % 3)) for i, t in enumerate(texts * 2)][:N]
    llm = LLM(DEMO, device="cuda", max_rows=N, cuda_graph_max_bs=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2))
    del llm
    torch.cuda.empty_cache()
    return prompts, [o.token_ids for o in outs], [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs]


async def _complete(url, prompts):
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(p):
            r = await client.post(url + "/v1/completions", json=dict(
                prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, return_token_ids=True))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize("pp,plane", [(2, "auto"), (4, "auto"), (2, "bytes")])
def test_fp32_stages_sharing_a_gpu_over_cuda_ipc_identical_to_pp1(reference, pp, plane, tmp_path):
    prompts, ref, gaps = reference
    c = Cluster(DEMO, pp, "none", max_rows=N, kv_tokens=16384, log_dir=str(tmp_path), data_plane=plane,
                stage_args=["--device", "cuda:0", "--dtype", "float32", "--memory-budget-gb", "12"], router_args=["--step-timeout", "300"])
    try:
        c.start(timeout=600)  # each stage compiles its kernels and captures its graphs before serving
        outs = asyncio.run(_complete(c.url, prompts))
        infos = c.wait_rows_free()
        want = "cuda_ipc" if plane == "auto" else "bytes"
        assert [(i.transport, i.transport_detail) for i in infos] == [(want, "")] * (pp - 1) + [("", "")]
        # the steps' control messages on the stages' sockets (proto/local.py), whatever the data plane
        assert [i.control for i in infos] == ["socket"] * (pp - 1) + [""]
        assert f"data plane: {want}; control: socket" in httpx.get(c.url + "/health", timeout=5).text
    finally:
        c.stop()
    for i, (o, r) in enumerate(zip(outs, ref)):
        if o != r:
            j = next(j for j, (a, b) in enumerate(zip(o, r)) if a != b)
            assert gaps[i][j] < TIE, f"request {i} diverges at {j} with top-2 gap {gaps[i][j]:.2e}"


def _cuda_sender(conn, shapes):
    """Child process: a cuda_ipc SlotLink on cuda:0; sends the probe, then each tensor
    (filled on the device by a kernel after a long matmul, so that an unordered read would
    see stale data), waiting for the parent's read before the slot is given back."""
    import torch

    try:
        from ppspec.stage_server import dataplane as dp
    except ImportError:  # a bare checkout: map it as tests/gpu/conftest.py does (not run in this child)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        sys.path.insert(0, root)
        import ppspec

        ppspec.__path__.append(root)
        from ppspec.stage_server import dataplane as dp

    link = dp.SlotLink("cuda_ipc", "gpuchild", "cuda:0")
    probe, nonce = dp.make_probe(link)
    conn.send((probe.ref.SerializeToString(), nonce, dp.host_id()))
    conn.recv()
    link.done(probe, answered=True)
    a = torch.randn(4096, 4096, device="cuda:0")
    for i, shape in enumerate(shapes):
        busy = a @ a  # queued work ahead of the tensor on the same stream
        t = torch.full(shape, float(i + 1), device="cuda:0") + busy[0, 0] * 0
        sent = link.put(t, i, i)
        conn.send(sent.ref.SerializeToString())
        conn.recv()
        link.done(sent, answered=True)
    conn.send((link.slots, [s.index for s in link.free]))
    conn.recv()
    link.close()


def test_cuda_ipc_hop_between_two_processes():
    """The cuda_ipc link alone, between two processes on one GPU: the probe opens, each
    tensor arrives with its value (the receiver's stream waits for the sender's event),
    a slot grows for a larger tensor, a mismatched shape is refused."""
    import multiprocessing as mp

    from ppspec.proto.stubs import pb
    from ppspec.stage_server import dataplane as dp

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    shapes = [(16, 256), (2048, 256), (8000, 2048), (1, 256)]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_cuda_sender, args=(child, shapes))
    p.start()
    try:
        rx = dp.Receiver("cuda:0")
        probe, nonce, host = parent.recv()
        req = pb.AttachRequest(sender_id="gpuchild", host_id=host, transport="cuda_ipc",
                               probe=pb.TensorRef.FromString(probe), nonce=nonce)
        reply = rx.attach(req)
        assert (reply.transport, reply.detail) == ("cuda_ipc", "")
        parent.send("ok")
        for i, shape in enumerate(shapes):
            ref = pb.TensorRef.FromString(parent.recv())
            if i == 0:
                bad = pb.TensorRef.FromString(ref.SerializeToString())
                bad.shape[0] += 1
                with pytest.raises(dp.DataPlaneError, match="shape"):
                    rx.read(bad, i, i)
            got = rx.read(ref, i, i)
            assert got.device.type == "cuda" and tuple(got.shape) == shape
            assert bool((got == float(i + 1)).all()), f"tensor {i} read before the sender's copy"
            parent.send("ok")
        slots, free = parent.recv()
        assert slots == 1 and free == [0]  # one relay at a time: one slot, grown in place
        parent.send("ok")
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


def needs_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL refuses two ranks on one GPU: the dist data plane needs two GPUs (nvidia-h200-x2)")


@pytest.mark.parametrize("plane,env", [("dist", {}), ("auto", {"PPSPEC_HOST_ID": "elsewhere/1"})])
def test_fp32_stages_on_two_gpus_over_nccl_identical_to_pp1(reference, plane, env, tmp_path):
    """PP2 with a stage per GPU and the hop on ``dist`` (NCCL payloads, gloo headers;
    stage_server/dataplane_dist.py): forced by ``--data-plane dist``, or chosen by ``auto``
    with stage 1 acting as if on another host. fp32 greedy tokens are PP1's."""
    needs_two_gpus()
    prompts, ref, gaps = reference
    c = Cluster(DEMO, 2, "none", max_rows=N, kv_tokens=16384, log_dir=str(tmp_path), data_plane=plane,
                stage_env={0: {"CUDA_VISIBLE_DEVICES": "0"}, 1: {"CUDA_VISIBLE_DEVICES": "1", **env}},
                stage_args=["--device", "cuda:0", "--dtype", "float32", "--memory-budget-gb", "12"],
                router_args=["--step-timeout", "300"])
    try:
        c.start(timeout=600)
        outs = asyncio.run(_complete(c.url, prompts))
        infos = c.wait_rows_free()
        assert [(i.transport, i.transport_detail) for i in infos] == [("dist", ""), ("", "")]
        assert "data plane: dist" in httpx.get(c.url + "/health", timeout=5).text
    finally:
        c.stop()
    for i, (o, r) in enumerate(zip(outs, ref)):
        if o != r:
            j = next(j for j, (a, b) in enumerate(zip(o, r)) if a != b)
            assert gaps[i][j] < TIE, f"request {i} diverges at {j} with top-2 gap {gaps[i][j]:.2e}"


def _nccl_sender(conn, port, shapes):
    """Child process: a dist link from cuda:1; each tensor filled by a kernel queued behind a
    long matmul (an unordered receive would see stale data), all sent before the parent
    reads any."""
    import torch

    try:
        from ppspec.stage_server import dataplane_dist as dd
    except ImportError:  # a bare checkout: map it as tests/gpu/conftest.py does
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        sys.path.insert(0, root)
        import ppspec

        ppspec.__path__.append(root)
        from ppspec.stage_server import dataplane_dist as dd

    link = dd.DistLink("ncclchild", "cuda:1", "127.0.0.1", port)
    a = torch.randn(4096, 4096, device="cuda:1")
    refs = []
    for i, shape in enumerate(shapes):
        busy = a @ a
        t = torch.full(shape, float(i + 1), device="cuda:1") + busy[0, 0] * 0
        refs.append(link.put(t, i, i).ref.SerializeToString())
    conn.send(refs)
    conn.recv()
    link.close()


def test_nccl_dist_hop_between_two_processes():
    """The dist link alone between two processes on two GPUs: tensors read in the reverse
    of their send order arrive with their values on the receiver's GPU, a mismatched shape
    is refused and the tensor stays for its step."""
    import multiprocessing as mp

    from ppspec.proto.stubs import pb
    from ppspec.stage_server import dataplane as dp

    from ppspec.stage_server import dataplane_dist as dd

    needs_two_gpus()
    shapes = [(16, 256), (2048, 256), (8000, 2048), (1, 256)]
    rx = dp.Receiver("cuda:0", dist_inbox=dd.DistInbox)
    reply = rx.attach(pb.AttachRequest(sender_id="ncclchild", host_id="elsewhere/1", transport="dist",
                                       dist_backend="nccl"))
    assert (reply.transport, reply.detail) == ("dist", "")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_nccl_sender, args=(child, reply.store_port, shapes))
    p.start()
    try:
        refs = [pb.TensorRef.FromString(r) for r in parent.recv()]
        bad = pb.TensorRef.FromString(refs[0].SerializeToString())
        bad.shape[0] += 1
        with pytest.raises(dp.DataPlaneError, match="shape"):
            rx.read(bad, 0, 0)
        for i in reversed(range(len(shapes))):
            got = rx.read(refs[i], i, i)
            assert got.device == torch.device("cuda:0") and tuple(got.shape) == shapes[i]
            assert bool((got == float(i + 1)).all()), f"tensor {i} read before it arrived"
        parent.send("ok")
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
