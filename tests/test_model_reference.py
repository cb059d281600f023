"""Logits of every forward mode against Hugging Face transformers on the same checkpoint
(fp32, CPU), layer-range slicing, and greedy generation against ``generate``."""
import pytest
import torch

from ppspec.proto.messages import StepInput
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.runner import StageRunner, split_layers

KINDS = ["qwen3_next_dense", "qwen3_next_moe", "qwen3_5_ratio1", "qwen3_5_ratio2_7l", "qwen3_5_moe", "qwen3_5_bias"]
TOL = 1e-4


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def run(runners, inp):
    """Chain the slices: each runner's hidden states feed the next; logits from the last."""
    h = None
    for r in runners:
        inp.hidden_states = h
        meta, h = r.forward_hidden(inp)
    return runners[-1].model.logits(h)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_decode_verify_logits_match_transformers(make_ckpt, kind):
    path = make_ckpt(kind)
    hf = hf_model(path)
    g = torch.Generator().manual_seed(1)
    # two requests of different lengths in one packed batch
    a = torch.randint(0, 256, (70,), generator=g).tolist()  # > one 64-token GDN chunk
    b = torch.randint(0, 256, (23,), generator=g).tolist()
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    assert ref_a.abs().max() > 0.5, "logits too small for a meaningful comparison"
    r = [StageRunner(path, max_rows=8, num_speculative_steps=3)]
    D = 4
    # chunked prefill of both, rows 5 and 2 (not batch positions)
    got = run(r, StepInput(0, 0, "prefill", [5, 2], [0, 0], [40, 10], a[:40] + b[:10]))
    assert (got[:40] - ref_a[:40]).abs().max() < TOL and (got[40:] - ref_b[:10]).abs().max() < TOL
    got = run(r, StepInput(0, 1, "prefill", [5, 2], [40, 10], [22, 9], a[40:62] + b[10:19]))
    assert (got[:22] - ref_a[40:62]).abs().max() < TOL and (got[22:] - ref_b[10:19]).abs().max() < TOL
    # verify D tokens each; commit different accept lengths
    got = run(r, StepInput(0, 2, "verify", [5, 2], [62, 19], [D, D], a[62:66] + b[19:23], num_drafts=[3, 3]))
    assert (got[:D] - ref_a[62:66]).abs().max() < TOL and (got[D:] - ref_b[19:23]).abs().max() < TOL
    r[0].commit_accept(0, 2, [5, 2], [3, 1])
    # after the commit: a has 65 tokens, b has 20; decode continues from the committed state
    got = run(r, StepInput(0, 3, "decode", [5, 2], [65, 20], [1, 1], [a[65], b[20]]))
    assert (got[0] - ref_a[65]).abs().max() < TOL and (got[1] - ref_b[20]).abs().max() < TOL
    got = run(r, StepInput(0, 4, "verify", [5, 2], [66, 21], [D, D], a[66:70] + b[21:23] + [0, 0], num_drafts=[3, 1]))
    assert (got[:D] - ref_a[66:70]).abs().max() < TOL and (got[D : D + 2] - ref_b[21:23]).abs().max() < TOL


@pytest.mark.parametrize("kind", ["qwen3_5_ratio2_7l", "qwen3_next_moe"])
def test_layer_slices_chain_to_the_whole_model(make_ckpt, kind):
    path = make_ckpt(kind)
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = run([StageRunner(path, max_rows=2)], StepInput(0, 0, "prefill", [0], [0], [30], ids))
    n = len(StageRunner(path, max_rows=1, layer_range=(0, 1)).cfg.layer_types)
    for pp in (2, 3, 4):
        ranges = split_layers(n, pp)
        runners = [StageRunner(path, k, pp, max_rows=2) for k in range(pp)]
        assert [(r.model.start, r.model.end) for r in runners] == ranges
        # each slice holds only its layers (+ embedding first, norm/lm_head last)
        assert not hasattr(runners[-1].model, "embed_tokens") and not hasattr(runners[0].model, "lm_head")
        sliced = run(runners, StepInput(0, 0, "prefill", [1], [0], [30], ids))
        assert (sliced - whole).abs().max() < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_equals_transformers_generate(make_ckpt, kind):
    path = make_ckpt(kind)
    hf = hf_model(path)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, 12:].tolist()
    llm = LLM(path, max_rows=4)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))[0]
    assert out.token_ids == ref


