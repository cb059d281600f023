"""Kimi Linear (KDA + MLA + MoE) against Hugging Face transformers on random checkpoints that
transformers itself wrote (fp32, CPU): each decoder layer alone, the logits of prefill,
decode and verify with both commit designs, layer slices for PP, greedy generation, and
the checkpoint errors."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ppspec.proto.messages import StepInput
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.config import CheckpointError, load_config
from ppspec.stage_server.runner import StageRunner, split_layers

KINDS = ["kimi_moe_5l", "kimi_qlora_7l"]
TOL = 1e-4


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run(runners, inp):
    h = None
    for r in runners:
        inp.hidden_states = h
        _, h = r.forward_hidden(inp)
    return runners[-1].model.logits(h)


def close(got, ref):
    return (got - ref).abs().max().item() < TOL


def test_each_decoder_layer_matches_transformers(make_ckpt):
    """Layer i alone (a one-layer stage) maps transformers' hidden state i to its hidden
    state i + 1: KDA and MLA layers, dense and MoE MLPs, over a prompt longer than a chunk."""
    path = make_ckpt("kimi_moe_5l")
    hf = hf_model(path)
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    n = hf.config.num_hidden_layers
    for i in range(n - 1):  # the last entry is after the final norm
        r = StageRunner(path, max_rows=2, layer_range=(i, i + 1))
        _, h = r.forward_hidden(StepInput(0, 0, "prefill", [1], [0], [70], ids, hidden_states=hs[i][0].clone()))
        assert (h - hs[i + 1][0]).abs().max() < TOL, f"layer {i} ({hf.config.layer_types[i]})"


@pytest.mark.parametrize("kind,design", [("kimi_moe_5l", "copy"), ("kimi_qlora_7l", "copy"), ("kimi_moe_5l", "replay"),
                                         ("kimi_qlora_7l", "replay")])
def test_prefill_decode_verify_logits_match_transformers(make_ckpt, kind, design):
    path = make_ckpt(kind)
    hf = hf_model(path)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 256, (70,), generator=g).tolist()  # > one 64-token chunk
    b = torch.randint(0, 256, (23,), generator=g).tolist()
    with torch.no_grad():
        ref_a, ref_b = hf(torch.tensor([a])).logits[0], hf(torch.tensor([b])).logits[0]
    assert ref_a.abs().max() > 0.5, "logits too small for a meaningful comparison"
    r = [StageRunner(path, max_rows=8, num_speculative_steps=3, commit_design=design)]
    D = 4
    # chunked prefill of both at rows 5 and 2 (not batch positions)
    got = run(r, StepInput(0, 0, "prefill", [5, 2], [0, 0], [40, 10], a[:40] + b[:10]))
    assert close(got[:40], ref_a[:40]) and close(got[40:], ref_b[:10])
    got = run(r, StepInput(0, 1, "prefill", [5, 2], [40, 10], [22, 9], a[40:62] + b[10:19]))
    assert close(got[:22], ref_a[40:62]) and close(got[22:], ref_b[10:19])
    got = run(r, StepInput(0, 2, "verify", [5, 2], [62, 19], [D, D], a[62:66] + b[19:23], num_drafts=[3, 3]))
    assert close(got[:D], ref_a[62:66]) and close(got[D:], ref_b[19:23])
    r[0].commit_accept(0, 2, [5, 2], [3, 1])
    # a holds 65 tokens, b 20: decode continues from the committed state
    got = run(r, StepInput(0, 3, "decode", [5, 2], [65, 20], [1, 1], [a[65], b[20]]))
    assert close(got[0], ref_a[65]) and close(got[1], ref_b[20])
    got = run(r, StepInput(0, 4, "verify", [5, 2], [66, 21], [D, D], a[66:70] + b[21:23] + [0, 0], num_drafts=[3, 1]))
    assert close(got[:D], ref_a[66:70]) and close(got[D:D + 2], ref_b[21:23])
    r[0].commit_accept(0, 4, [5, 2], [2, 2])
    # a continuing prefill after a commit (the replay design applies the pending steps first)
    got = run(r, StepInput(0, 5, "prefill", [5], [68], [2], a[68:70]))
    assert close(got, ref_a[68:70])


@pytest.mark.parametrize("kind", KINDS)
def test_each_experts_run_matches_transformers_moe(make_ckpt, monkeypatch, kind):
    """Every MoE layer against transformers' ``KimiLinearMoE`` on the same tokens, with each
    of the three expert runs (``layers/moe.py``): the CPU's grouping, and the two host-read
    free runs CUDA takes (the grouped GEMM: ``torch._grouped_mm``'s loop on the CPU; every
    expert dense), fp32 within 1e-5; the grouped and dense runs in bf16 as close to fp32 as
    the CPU's bf16 grouping."""
    from ppspec.stage_server.layers import moe

    path = make_ckpt(kind)
    hf = hf_model(path)
    r = StageRunner(path, max_rows=2)
    r16 = StageRunner(path, max_rows=2, dtype=torch.bfloat16)
    x = torch.randn(37, hf.config.hidden_size, generator=torch.Generator().manual_seed(5))
    layers = [i for i in range(hf.config.num_hidden_layers) if r.cfg.is_moe_layer(i)]
    assert layers
    for i in layers:
        with torch.no_grad():
            ref = hf.model.layers[i].mlp(x[None])[0]
        err16 = {}
        for fn in (moe.run_experts, moe.experts_grouped, moe.experts_dense):
            monkeypatch.setattr(moe, "pick_experts", lambda x, experts, _fn=fn: _fn)
            with torch.no_grad():
                got = r.model.layers[str(i)].mlp(x)
                got16 = r16.model.layers[str(i)].mlp(x.to(torch.bfloat16))
            assert got.dtype == torch.float32 and got16.dtype == torch.bfloat16
            assert (got - ref).abs().max() < 1e-5, f"layer {i}, {fn.__name__}"
            err16[fn.__name__] = (got16.float() - ref).abs().max().item()
        assert max(err16.values()) < 1.5 * err16["run_experts"] + 1e-3, err16


