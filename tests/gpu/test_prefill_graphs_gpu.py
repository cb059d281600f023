"""Long prefill chunks replayed from CUDA graphs (``PrefillGraphs``' long buckets: one
request's chunk beside a padding sequence, fla's GDN kernels with the chunk plan made in the
graph): the logits of every chunk, and of the decode after them, equal those of the eager
forward (``PPSPEC_PREFILL_GRAPH_TOKENS=0``); chunks a multiple of 64 tokens long and not
(the two graphs of a bucket), a chunk continuing a row's state, and a mixed micro-batch of
decodes and long chunks (the decode and the long-prefill graphs replayed one after the
other), and decodes or verifies beside one chunk of the beside-decode size in one mixed
graph (``MixedGraphs``); value/key head ratios 1 and 2; fp32 and bf16."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def _logits(runner, inp):
    _, h = runner.forward_hidden(inp)
    return runner.model.logits(h)


def _close(got, want, tol):
    assert got.shape == want.shape
    assert not torch.isnan(got).any()
    assert (got.float() - want.float()).abs().max().item() <= tol * max(1.0, want.float().abs().max().item())


@pytest.mark.parametrize("kind", ["qwen3_5_ratio1", "qwen3_5_ratio2_7l"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 8e-2)])
def test_long_prefill_graphs_equal_eager(make_ckpt, monkeypatch, kind, dtype, tol):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    pytest.importorskip("fla")
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server import graphs
    from ppspec.stage_server.runner import StageRunner

    path = make_ckpt(kind)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (700,), generator=g).tolist()
    other = torch.randint(0, 256, (300,), generator=g).tolist()
    common = dict(max_rows=8, kv_tokens=4096, num_speculative_steps=0, dtype=dtype, device="cuda",
                  cuda_graph_max_bs=8)
    monkeypatch.setenv("PPSPEC_FLA_DIRECT", "1")
    monkeypatch.setenv("PPSPEC_PREFILL_GRAPH_TOKENS", "1024")
    graphed = StageRunner(path, **common)
    monkeypatch.setenv("PPSPEC_PREFILL_GRAPH_TOKENS", "0")
    eager = StageRunner(path, **common)
    assert graphed.prefill_graphs.long_tokens == [192, 320, 576, 1088] and not eager.prefill_graphs.long_tokens
    assert graphed.prefill_graphs.bucket(1, 512) == (2, 576, 9)  # 8 + 1 chunks
    assert graphed.prefill_graphs.bucket(1, 130) == (2, 192, 4)  # 3 + 1 chunks
    assert graphed.prefill_graphs.bucket(2, 130) == (8, 136)  # two prompts: a batched bucket
    assert graphed.prefill_graphs.bucket(2, 580, 300) is None  # a sequence over 256: none

    replays = []
    run = graphs.PrefillGraphs.run
    monkeypatch.setattr(graphs.PrefillGraphs, "run", lambda self, *a, **k: replays.append(len(a[3])) or run(self, *a, **k))
    # the prompt in chunks of 512 (a multiple of 64) and 188 (not), then 300 tokens of another
    # request's whole prompt: its first chunk from zero state, the next from the row's
    for inp in (StepInput(0, 0, "prefill", [3], [0], [512], prompt[:512], sample=[False], next_token_ids=[prompt[512]]),
                StepInput(0, 0, "prefill", [3], [512], [188], prompt[512:])):
        _close(_logits(graphed, inp), _logits(eager, inp), tol)
    inp = StepInput(0, 0, "prefill", [5], [0], [300], other)
    _close(_logits(graphed, inp), _logits(eager, inp), tol)
    assert replays == [512, 188, 300]
    # decode of both, then a mixed micro-batch: both decode beside a new request's 200 tokens
    dec = StepInput(0, 1, "decode", [3, 5], [700, 300], [1, 1], [7, 9])
    _close(_logits(graphed, dec), _logits(eager, dec), tol)
    new = torch.randint(0, 256, (200,), generator=g).tolist()
    mixed = StepInput(0, 2, "decode", [3, 5, 0], [701, 301, 0], [1, 1, 200], [11, 13] + new, num_prefill=1)
    _close(_logits(graphed, mixed), _logits(eager, mixed), tol)
    assert replays[-1] == 200  # the mixed step's chunk took its long graph
    # two new prompts beside the decodes (300 + 280 tokens): no bucket holds both (each is
    # over a batched bucket's sequences), so each chunk replays its own long graph
    # (StageRunner._graph_runs), none of it eager
    a, b = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (300, 280))
    mixed2 = StepInput(0, 3, "decode", [3, 5, 0, 6, 7], [702, 302, 200, 0, 0], [1, 1, 1, 300, 280],
                       [15, 17, 19] + a + b, num_prefill=2)
    eager_before = graphed.forwards["eager"]
    _close(_logits(graphed, mixed2), _logits(eager, mixed2), tol)
    assert replays[-2:] == [300, 280] and graphed.forwards["eager"] == eager_before


@pytest.mark.parametrize("kind", ["qwen3_5_ratio1", "qwen3_5_ratio2_7l"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 8e-2)])
def test_batched_prefill_graphs_equal_eager(make_ckpt, monkeypatch, kind, dtype, tol):
    """Several prompts' chunks in one batched bucket (``PrefillGraphs``: each sequence at
    most 256 tokens, padding spread over padding sequences, the GDN layers in the recurrent
    kernel, positions and KV slots derived in the graph): a prefill of seven prompts from
    zero state, their next chunks from the rows' states, and decodes beside three new
    prompts (the decode graph, then the bucket) give the eager stage's logits, none of it
    eager. The eager stage takes the same recurrent GDN kernel for these lengths (its
    dispatch threshold raised): fla's chunked kernels compute in TF32 and differ from it by
    up to ~0.05 in these fp32 logits, which would hide an error of the graphs' layout."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    from ppspec.kernels import gdn
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    path = make_ckpt(kind)
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    common = dict(max_rows=16, kv_tokens=8192, num_speculative_steps=0, dtype=dtype, device="cuda")
    graphed = StageRunner(path, cuda_graph_max_bs=16, **common)
    eager = StageRunner(path, cuda_graph_max_bs=0, **common)
    monkeypatch.setattr(gdn, "SHORT_PREFILL_TOKENS", 4096)
    lens = [200, 150, 90, 30, 256, 5, 70]
    rows = [1, 2, 3, 4, 5, 6, 7]
    first = StepInput(0, 0, "prefill", rows, [0] * 7, lens, rand(sum(lens)))
    assert graphed.prefill_graphs.bucket(7, sum(lens), 256) == (8, 1032)
    _close(_logits(graphed, first), _logits(eager, first), tol)
    more = [40, 256, 3, 100, 60, 1, 17]
    nxt = StepInput(0, 1, "prefill", rows, lens, more, rand(sum(more)))
    _close(_logits(graphed, nxt), _logits(eager, nxt), tol)
    seq = [a + b for a, b in zip(lens, more)]
    new = [120, 40, 66]
    mixed = StepInput(0, 2, "decode", rows + [9, 10, 11], seq + [0, 0, 0], [1] * 7 + new, rand(7 + sum(new)),
                      num_prefill=3)
    _close(_logits(graphed, mixed), _logits(eager, mixed), tol)
    dec = StepInput(0, 3, "decode", rows + [9, 10, 11], [s + 1 for s in seq] + new, [1] * 10, rand(10))
    _close(_logits(graphed, dec), _logits(eager, dec), tol)
    assert graphed.forwards.get("eager", 0) == 0


