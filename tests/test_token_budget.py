"""The token budget per forward and mixed micro-batches (prefill chunks in the same forward
as decode and verify rows): logits against Hugging Face transformers (fp32, CPU), the
scheduler's micro-batch shapes, and the budget's refusal at start."""
import subprocess
import sys

import pytest
import torch

from ppspec.proto.messages import StepInput
from ppspec.router.scheduler import WHOLE_PROMPT_TOKENS, Scheduler
from ppspec.router.types import SamplingParams
from ppspec.stage_server.runner import StageRunner, split_layers

KINDS = ["qwen3_next_dense", "qwen3_next_moe", "qwen3_5_ratio1", "qwen3_5_ratio2_7l", "qwen3_5_moe", "qwen3_5_bias"]
TOL = 1e-4
D = 4


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def run(runners, inp):
    """Chain the slices (hidden states of one feed the next); logits of the last."""
    h = None
    for r in runners:
        inp.hidden_states = h
        _, h = r.forward_hidden(inp)
    return runners[-1].model.logits(h)


def check(got, refs):
    """``got`` ``[T, V]`` against the reference rows ``refs`` (a list of ``[n, V]``), in order."""
    want = torch.cat(refs)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= TOL, f"max abs difference {err:.3g}"


@pytest.mark.parametrize("kind,pp,design", [(k, 1, "copy") for k in KINDS] + [("qwen3_5_ratio2_7l", 2, "replay")])
def test_mixed_micro_batch_logits_match_transformers(make_ckpt, kind, pp, design):
    """Verify rows then prefill chunks (one new, one continuing past a 64-token GDN chunk)
    in one forward, a commit, then decode rows mixed with chunks: every logit row equals
    transformers' on that request's sequence."""
    from transformers import AutoModelForCausalLM

    path = make_ckpt(kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 26, 90, 21)]
    a, b, c, e = seqs
    layers = split_layers(hf.config.num_hidden_layers, pp)
    r = [StageRunner(path, k, pp, max_rows=8, num_speculative_steps=D - 1, layer_range=layers[k],
                     commit_design=design) for k in range(pp)]
    # a and b prefill whole (rows 6, 1)
    run(r, StepInput(0, 0, "prefill", [6, 1], [0, 0], [25, 20], a[:25] + b[:20]))
    # verify a and b (D tokens each) + c's first chunk (new, 70 tokens) on row 3
    got = run(r, StepInput(0, 1, "verify", [6, 1, 3], [25, 20, 0], [D, D, 70], a[25:29] + b[20:24] + c[:70],
                           num_drafts=[3, 3, 0], sample=[True, True, False], next_token_ids=[-1, -1, c[70]],
                           num_prefill=1))
    check(got, [hf_logits(hf, a[:29])[25:], hf_logits(hf, b[:24])[20:], hf_logits(hf, c[:70])])
    for s in r:  # a accepted 2 of its 4 tokens, b 4
        s.commit_accept(0, 1, [6, 1], [2, 4])
    # decode a and b (one token each; a continues from its 27th token) + c's second chunk
    # (continuing, from the state its first chunk left) + e new, row 0
    a2, b2 = a[:27] + [a[29]], b[:24] + [b[25]]
    got = run(r, StepInput(0, 2, "decode", [6, 1, 3, 0], [27, 24, 70, 0], [1, 1, 20, 21],
                           [a2[-1], b2[-1]] + c[70:] + e, num_prefill=2))
    check(got, [hf_logits(hf, a2)[-1:], hf_logits(hf, b2)[-1:], hf_logits(hf, c)[70:], hf_logits(hf, e)])


def test_mixed_step_samples_each_part_as_alone(make_ckpt):
    """The last stage's answer to a mixed verify equals those of the same verify and the
    same prefill chunk run one after the other (tokens, MTP drafts), and only the verified
    rows wait for a commit."""
    path = make_ckpt("qwen3_5_ratio2_7l")
    g = torch.Generator().manual_seed(3)
    a, c = torch.randint(0, 256, (40,), generator=g).tolist(), torch.randint(0, 256, (33,), generator=g).tolist()
    outs = []
    for mixed in (True, False):
        s = StageRunner(path, max_rows=4, num_speculative_steps=D - 1, use_mtp=True)
        s.step(StepInput(0, 0, "prefill", [2], [0], [36], a[:36]))
        ver = StepInput(0, 1, "verify", [2], [36], [D], a[36:40], num_drafts=[3])
        pre = StepInput(0, 1, "prefill", [0], [0], [33], c)
        if mixed:
            o = s.step(StepInput(0, 1, "verify", [2, 0], [36, 0], [D, 33], a[36:40] + c, num_drafts=[3, 0],
                                 sample=[True, True], next_token_ids=[-1, -1], num_prefill=1))
            outs.append((o.output_ids, o.drafts))
        else:
            o1, o2 = s.step(ver), s.step(pre)
            outs.append((o1.output_ids + o2.output_ids, o1.drafts + o2.drafts))
        assert s._verify_open.keys() == {2} and s.row_lens == {2: 36, 0: 33}  # 2: its commit adds
    assert outs[0] == outs[1]
    assert len(outs[0][0][1]) == 1 and len(outs[0][1][1]) == D - 1