def test_logits_with_the_cuda_expert_runs_match_transformers(make_ckpt, monkeypatch):
    """The whole model's prefill, decode and verify logits with the grouped and the dense
    expert runs (the CUDA runs, here on the CPU) against transformers, within 1e-4."""
    from ppspec.stage_server.layers import moe

    path = make_ckpt("kimi_moe_5l")
    hf = hf_model(path)
    a = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([a])).logits[0]
    for fn in (moe.experts_grouped, moe.experts_dense):
        monkeypatch.setattr(moe, "pick_experts", lambda x, experts, _fn=fn: _fn)
        r = [StageRunner(path, max_rows=4, num_speculative_steps=3)]
        assert close(run(r, StepInput(0, 0, "prefill", [3], [0], [25], a[:25])), ref[:25])
        assert close(run(r, StepInput(0, 1, "decode", [3], [25], [1], a[25:26])), ref[25:26])
        assert close(run(r, StepInput(0, 2, "verify", [3], [26], [4], a[26:30], num_drafts=[3])), ref[26:30])


def test_layer_slices_chain_to_the_whole_model(make_ckpt):
    path = make_ckpt("kimi_qlora_7l")
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = run([StageRunner(path, max_rows=2)], StepInput(0, 0, "prefill", [0], [0], [30], ids))
    for pp in (2, 3, 4):  # 7 layers: 4+3, 3+2+2, 2+2+2+1
        runners = [StageRunner(path, k, pp, max_rows=2) for k in range(pp)]
        assert [(r.model.start, r.model.end) for r in runners] == split_layers(7, pp)
        assert not hasattr(runners[-1].model, "embed_tokens") and not hasattr(runners[0].model, "lm_head")
        assert (run(runners, StepInput(0, 0, "prefill", [1], [0], [30], ids)) - whole).abs().max() < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_stage_is_as_close_to_fp32_as_transformers_bf16(make_ckpt, kind):
    """bf16 weights and activations, the router and dt_bias kept fp32 as transformers keeps
    them: our logits are about as far from fp32 as transformers' bf16 run (MLA runs on the
    latent, so its bf16 roundings fall elsewhere than in transformers' expanded heads)."""
    from transformers import AutoModelForCausalLM

    path = make_ckpt(kind)
    ids = list(range(3, 80))
    with torch.no_grad():
        f32 = hf_model(path)(torch.tensor([ids])).logits[0]
        h16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(torch.tensor([ids])).logits[0]
    r = StageRunner(path, max_rows=2, dtype=torch.bfloat16)
    fp32 = {n for n, p in r.model.named_parameters() if p.dtype == torch.float32}
    assert fp32 and all(n.endswith(("gate.weight", "e_score_correction_bias", "dt_bias")) for n in fp32)
    ours = run([r], StepInput(0, 0, "prefill", [0], [0], [len(ids)], ids))
    assert (ours - f32).abs().max() < 1.5 * (h16.float() - f32).abs().max()