def test_bf16_stage_matches_transformers_in_bf16(make_ckpt):
    """bf16 weights and activations: our logits sit close to transformers' own bf16 run
    (far closer than either is to fp32, whose gap is bf16 rounding)."""
    path = make_ckpt("qwen3_5_ratio2_7l")
    ids = list(range(3, 40))
    f32 = hf_logits(hf_model(path), ids)
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        h16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(torch.tensor([ids])).logits[0].float()
    r16 = StageRunner(path, max_rows=2, dtype=torch.bfloat16)
    assert {p.dtype for p in r16.model.parameters()} == {torch.bfloat16}
    ours = run([r16], StepInput(0, 0, "prefill", [0], [0], [len(ids)], ids))
    assert ours.dtype == torch.float32  # logits are returned in fp32
    rounding = (h16 - f32).abs().max()
    assert (ours - h16).abs().max() < 0.25 * rounding
    assert (ours - h16).abs().max() < 0.05 * f32.abs().max()


@pytest.mark.parametrize("kind", ["qwen3_5_bias", "qwen3_5_moe"])
def test_fused_projections_are_views_of_the_checkpoint_weights(make_ckpt, kind):
    """After loading, each set of projections that reads one input (GDN qkv/z/b/a,
    attention q/k/v with their biases, MLP / shared-expert gate/up, the MTP layer's too)
    is one weight whose rows are the checkpoint's tensors, in order; the parameters are
    views of it (names and values as the checkpoint's, every byte held once)."""
    import os

    from safetensors import safe_open

    from ppspec.stage_server.loader import _checkpoint_key, load_stage_model
    from ppspec.stage_server.model import MLP, GatedAttention, GatedDeltaNet

    path = make_ckpt(kind)
    cfg, model = load_stage_model(path)
    assert hasattr(model, "mtp")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        checked = set()
        for name, p in model.named_parameters():
            key = _checkpoint_key(cfg, name)
            if key in keys:
                assert torch.equal(p, f.get_tensor(key)), name
                checked.add(name)
            else:
                assert ".experts." in name, name  # stacked from per-expert tensors at load time
    fused = {
        GatedDeltaNet: lambda m: ([m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a], m.in_proj_weight, None),
        GatedAttention: lambda m: ([m.q_proj, m.k_proj, m.v_proj], m.qkv_weight, m.qkv_bias),
        MLP: lambda m: ([m.gate_proj, m.up_proj], m.gate_up_weight, None),
    }
    seen = {cls: 0 for cls in fused}
    prefixes = {m: n for n, m in model.named_modules()}
    for m in model.modules():
        if type(m) not in fused:
            continue
        seen[type(m)] += 1
        linears, weight, bias = fused[type(m)](m)
        assert (bias is not None) == (kind == "qwen3_5_bias" and isinstance(m, GatedAttention))
        for whole, leaf in ((weight, "weight"), (bias, "bias")):
            if whole is None:
                continue
            row = 0
            for lin in linears:
                part = getattr(lin, leaf)
                assert f"{prefixes[lin]}.{leaf}" in checked  # compared with the checkpoint above
                assert part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                assert part.storage_offset() == whole.storage_offset() + row * whole[0].numel()
                assert torch.equal(whole[row:row + part.shape[0]], part)
                row += part.shape[0]
            assert row == whole.shape[0]
    # every decoder layer (and the MTP layer) has one MLP: its own or the MoE's shared expert
    n_layers = cfg.num_hidden_layers
    assert seen == {GatedDeltaNet: len(model.linear_layers), GatedAttention: len(model.attention_layers) + 1,
                    MLP: n_layers + 1}
    # every byte once: the parameters' distinct storages hold exactly the parameters
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in model.parameters())
    # the fused tensors are no checkpoint entries: the state dict is the parameters
    assert list(model.state_dict()) == [n for n, _ in model.named_parameters()]