def test_a_malformed_mixed_step_is_refused(make_ckpt):
    s = StageRunner(make_ckpt("qwen3_5_ratio2_7l"), max_rows=4, num_speculative_steps=D - 1)
    with pytest.raises(ValueError, match="num_prefill: 2 prefill chunks in a decode micro-batch of 2"):
        s.step(StepInput(0, 0, "decode", [0, 1], [0, 0], [1, 1], [1, 2], num_prefill=2))
    with pytest.raises(ValueError, match="num_prefill"):
        s.step(StepInput(0, 0, "prefill", [0, 1], [0, 0], [1, 1], [1, 2], num_prefill=1))
    assert not s.rows_in_use


def _drive_one_round(s, lane=0):
    """Schedule a micro-batch and answer it as a last stage would (a token per sampling row)."""
    b = s.schedule(lane)
    out = [[7] if smp else [] for smp in b.sample]
    s.process(b, out, [[] for _ in out])
    return b


def test_decodes_and_a_long_prompt_share_each_micro_batch():
    """With 8 requests decoding and a 3000-token prompt arriving, every micro-batch holds all
    8 decodes and a chunk of the prompt filling the rest of the budget."""
    s = Scheduler(max_rows=16, kv_tokens=1 << 16, max_context=8192, page_size=16, max_batch_size=16,
                  max_num_batched_tokens=1024)
    p = SamplingParams(temperature=0.0, max_tokens=500)
    for i in range(8):
        s.add(f"d{i}", [1, 2, 3], p)
    b = _drive_one_round(s)
    assert b.mode == "prefill" and len(b.requests) == 8
    s.add("long", list(range(3000)), p)
    chunks = []
    while s.requests["long"].num_computed < 3000:
        b = _drive_one_round(s)
        assert b.mode == "decode" and b.num_prefill == 1 and len(b.requests) == 9
        assert sum(b.extend_lens) <= 1024
        chunks.append(b.extend_lens[-1])
    assert chunks == [1016, 1016, 968]  # the budget less the 8 decodes, then the rest