def test_mixed_verify_with_chunks_one_graph_each_and_mtp_equals_eager(make_ckpt, monkeypatch):
    """On the last stage with MTP (fp32): a verify beside two new prompts of 130 and 90
    tokens replays the verify graph and one batched prefill graph; the sampled
    tokens and the MTP drafts equal the eager stage's, and no forward runs eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    pytest.importorskip("fla")
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    path = make_ckpt("qwen3_5_ratio2_7l")
    g = torch.Generator().manual_seed(4)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    common = dict(max_rows=8, kv_tokens=4096, num_speculative_steps=2, use_mtp=True, dtype=torch.float32,
                  device="cuda", cuda_graph_max_bs=8)
    monkeypatch.setenv("PPSPEC_FLA_DIRECT", "1")
    monkeypatch.setenv("PPSPEC_PREFILL_GRAPH_TOKENS", "1024")
    graphed = StageRunner(path, **common)
    monkeypatch.setenv("PPSPEC_PREFILL_GRAPH_TOKENS", "0")
    eager = StageRunner(path, cuda_graph_max_bs=0, **{k: v for k, v in common.items() if k != "cuda_graph_max_bs"})
    ids = rand(40) + rand(6) + rand(220)
    steps = [StepInput(0, 0, "prefill", [1, 2], [0, 0], [25, 15], ids[:40]),
             StepInput(0, 1, "verify", [1, 2, 4, 6], [25, 15, 0, 0], [3, 3, 130, 90], ids[40:],
                       num_drafts=[2, 2, 0, 0], sample=[True] * 4, next_token_ids=[-1] * 4, num_prefill=2)]
    got = {}
    for name, r in (("graphed", graphed), ("eager", eager)):
        got[name] = [(o.output_ids, o.drafts) for o in (r.step(s) for s in steps)]
    assert got["graphed"] == got["eager"]
    assert graphed.forwards.get("eager", 0) == 0


@pytest.mark.parametrize("kind", ["qwen3_5_ratio1", "qwen3_5_ratio2_7l"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 8e-2)])
def test_mixed_graph_equals_eager(make_ckpt, monkeypatch, kind, dtype, tol):
    """Decodes beside one request's long chunk in ONE graph (``graphs.MixedGraphs``, chunks
    of ``mixed_graph_tokens=512``: the 576-token bucket's two graphs): 3 decodes (bucket 4)
    beside a continuing 512-token chunk (9 fla chunks), then 5 decodes (bucket 8) beside a new
    prompt's 400 tokens (10 chunks); logits equal the eager stage's, and so do those of a
    decode of every row after (the state and KV the mixed graphs wrote). One replay per
    mixed micro-batch, nothing eager."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    pytest.importorskip("fla")
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server import graphs
    from ppspec.stage_server.runner import StageRunner

    path = make_ckpt(kind)
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    common = dict(max_rows=8, kv_tokens=8192, num_speculative_steps=0, dtype=dtype, device="cuda")
    monkeypatch.setenv("PPSPEC_FLA_DIRECT", "1")
    monkeypatch.setenv("PPSPEC_PREFILL_GRAPH_TOKENS", "1024")
    graphed = StageRunner(path, cuda_graph_max_bs=8, mixed_graph_tokens=512, **common)
    eager = StageRunner(path, cuda_graph_max_bs=0, **common)
    mg = graphed.mixed_graphs["decode"]
    assert sorted(mg.keys) == [(b, (2, 576, c)) for b in (1, 2, 4, 8) for c in (9, 10)]
    seen = []
    run = graphs.MixedGraphs.run
    monkeypatch.setattr(graphs.MixedGraphs, "run",
                        lambda self, rows, s, i, r, q, ids, *a: seen.append(self.bucket(len(rows), len(ids)))
                        or run(self, rows, s, i, r, q, ids, *a))
    heads, lens = [0, 1, 2, 3, 4], [20, 33, 7, 64, 11]
    prompt, new = rand(700), rand(400)
    first = [StepInput(0, 0, "prefill", heads, [0] * 5, lens, rand(sum(lens))),
             StepInput(0, 0, "prefill", [6], [0], [188], prompt[:188], sample=[False], next_token_ids=[prompt[188]])]
    for inp in first:
        _close(_logits(graphed, inp), _logits(eager, inp), tol)
    mixed = [StepInput(0, 1, "decode", heads[:3] + [6], lens[:3] + [188], [1, 1, 1, 512], rand(3) + prompt[188:],
                       num_prefill=1),
             StepInput(0, 2, "decode", heads + [7], [n + 1 for n in lens[:3]] + lens[3:] + [0], [1] * 5 + [400],
                       rand(5) + new, num_prefill=1)]
    before = dict(graphed.forwards)  # the first prefill (135 tokens in 5 rows) ran eagerly
    for inp in mixed:
        _close(_logits(graphed, inp), _logits(eager, inp), tol)
    assert seen == [(4, (2, 576, 9)), (8, (2, 576, 10))]
    assert graphed.forwards == {**before, "graph": before["graph"] + 2}
    dec = StepInput(0, 3, "decode", heads + [6, 7], [n + 2 for n in lens[:3]] + [n + 1 for n in lens[3:]] + [700, 400],
                    [1] * 7, rand(7))
    _close(_logits(graphed, dec), _logits(eager, dec), tol)


