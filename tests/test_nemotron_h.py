"""The Mamba2 hybrids (the Mamba2 layer family, ``stage_server/layers/mamba2.py``, in the
NemotronH, Granite 4.0 hybrid, Bamba and Falcon-H1 model families) against Hugging Face
transformers on the
same random checkpoints (written by transformers itself; fp32, CPU):
logits of prefill, decode and verify under both commit designs, layer-range slices, greedy
generation against ``generate``, and a checkpoint setting we do not serve.

transformers' Mamba2 mixer clamps ``dt`` to ``time_step_limit`` in its chunked scan
(prompts, and several tokens fed at once) and not in its one-token update; a verify of D
tokens is D decode steps (the tokens PP1 without speculation emits), so its reference is
transformers fed one token at a time.
"""
import json
import shutil

import pytest
import torch

from ppspec.proto.messages import StepInput
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.config import CheckpointError, load_config
from ppspec.stage_server.loader import load_stage_model
from ppspec.stage_server.runner import StageRunner, split_layers

KINDS = ["nemotron_h_a", "nemotron_h_b", "nemotron_h_latent", "granite_a", "granite_b", "bamba_a", "bamba_b",
         "falcon_h1_a", "falcon_h1_b"]
TOL = 1e-4


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_reference(model, ids, n_prompt, n_steps):
    """Logits at every position of ``ids`` as transformers computes them in generation:
    the first ``n_prompt`` tokens in one forward, the next ``n_steps`` one at a time, the
    rest in one forward continuing from the cache (the chunked scan from its state)."""
    def fwd(start, toks, cache=None):
        # positions given: BambaModel counts them from 0 on every call without them
        pos = torch.arange(start, start + len(toks))[None]
        return model(torch.tensor([toks]), position_ids=pos, cache=cache, use_cache=True)

    out = fwd(0, ids[:n_prompt])
    logits, cache = [out.logits[0]], out.cache
    for i in range(n_prompt, min(n_prompt + n_steps, len(ids))):
        out = fwd(i, ids[i:i + 1], cache)
        logits.append(out.logits[0])
        cache = out.cache
    rest = ids[n_prompt + n_steps:]
    if rest:
        logits.append(fwd(n_prompt + n_steps, rest, cache).logits[0])
    return torch.cat(logits)


def run(runners, inp):
    """Chain the slices: each runner's hidden states feed the next; logits from the last."""
    h = None
    for r in runners:
        inp.hidden_states = h
        meta, h = r.forward_hidden(inp)
    return runners[-1].model.logits(h)


def close(got, ref):
    return (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("design", ["copy", "replay"])
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_decode_verify_logits_match_transformers(make_ckpt, kind, design):
    path = make_ckpt(kind)
    hf = hf_model(path)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 256, (48,), generator=g).tolist()
    b = torch.randint(0, 256, (30,), generator=g).tolist()
    # a: prompt 34 tokens, 6 verified / decoded, then a prefill chunk of 8; b: 19, 6, 5
    ref_a, ref_b = hf_reference(hf, a, 34, 6), hf_reference(hf, b, 19, 6)
    assert ref_a.abs().max() > 0.5, "logits too small for a meaningful comparison"
    r = [StageRunner(path, max_rows=8, num_speculative_steps=3, commit_design=design)]
    D = 4
    # chunked prefill of both at rows 5 and 2 (not batch positions)
    got = run(r, StepInput(0, 0, "prefill", [5, 2], [0, 0], [24, 10], a[:24] + b[:10]))
    assert close(got[:24], ref_a[:24]) and close(got[24:], ref_b[:10])
    got = run(r, StepInput(0, 1, "prefill", [5, 2], [24, 10], [10, 9], a[24:34] + b[10:19]))
    assert close(got[:10], ref_a[24:34]) and close(got[10:], ref_b[10:19])
    # verify D tokens each, commit different accept lengths
    got = run(r, StepInput(0, 2, "verify", [5, 2], [34, 19], [D, D], a[34:38] + b[19:23], num_drafts=[3, 3]))
    assert close(got[:D], ref_a[34:38]) and close(got[D:], ref_b[19:23])
    r[0].commit_accept(0, 2, [5, 2], [3, 1])
    # a holds 37 tokens, b 20: decode continues from the committed state
    got = run(r, StepInput(0, 3, "decode", [5, 2], [37, 20], [1, 1], [a[37], b[20]]))
    assert close(got[0], ref_a[37]) and close(got[1], ref_b[20])
    got = run(r, StepInput(0, 4, "verify", [5, 2], [38, 21], [D, D], a[38:40] + [0, 0] + b[21:25], num_drafts=[1, 3]))
    assert close(got[:2], ref_a[38:40]) and close(got[D:], ref_b[21:25])
    r[0].commit_accept(0, 4, [5, 2], [2, 4])
    # a prefill chunk continuing each row after the commit (replay: its pending steps first)
    got = run(r, StepInput(0, 5, "prefill", [5, 2], [40, 25], [8, 5], a[40:48] + b[25:30]))
    assert close(got[:8], ref_a[40:48]) and close(got[8:], ref_b[25:30])