def test_beside_decodes_a_prompt_takes_at_most_the_mixed_prefill_tokens():
    """The same arrival with ``mixed_prefill_tokens`` 300: chunks of 300 beside the decodes;
    once they finish, the rest of the prompt takes the whole budget."""
    s = Scheduler(max_rows=16, kv_tokens=1 << 16, max_context=8192, page_size=16, max_batch_size=16,
                  max_num_batched_tokens=1024, mixed_prefill_tokens=300)
    for i in range(8):
        s.add(f"d{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))
    _drive_one_round(s)
    s.add("long", list(range(3000)), SamplingParams(temperature=0.0, max_tokens=1))
    shapes = []
    while "long" in s.requests and s.requests["long"].num_computed < 3000:
        b = _drive_one_round(s)
        shapes.append((len(b.requests) - b.num_prefill if b.num_prefill else 0, b.extend_lens[-1]))
    assert shapes == [(8, 300), (8, 300), (0, 1024), (0, 1024), (0, 352)]


def test_beside_decodes_short_prompts_join_whole_in_the_rest_of_the_budget():
    """Ten prompts of 60 tokens arriving beside 8 decodes with ``mixed_prefill_tokens`` 128:
    all start whole in the next micro-batch (600 tokens, within the budget less the decodes),
    not two a round; an older 3000-token prompt beside them still takes chunks of 128, and
    the short ones fill the rest. A short prompt over what the budget leaves waits."""
    def sched():
        s = Scheduler(max_rows=32, kv_tokens=1 << 16, max_context=8192, page_size=16, max_batch_size=32,
                      max_num_batched_tokens=1024, mixed_prefill_tokens=128)
        for i in range(8):
            s.add(f"d{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50))
        _drive_one_round(s)
        return s

    s = sched()
    for i in range(10):
        s.add(f"s{i}", [5] * 60, SamplingParams(temperature=0.0, max_tokens=5))
    b = _drive_one_round(s)
    assert b.mode == "decode" and b.num_prefill == 10 and b.extend_lens == [1] * 8 + [60] * 10
    assert all(s.requests[f"s{i}"].output_ids for i in range(10))  # each sampled its first token

    s = sched()
    s.add("long", list(range(3000)), SamplingParams(temperature=0.0, max_tokens=1))
    for i in range(16):
        s.add(f"s{i}", [5] * 60, SamplingParams(temperature=0.0, max_tokens=5))
    b = _drive_one_round(s)
    # 1016 tokens after the decodes: 128 of the long prompt, then 14 whole prompts (840)
    assert b.extend_lens == [1] * 8 + [128] + [60] * 14
    b = _drive_one_round(s)
    assert b.extend_lens[-3:] == [128, 60, 60] and sum(b.extend_lens) <= 1024

    # with a cap of 512, prompts over WHOLE_PROMPT_TOKENS (the batched prefill graphs'
    # longest sequence) take chunks of the cap: 300 + 212, then the 200-token one whole
    s = Scheduler(max_rows=32, kv_tokens=1 << 16, max_context=8192, page_size=16, max_batch_size=32,
                  max_num_batched_tokens=2048, mixed_prefill_tokens=512)
    for i in range(8):
        s.add(f"d{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50))
    _drive_one_round(s)
    for i, n in enumerate([300, 300, 200]):
        s.add(f"p{i}", [5] * n, SamplingParams(temperature=0.0, max_tokens=5))
    assert WHOLE_PROMPT_TOKENS == 256
    assert _drive_one_round(s).extend_lens == [1] * 8 + [300, 212, 200]


def test_a_lone_prompt_runs_in_chunks_of_the_budget():
    s = Scheduler(max_rows=4, kv_tokens=1 << 16, max_context=1 << 14, page_size=16, max_num_batched_tokens=4096)
    s.add("r", list(range(10000)), SamplingParams(max_tokens=4))
    assert [_drive_one_round(s).extend_lens for _ in range(3)] == [[4096], [4096], [1808]]


@pytest.mark.parametrize("budget,bs,spec,msg", [
    (255, 64, "mtp", "--max-num-batched-tokens 255 is less than one verify micro-batch: --max-batch-size 64 x D 4 = 256"),
    (63, 64, "none", "--max-num-batched-tokens 63 is less than one verify micro-batch: --max-batch-size 64 x D 1 = 64"),
    (8, 4, "none", "--max-num-batched-tokens 8 is less than a KV page of 16 tokens"),
])
def test_a_budget_below_a_verify_batch_or_a_page_is_refused(budget, bs, spec, msg):
    with pytest.raises(ValueError, match=msg):
        Scheduler(max_rows=4, kv_tokens=4096, max_context=1024, page_size=16, max_batch_size=bs,
                  max_num_batched_tokens=budget, speculative_algorithm=spec)


def test_serve_refuses_a_small_budget_before_starting_anything():
    from cluster import free_port

    p = subprocess.run([sys.executable, "-m", "ppspec.cli", "serve", "--speculative-algorithm", "mtp",
                        "--max-batch-size", "32", "--max-num-batched-tokens", "100", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "--max-num-batched-tokens 100 is less than one verify micro-batch: --max-batch-size 32 x D 4 = 128" in p.stderr


def test_mixed_batches_over_real_processes_match_pp1(make_ckpt, tmp_path):
    """PP2 with MTP over gRPC with random message delays and a 64-token budget: short
    prompts verify while long ones still prefill, in the same micro-batches (num_prefill on
    the wire; only the verified rows wait for their commit). Greedy tokens equal PP1 without
    speculation, and every row comes back."""
    import asyncio

    import httpx

    from cluster import Cluster
    from ppspec.router.llm import LLM

    path = make_ckpt("qwen3_5_ratio2_7l")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in [12, 150, 20, 90, 7, 130, 33, 60]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = [c.token_ids for c in LLM(path, max_rows=8).generate(prompts, params)]

    async def complete(url):
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(p):
                r = await client.post(url + "/v1/completions", json=dict(
                    prompt=p, max_tokens=20, temperature=0.0, ignore_eos=True, return_token_ids=True))
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            return await asyncio.gather(*(one(p) for p in prompts))

    with Cluster(path, 2, "mtp", delay_ms=5, max_rows=8, log_dir=str(tmp_path),
                 router_args=["--max-num-batched-tokens", "64", "--max-batch-size", "16"]) as c:
        outs = asyncio.run(complete(c.url))
        infos = c.wait_rows_free()
    assert outs == ref
    assert all(i.rows_in_use == 0 and i.kv_pages_used == 0 and i.pending_commits == 0 for i in infos)


def test_prefill_benchmark_runs_on_the_cpu(capsys):
    """bench/prefill_ttft.py end to end at toy sizes: both tables, one mixed-load row per value."""
    from ppspec.bench.prefill_ttft import main

    assert main(["--lengths", "48", "--repeats", "1", "--decoders", "2", "--decoder-prompt", "8",
                 "--mixed-length", "96", "--max-num-batched-tokens", "64", "--mixed-prefill-tokens", "16,32"]) == 0
    out = capsys.readouterr().out
    assert "| 48 |" in out and "x |" in out
    rows = [line for line in out.splitlines() if line.startswith("| 16 |") or line.startswith("| 32 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["6", "3"]  # 96 prompt tokens in chunks of 16, of 32