def test_mixed_verify_graph_with_mtp_equals_eager(make_ckpt, monkeypatch):
    """On the last stage with MTP (fp32): verifies of 3 requests beside a new prompt's
    512-token chunk replay one mixed graph; the sampled tokens and the MTP drafts (of the
    verifies and of the chunk, which ends its prompt) equal the eager stage's."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    pytest.importorskip("fla")
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    path = make_ckpt("qwen3_5_ratio2_7l")
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    common = dict(max_rows=8, kv_tokens=4096, num_speculative_steps=2, use_mtp=True, dtype=torch.float32,
                  device="cuda")
    monkeypatch.setenv("PPSPEC_FLA_DIRECT", "1")
    monkeypatch.setenv("PPSPEC_PREFILL_GRAPH_TOKENS", "1024")
    graphed = StageRunner(path, cuda_graph_max_bs=8, mixed_graph_tokens=512, **common)
    eager = StageRunner(path, cuda_graph_max_bs=0, **common)
    assert set(graphed.mixed_graphs) == {"decode", "verify"}
    steps = [StepInput(0, 0, "prefill", [1, 2, 3], [0, 0, 0], [25, 15, 9], rand(49)),
             StepInput(0, 1, "verify", [1, 2, 3, 5], [25, 15, 9, 0], [3, 3, 3, 512], rand(9 + 512),
                       num_drafts=[2, 2, 2, 0], sample=[True] * 4, next_token_ids=[-1] * 4, num_prefill=1)]
    got = {}
    for name, r in (("graphed", graphed), ("eager", eager)):
        got[name] = [(o.output_ids, o.drafts) for o in (r.step(s) for s in steps)]
    assert got["graphed"] == got["eager"]
    assert graphed.forwards == {"graph": 2}  # the first prefill (a short bucket), then one mixed replay


def _syncs(step):
    """``step()``'s result and the synchronising CUDA calls it made (``torch.cuda.set_sync_debug_mode``:
    device reads, and copies from pageable host memory, which synchronise the stream)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out, [str(w.message) for w in caught if "synchroniz" in str(w.message)]