@pytest.mark.parametrize("kind,n", [("nemotron_h_b", 7), ("granite_b", 5), ("bamba_a", 5), ("falcon_h1_a", 5)])
def test_layer_slices_chain_to_the_whole_model(make_ckpt, kind, n):
    """7 and 5 layers over PP 2 to 4 (uneven splits): each slice holds only its layers and
    pools (Falcon-H1: every layer both), and the chained slices give the whole model's logits."""
    path = make_ckpt(kind)
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = run([StageRunner(path, max_rows=2)], StepInput(0, 0, "prefill", [0], [0], [30], ids))
    for pp in (2, 3, 4):
        runners = [StageRunner(path, k, pp, max_rows=2) for k in range(pp)]
        assert [(r.model.start, r.model.end) for r in runners] == split_layers(n, pp)
        assert not hasattr(runners[-1].model, "embed_tokens") and not hasattr(runners[0].model, "lm_head")
        for r in runners:  # a stage without Mamba2 blocks holds no state pool, one without attention no KV
            assert (r.state is not None) == bool(r.model.state_layers)
            assert (r.kv is not None) == bool(r.model.kv_layers)
        sliced = run(runners, StepInput(0, 0, "prefill", [1], [0], [30], ids))
        assert (sliced - whole).abs().max() < 1e-5


@pytest.mark.parametrize("kind,spec", [("nemotron_h_a", "none"), ("nemotron_h_b", "ngram"), ("granite_a", "ngram"),
                                       ("granite_b", "none"), ("bamba_a", "ngram"), ("bamba_b", "none"),
                                       ("falcon_h1_a", "none"), ("falcon_h1_b", "ngram")])
def test_greedy_generation_equals_transformers_generate(make_ckpt, kind, spec):
    path = make_ckpt(kind)
    prompt = [5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 9, 31] * 2
    with torch.no_grad():
        ref = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(path, max_rows=4, speculative_algorithm=spec, num_speculative_steps=3)
    # min_tokens: EOS masked for all 64 tokens, as generate's min_new_tokens masks it
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64))[0].token_ids
    assert out == ref