def test_kv_pool_holds_the_latent_once(make_ckpt):
    """An MLA layer's KV entry is its compressed latent (kv_lora_rank + qk_rope_head_dim
    values, one head), keys and values one tensor."""
    r = StageRunner(make_ckpt("kimi_moe_5l"), max_rows=2, kv_tokens=64)
    assert r.kv.k is r.kv.v and tuple(r.kv.k.shape[-2:]) == (1, 32 + 8)
    assert r.memory_report()["kv_cache"] == r.kv.k.numel() * 4


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_equals_transformers_generate(make_ckpt, kind):
    """64 greedy tokens against transformers' ``generate``. Its attention mask is passed: the
    checkpoints' pad_token_id is 0, and without a mask ``generate`` takes every 0 in the
    prompt for padding (the KDA layers then zero that token's input)."""
    path = make_ckpt(kind)
    hf = hf_model(path)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    x = torch.tensor([prompt])
    with torch.no_grad():
        # no EOS, as ignore_eos (min_new_tokens would forbid the EOS token where it is the argmax)
        hf.generation_config.eos_token_id = None
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)[0, 12:].tolist()
    assert len(ref) == 64
    out = LLM(path, max_rows=4).generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))[0]
    assert out.token_ids == ref


def _edited(src, dst, **fields):
    shutil.copytree(src, dst)
    p = os.path.join(dst, "config.json")
    cfg = json.load(open(p))
    cfg.update(fields)
    json.dump(cfg, open(p, "w"))
    return dst


@pytest.mark.parametrize("field,value,words", [
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("moe_router_activation_func", "softmax", "moe_router_activation_func"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("mla_use_nope", False, "mla_use_nope"),
    ("hidden_act", "gelu", "hidden_act"),
    ("layer_types", ["linear_attention"] * 4 + ["mamba"], "layer_types"),
    ("num_expert_group", 3, "num_expert_group"),
])
def test_unsupported_settings_name_file_and_field(make_ckpt, tmp_path, field, value, words):
    path = _edited(make_ckpt("kimi_moe_5l"), str(tmp_path / "c"), **{field: value})
    with pytest.raises(CheckpointError) as e:
        load_config(path)
    assert os.path.join(path, "config.json") in str(e.value) and words in str(e.value)


def test_published_config_layout_is_read(make_ckpt, tmp_path):
    """The published config.json's linear_attn_config (1-based layer lists) and
    first_k_dense_replace give the same layers as transformers' explicit lists."""
    src = make_ckpt("kimi_moe_5l")
    cfg = json.load(open(os.path.join(src, "config.json")))
    path = _edited(src, str(tmp_path / "c"), layer_types=None, mlp_layer_types=None, first_k_dense_replace=2,
                   linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3, 5], "head_dim": 16,
                                       "num_heads": 2, "short_conv_kernel_size": 4})
    got = load_config(path)
    assert got.layer_types == cfg["layer_types"] and got.mlp_layer_types == ["dense"] * 2 + ["sparse"] * 3


def test_tensor_of_wrong_shape_is_named(make_ckpt, tmp_path):
    path = str(tmp_path / "c")
    shutil.copytree(make_ckpt("kimi_moe_5l"), path)
    w = load_file(os.path.join(path, "model.safetensors"))
    key = "model.layers.1.self_attn.f_b_proj.weight"
    w[key] = torch.zeros(7, 3)
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        StageRunner(path, max_rows=1)


def test_gpu_bench_kimi_checkpoint_and_step_bytes(tmp_path):
    """gpu_bench's random Kimi checkpoint (here at toy size) loads, its decode and verify
    round run, and a decode step's bytes count the MLA latent once and, at batch 1, only the
    top-k of the routed experts."""
    from ppspec.bench.gpu_bench import decode_and_verify, make_random_kimi_checkpoint, step_bytes

    path = str(tmp_path / "kimi")
    shape = dict(vocab_size=8192, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                 num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 linear_num_heads=2, linear_head_dim=16, moe_intermediate_size=32, num_local_experts=8,
                 num_experts_per_tok=2, max_position_embeddings=512)
    n = make_random_kimi_checkpoint(torch, path, "cpu", **shape)
    dec, ver, ratios, r = decode_and_verify(torch, path, 1, 16, repeats=2, n=1, device="cpu", dtype=torch.float32)
    assert n > 0 and dec > 0 and ver > 0 and len(ratios) == 2
    w, kv, st = step_bytes(r, 1, 16)
    assert kv == 1 * 16 * (32 + 8) * 2  # layer 4 (MLA) x 16 tokens x one latent of 40, 2 bytes each
    experts = sum(p.numel() * 4 for name, p in r.model.named_parameters() if ".experts." in name)
    others = sum(p.numel() * 4 for name, p in r.model.named_parameters()
                 if ".experts." not in name and not name.startswith("embed_tokens."))
    assert w == others + experts * 2 // 8
    assert st == 4 * 2 * 4 * 2 * 16 * 16  # 4 KDA layers, read and written, fp32 [2, 16, 16]