def test_mixed_step_synchronises_once(make_ckpt, monkeypatch):
    """The step of a mixed micro-batch in one mixed graph (5 decodes beside a prompt's
    512-token chunks, fp32, the replay commit design of a CUDA stage) synchronises with the
    device once, its read of the sampled tokens: the chunk inside the prompt computes no
    logits, the prompt's last chunk samples with the decodes in the same read, and the
    host's lists go to the device without a blocking copy (tests/test_step_syncs.py counts
    the same calls on the CPU). A decode step alone synchronises once too. The tokens equal
    the eager stage's."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    pytest.importorskip("fla")
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    path = make_ckpt("qwen3_5_ratio2_7l")
    g = torch.Generator().manual_seed(4)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    common = dict(max_rows=8, kv_tokens=8192, num_speculative_steps=0, dtype=torch.float32, device="cuda")
    monkeypatch.setenv("PPSPEC_FLA_DIRECT", "1")
    monkeypatch.setenv("PPSPEC_PREFILL_GRAPH_TOKENS", "1024")
    graphed = StageRunner(path, cuda_graph_max_bs=8, mixed_graph_tokens=512, **common)
    eager = StageRunner(path, cuda_graph_max_bs=0, **common)
    heads, lens = [0, 1, 2, 3, 4], [20, 33, 7, 64, 11]
    first = StepInput(0, 0, "prefill", heads, [0] * 5, lens, rand(sum(lens)))
    for r in (graphed, eager):
        r.step(first)
    rnd = 0
    # a first prompt's two chunks (row 6) meet every kernel once (a first launch may
    # synchronise), then a second prompt's (row 7) are counted
    for row, prompt, counted in ((6, rand(1024), False), (7, rand(1024), True)):
        for seq in (0, 512):
            rnd, last = rnd + 1, seq + 512 == len(prompt)
            inp = StepInput(0, rnd, "decode", heads + [row], lens + [seq], [1] * 5 + [512],
                            rand(5) + prompt[seq:seq + 512], sample=[True] * 5 + [last],
                            next_token_ids=[-1] * 5 + [-1 if last else prompt[seq + 512]], num_prefill=1)
            before = graphed.forwards["graph"]
            out, syncs = _syncs(lambda: graphed.step(inp))
            assert graphed.forwards["graph"] == before + 1  # one mixed replay
            if counted:
                assert len(syncs) == 1, syncs
            assert out.output_ids == eager.step(inp).output_ids
            assert [bool(t) for t in out.output_ids] == [True] * 5 + [last]
            lens = [n + 1 for n in lens]
    for _ in range(2):
        rnd += 1
        dec = StepInput(0, rnd, "decode", heads, lens, [1] * 5, rand(5))
        out, syncs = _syncs(lambda: graphed.step(dec))
        assert len(syncs) == 1, syncs
        assert out.output_ids == eager.step(dec).output_ids
        lens = [n + 1 for n in lens]