def _edit(src, dst, fn):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("kind,edit,field", [
    ("nemotron_h_a", lambda c: c.update(mlp_hidden_act="silu"), "mlp_hidden_act"),
    ("nemotron_h_a", lambda c: c.update(mamba_ssm_cache_dtype="float16"), "mamba_ssm_cache_dtype"),
    ("nemotron_h_a", lambda c: (c.pop("layers_block_type"), c.update(hybrid_override_pattern="M*X-")),
     "hybrid_override_pattern"),
    ("nemotron_h_a", lambda c: c.update(layers_block_type=["linear_attention", "sliding_attention"]),
     "layers_block_type"),
    ("nemotron_h_a", lambda c: c.update(n_groups=3), "n_groups"),
    ("nemotron_h_a", lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("nemotron_h_a", lambda c: c.update(ssm_state_size=32), "mixer.in_proj.weight"),
    ("granite_a", lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    ("granite_a", lambda c: c.update(time_step_limit=[0.5, 0.1]), "time_step_limit"),
    ("granite_a", lambda c: c.update(mamba_d_head=8), "mamba_d_head"),
    ("granite_a", lambda c: c.update(layer_types=["mamba", "cross_attention", "mamba", "mamba"]), "layer_types"),
    ("granite_a", lambda c: c.update(position_embedding_type="alibi"), "position_embedding_type"),
    ("granite_a", lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("granite_a", lambda c: c.update(mamba_d_state=8), "mamba.in_proj.weight"),
    ("bamba_a", lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("bamba_a", lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    ("bamba_a", lambda c: c.update(attn_layer_indices=[1, 5]), "attn_layer_indices"),
    ("bamba_a", lambda c: c.update(mamba_n_groups=3), "mamba_n_groups"),
    ("bamba_a", lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
    ("bamba_a", lambda c: c.update(mamba_d_state=8), "mamba.in_proj.weight"),
    ("falcon_h1_a", lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    ("falcon_h1_a", lambda c: c.update(ssm_multipliers=[1.0, 2.0]), "ssm_multipliers"),
    ("falcon_h1_a", lambda c: c.update(mlp_multipliers="2"), "mlp_multipliers"),
    ("falcon_h1_a", lambda c: c.update(mamba_d_ssm=60), "mamba_d_ssm"),
    ("falcon_h1_a", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("falcon_h1_a", lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("falcon_h1_b", lambda c: c.update(projectors_bias=False, mamba_rms_norm=True), "mamba.norm.weight"),
])
def test_a_setting_we_do_not_serve_names_the_file_and_field(make_ckpt, tmp_path, kind, edit, field):
    path = _edit(__import__("pathlib").Path(make_ckpt(kind)), tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        load_stage_model(str(path))
    msg = str(e.value)
    # a config field names config.json, a tensor of the wrong shape its file, a missing one
    # the checkpoint's folder; and the field or tensor
    assert field in msg and any(where in msg for where in ("config.json", "model.safetensors", f"{path}: tensor")), msg
    assert load_config(make_ckpt("nemotron_h_a")).layer_types[:2] == ["linear_attention", "full_attention"]


# ---------------------------------------------------------------- speculation and the commit
# the drivers of the GDN invariance suite, on this family's checkpoint
from test_spec_invariance import Oracle, check_design, drive, record_rounds, spy_replay_commits  # noqa: E402
from ppspec.stage_server.runner import FAULTS  # noqa: E402

N_REQ = 8


def small_workload(seed=0):
    import random

    rnd = random.Random(seed)
    reqs = []
    for i in range(N_REQ):
        n = rnd.choice([3, 9, 17, 40, 70])
        prompt = [rnd.randrange(256) for _ in range(n)]
        if i % 3 == 0:  # repetitive prompts give the n-gram drafter something to find
            prompt = (prompt[:5] * 20)[:n]
        reqs.append(dict(prompt=prompt, max_tokens=rnd.randint(10, 24), join_step=rnd.randint(0, 8)))
    return reqs


@pytest.fixture(scope="module")
def spec_setup(make_ckpt):
    torch.set_num_threads(1)
    path = make_ckpt("nemotron_h_a")
    reqs = small_workload()
    return path, reqs, drive(LLM(path, max_rows=N_REQ), reqs)


@pytest.mark.parametrize("design", ["copy", "replay"])
@pytest.mark.parametrize("spec,pp,lanes", [("oracle", 1, 1), ("ngram", 2, 2), ("oracle", 3, 2), ("oracle", 4, 3)])
def test_speculation_matches_pp1_without_speculation(spec_setup, spec, pp, lanes, design):
    """Greedy tokens of PP 1 to 4 with n-gram or oracle drafts (every accept length 1..D,
    requests joining and leaving, micro-batches in flight) equal PP1 without speculation."""
    path, reqs, ref = spec_setup
    kw = dict(drafter=Oracle(ref, seed=pp)) if spec == "oracle" else {}
    llm = LLM(path, pp_size=pp, num_micro_batches=lanes, max_rows=N_REQ, speculative_algorithm="ngram",
              num_speculative_steps=3, commit_design=design, **kw)
    check_design(llm, design)
    rounds = record_rounds(llm)
    committed = spy_replay_commits(llm)
    assert drive(llm, reqs) == ref
    accepts = {a for m, _, _, acc in rounds if m == "verify" for a in acc}
    assert accepts == ({1, 2, 3, 4} if spec == "oracle" else accepts) and accepts, "nothing was verified"
    if design == "replay":
        assert committed[0] > 0, "no replay commit recorded accepted steps"
    assert all(u == 0 for u in llm.rows_in_use())


@pytest.fixture(scope="module")
def hybrid_refs(make_ckpt):
    """kind -> (checkpoint, workload, PP1 tokens without speculation), made once per kind."""
    refs = {}

    def get(kind):
        if kind not in refs:
            torch.set_num_threads(1)
            path, reqs = make_ckpt(kind), small_workload(seed=2)
            refs[kind] = path, reqs, drive(LLM(path, max_rows=N_REQ), reqs)
        return refs[kind]
    return get


@pytest.mark.parametrize("design", ["copy", "replay"])
@pytest.mark.parametrize("pp,lanes", [(1, 1), (2, 2), (3, 2), (4, 3)])
@pytest.mark.parametrize("kind", ["granite_a", "bamba_a", "falcon_h1_a"])
def test_hybrid_speculation_matches_pp1_without_speculation(hybrid_refs, kind, pp, lanes, design):
    """Granite 4.0 hybrid (RoPE attention, MoE, multipliers, clamped dt), Bamba (Mamba2 and
    attention layers in a pattern) and Falcon-H1 (both in every layer) at PP 1 to 4 with
    oracle drafts: every accept length, requests joining and leaving, tokens equal PP1
    without speculation, every row free afterwards."""
    path, reqs, ref = hybrid_refs(kind)
    llm = LLM(path, pp_size=pp, num_micro_batches=lanes, max_rows=N_REQ, speculative_algorithm="ngram",
              num_speculative_steps=3, drafter=Oracle(ref, seed=pp), commit_design=design)
    check_design(llm, design)
    rounds = record_rounds(llm)
    committed = spy_replay_commits(llm)
    assert drive(llm, reqs) == ref
    assert {a for m, _, _, acc in rounds if m == "verify" for a in acc} == {1, 2, 3, 4}
    if design == "replay":
        assert committed[0] > 0, "no replay commit recorded accepted steps"
    assert all(u == 0 for u in llm.rows_in_use())


@pytest.mark.parametrize("design", ["copy", "replay"])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("kind", ["granite_a", "bamba_a", "falcon_h1_a"])
def test_hybrids_catch_the_commit_bugs(hybrid_refs, kind, fault, design):
    """The three commit faults on a non-last stage change the tokens (docs/DESIGN.md, "The failure")."""
    path, reqs, ref = hybrid_refs(kind)
    llm = LLM(path, pp_size=2, num_micro_batches=2, max_rows=N_REQ, speculative_algorithm="ngram",
              num_speculative_steps=3, drafter=Oracle(ref, seed=3), fault=fault, commit_design=design)
    assert sum(o != r for o, r in zip(drive(llm, reqs), ref)) > 0, f"fault {fault} went unnoticed"


@pytest.mark.parametrize("design", ["copy", "replay"])
@pytest.mark.parametrize("fault", FAULTS)
def test_invariance_catches_the_commit_bugs(spec_setup, fault, design):
    """A non-last stage that skips its commit, commits positional rows, or commits another
    micro-batch's rows changes the tokens, as on GDN (docs/DESIGN.md, "The failure")."""
    path, reqs, ref = spec_setup
    llm = LLM(path, pp_size=2, num_micro_batches=2, max_rows=N_REQ, speculative_algorithm="ngram",
              num_speculative_steps=3, drafter=Oracle(ref, seed=3), fault=fault, commit_design=design)
    out = drive(llm, reqs)
    assert sum(o != r for o, r in zip(out, ref)) > 0, f"fault {fault} went unnoticed"


# ---------------------------------------------------------------- real processes
@pytest.mark.slow
@pytest.mark.parametrize("kind,pp,design", [("nemotron_h_a", 2, "copy"), ("nemotron_h_a", 3, "replay"),
                                            ("nemotron_h_a", 4, "copy"), ("falcon_h1_a", 2, "replay"),
                                            ("falcon_h1_a", 3, "copy"), ("falcon_h1_a", 4, "replay"),
                                            ("granite_a", 2, "replay"), ("granite_a", 3, "copy"),
                                            ("granite_a", 4, "replay"), ("bamba_a", 2, "copy"),
                                            ("bamba_a", 3, "replay"), ("bamba_a", 4, "copy")])
def test_stage_processes_with_ngram_match_pp1_without_speculation(spec_setup, hybrid_refs, kind, pp, design,
                                                                  tmp_path):
    """PP 2 to 4 stage processes and a router (tests/cluster.py), n-gram drafts, the
    requests sent at once to stages of half as many rows, so that the later ones join as
    the first leave, finishing at different lengths: every completion equals PP1
    without speculation in one process, and every row is free afterwards (NemotronH, Granite
    4.0 hybrid with MoE, Bamba; and Falcon-H1, whose every layer holds both a Mamba2 state
    and KV)."""
    import asyncio

    from cluster import Cluster

    path, reqs, ref = spec_setup if kind == "nemotron_h_a" else hybrid_refs(kind)
    # half the rows: the later requests wait, then join the running batch on the rows that
    # finished requests leave (a reused row's state and conv window start afresh)
    with Cluster(path, pp, "ngram", log_dir=str(tmp_path), commit_design=design, max_rows=N_REQ // 2) as c:
        outs = asyncio.run(_complete_all(c.url, reqs))
        infos = c.wait_rows_free()
    assert outs == ref
    assert all(i.rows_in_use == 0 for i in infos) and all(i.kv_pages_used == 0 for i in infos)


async def _complete_all(url, reqs):
    """Every request of ``reqs`` sent at once (greedy, EOS ignored); their token ids."""
    import asyncio

    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(q):
            r = await client.post(url + "/v1/completions", json=dict(
                prompt=q["prompt"], max_tokens=q["max_tokens"], temperature=0.0, ignore_eos=True,
                return_token_ids=True))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        return await asyncio.gather(*(one(q) for q in reqs))


@pytest.mark.slow
@pytest.mark.parametrize("kind,fault,design", [("nemotron_h_a", "skip_commit", "replay"),
                                               ("granite_a", "positional_scratch", "copy"),
                                               ("bamba_a", "stale_rows", "replay"),
                                               ("falcon_h1_a", "skip_commit", "copy")])
def test_stage_processes_catch_the_commit_bugs(spec_setup, hybrid_refs, kind, fault, design, tmp_path):
    """Over real PP3 stage processes with n-gram drafts, as the GDN suite's
    (tests/test_pipeline.py): a non-last stage's faulty commit changes the tokens of the
    same requests that the test above finds equal to PP1 without speculation at PP3 under
    the same commit design."""
    import asyncio

    from cluster import Cluster

    path, reqs, ref = spec_setup if kind == "nemotron_h_a" else hybrid_refs(kind)
    with Cluster(path, 3, "ngram", log_dir=str(tmp_path), commit_design=design, max_rows=N_REQ, fault=fault) as c:
        outs = asyncio.run(_complete_all(c.url, reqs))
    assert sum(o != r for o, r in zip(outs, ref)) > 0, f"fault {fault} went unnoticed"


@pytest.mark.parametrize("design", ["copy", "replay"])
@pytest.mark.parametrize("kind", ["nemotron_h_a", "falcon_h1_a"])
def test_prefix_cache_snapshots_mamba2_state(make_ckpt, kind, design):
    """The prefix cache (Mamba2 state and conv windows snapshotted mid-prompt and at the
    end of a turn, after the last verify's commit; replay design: the pending steps flushed
    first) at PP2 with n-gram drafts: multi-turn replies equal PP1 without speculation or
    cache, prompts hit the cache, and nothing is held afterwards. NemotronH, and Falcon-H1,
    whose every layer's snapshot holds both its Mamba2 state and its KV pages."""
    from test_prefix_cache import CHUNK, assert_all_free, conversations, multi_turn

    path = make_ckpt(kind)
    ref = multi_turn(LLM(path, chunk_size=CHUNK), conversations())[0]
    llm = LLM(path, pp_size=2, speculative_algorithm="ngram", chunk_size=CHUNK, enable_prefix_caching=True,
              commit_design=design)
    replies, cached = multi_turn(llm, conversations())
    assert replies == ref
    # the last conversation waits for the snapshot where the third leaves the system prompt
    # (test_prefix_cache.test_multi_turn_with_cache_matches_pp1_without)
    assert cached[0] == [0, 32, 32, 44] and all(c > 0 for c in cached[1])
    assert_all_free(llm)


def test_gpu_bench_nemotron_checkpoint_and_step_bytes(tmp_path):
    """gpu_bench's random NemotronH checkpoint (here at toy size) loads, its decode and
    verify round run, and a decode step's bytes count the embedding out, the attention
    blocks' KV and the Mamba2 states [H, P, N] read and written."""
    from ppspec.bench.gpu_bench import decode_and_verify, make_random_nemotron_checkpoint, step_bytes

    path = str(tmp_path / "nemotron")
    shape = dict(vocab_size=8192, hidden_size=64, hybrid_override_pattern="M-M*", intermediate_size=96,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
                 n_groups=2, ssm_state_size=8, max_position_embeddings=512)
    n = make_random_nemotron_checkpoint(torch, path, "cpu", **shape)
    dec, ver, ratios, r = decode_and_verify(torch, path, 1, 16, repeats=2, n=1, device="cpu", dtype=torch.float32)
    assert n > 0 and dec > 0 and ver > 0 and len(ratios) == 2
    w, kv, st = step_bytes(r, 1, 16)
    assert kv == 1 * 16 * 2 * 2 * 16 * 2  # one attention block x 16 tokens x K and V of 2 heads of 16, 2 bytes
    assert w == sum(p.numel() * 4 for name, p in r.model.named_parameters() if not name.startswith("embeddings."))
    assert st == 2 * 2 * 4 * 4 * 16 * 8  # 2 Mamba2 blocks, read and written, fp32 [4, 16, 8]


def test_gpu_bench_falcon_h1_checkpoint_and_step_bytes(tmp_path):
    """gpu_bench's random Falcon-H1 checkpoint (toy size) loads and runs a decode and a
    verify round; a decode step's bytes count every layer twice over: its KV and its Mamba2
    state [H, P, N] read and written."""
    from ppspec.bench.gpu_bench import decode_and_verify, make_random_falcon_h1_checkpoint, step_bytes

    path = str(tmp_path / "falcon_h1")
    shape = dict(vocab_size=8192, hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64,
                 mamba_n_groups=2, mamba_d_state=8, max_position_embeddings=512)
    n = make_random_falcon_h1_checkpoint(torch, path, "cpu", **shape)
    dec, ver, ratios, r = decode_and_verify(torch, path, 1, 16, repeats=2, n=1, device="cpu", dtype=torch.float32)
    assert n > 0 and dec > 0 and ver > 0 and len(ratios) == 2
    w, kv, st = step_bytes(r, 1, 16)
    assert kv == 3 * 16 * 2 * 2 * 16 * 2  # 3 layers x 16 tokens x K and V of 2 heads of 16, 2 bytes
    assert w == sum(p.numel() * 4 for name, p in r.model.named_parameters() if not name.startswith("embed_tokens."))
    assert st == 3 * 2 * 4 * 4 * 16 * 8  # 3 Mamba2 states, read and written, fp32 [4, 16, 8]


def test_gpu_bench_granite_checkpoint_and_step_bytes(tmp_path):
    """gpu_bench's random Granite 4.0 hybrid checkpoint (toy size) loads and runs a decode
    and a verify round; a decode step's bytes count the attention layers' KV, the Mamba2
    states [H, P, N] read and written, and of the stacked experts (``input_linear`` /
    ``output_linear``) only the top-k the batch routes to."""
    from ppspec.bench.gpu_bench import decode_and_verify, make_random_granite_checkpoint, step_bytes

    path = str(tmp_path / "granite")
    shape = dict(vocab_size=8192, hidden_size=64, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
                 num_local_experts=8, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
                 mamba_d_state=8, max_position_embeddings=512)
    n = make_random_granite_checkpoint(torch, path, "cpu", **shape)
    dec, ver, ratios, r = decode_and_verify(torch, path, 1, 16, repeats=2, n=1, device="cpu", dtype=torch.float32)
    assert n > 0 and dec > 0 and ver > 0 and len(ratios) == 2
    w, kv, st = step_bytes(r, 1, 16)
    assert kv == 1 * 16 * 2 * 2 * 16 * 2  # one attention layer x 16 tokens x K and V of 2 heads of 16, 2 bytes
    params = dict(r.model.named_parameters())
    routed = sum(p.numel() * 4 for k, p in params.items() if "_linear.weight" in k and ".block_sparse_moe." in k)
    others = sum(p.numel() * 4 for k, p in params.items() if not k.startswith("embed_tokens."))
    assert routed == 3 * (8 * 64 * 64 + 8 * 64 * 32) * 4  # 8 experts of 32 (gate | up, down) in each layer
    assert w == others - routed + routed * 2 // 8  # batch 1: 2 of 8 experts
    assert st == 2 * 2 * 4 * 4 * 32 * 8  # 2 Mamba2 layers, read and written, fp32 [4, 32, 8]


def test_gpu_bench_bamba_checkpoint_and_step_bytes(tmp_path):
    """gpu_bench's random Bamba checkpoint (toy size) loads and runs a decode and a verify
    round; a decode step's bytes count the attention layers' KV and the Mamba2 states."""
    from ppspec.bench.gpu_bench import decode_and_verify, make_random_bamba_checkpoint, step_bytes

    path = str(tmp_path / "bamba")
    shape = dict(vocab_size=8192, hidden_size=64, num_hidden_layers=4, attn_layer_indices=[2],
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, mamba_n_heads=4,
                 mamba_d_head=32, mamba_n_groups=2, mamba_d_state=8, max_position_embeddings=512)
    n = make_random_bamba_checkpoint(torch, path, "cpu", **shape)
    dec, ver, ratios, r = decode_and_verify(torch, path, 1, 16, repeats=2, n=1, device="cpu", dtype=torch.float32)
    assert n > 0 and dec > 0 and ver > 0 and len(ratios) == 2
    w, kv, st = step_bytes(r, 1, 16)
    assert kv == 1 * 16 * 2 * 2 * 16 * 2  # one attention layer x 16 tokens x K and V of 2 heads of 16, 2 bytes
    assert w == sum(p.numel() * 4 for k, p in r.model.named_parameters() if not k.startswith("embed_tokens."))
    assert st == 3 * 2 * 4 * 4 * 32 * 8  # 3 Mamba2 layers, read and written, fp32 [4, 32, 8]
