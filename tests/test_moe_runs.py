"""The MoE blocks of Qwen3-Next / Qwen3.5-MoE (top-k softmax routing, a sigmoid-gated shared
expert), of Granite 4.0 hybrid (softmax over the top-k logits) and of NemotronH (DeepSeek-V3
sigmoid routing, relu2 experts without a gate, a relu2 shared expert) against transformers'
MoE blocks on the same random checkpoints, with each of the three expert runs of
``stage_server/layers/moe.py``: the CPU's per-expert grouping (``run_experts``) and the two
host-read free runs CUDA takes (``experts_grouped``: ``torch._grouped_mm``'s loop on the
CPU; ``experts_dense``), so that the CUDA-graph capturable runs are checked where the
routing is the family's own. Each run with each activation (SwiGLU, relu2) against a
per-token loop in plain torch, and NemotronH's block with the capturable runs on the meta
device, where any host read raises. Kimi Linear's block: tests/test_kimi_linear.py."""
import pytest
import torch

from ppspec.stage_server.layers import moe
from ppspec.stage_server.runner import StageRunner

RUNS = (moe.run_experts, moe.experts_grouped, moe.experts_dense)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# kind -> the MoE block's attribute name in a decoder layer (ours and transformers')
BLOCKS = {"qwen3_next_moe": "mlp", "qwen3_5_moe": "mlp", "granite_a": "block_sparse_moe", "nemotron_h_a": "mixer",
          "nemotron_h_b": "mixer", "nemotron_h_latent": "mixer"}


def moe_layers(r: StageRunner, attr: str) -> list[int]:
    """The stage's layers whose ``attr`` is an MoE block (the family's own class)."""
    from ppspec.stage_server.models.granitemoehybrid.model import MoE
    from ppspec.stage_server.models.nemotron_h.model import MoE as NemotronMoE
    from ppspec.stage_server.models.qwen3_next.model import SparseMoE

    return [int(i) for i, layer in r.model.layers.items()
            if isinstance(getattr(layer, attr), (SparseMoE, MoE, NemotronMoE))]


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_each_experts_run_matches_transformers_moe(make_ckpt, monkeypatch, kind):
    """Every MoE layer on 37 random tokens: fp32 within 1e-5 of transformers' block with each
    run; in bf16 the CUDA runs as close to transformers' fp32 block as the CPU's bf16 run
    (within 1.5 times its error, plus 1e-3)."""
    torch.set_num_threads(1)
    path = make_ckpt(kind)
    hf = hf_model(path)
    attr = BLOCKS[kind]
    r = StageRunner(path, max_rows=2)
    r16 = StageRunner(path, max_rows=2, dtype=torch.bfloat16)
    x = torch.randn(37, hf.config.hidden_size, generator=torch.Generator().manual_seed(5))
    layers = moe_layers(r, attr)
    assert layers
    for i in layers:
        with torch.no_grad():
            ref = getattr(hf.model.layers[i], attr)(x[None])[0]
        err16 = {}
        for fn in RUNS:
            monkeypatch.setattr(moe, "pick_experts", lambda x, experts, _fn=fn: _fn)
            with torch.no_grad():
                got = getattr(r.model.layers[str(i)], attr)(x)
                got16 = getattr(r16.model.layers[str(i)], attr)(x.to(torch.bfloat16))
            assert got.dtype == torch.float32 and got16.dtype == torch.bfloat16
            assert (got - ref).abs().max() < 1e-5, f"layer {i}, {fn.__name__}"
            err16[fn.__name__] = (got16.float() - ref).abs().max().item()
        assert max(err16.values()) < 1.5 * err16["run_experts"] + 1e-3, err16


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_the_stage_picks_the_cpu_run_on_the_cpu(make_ckpt, monkeypatch, kind):
    """Without the patch, a CPU stage's MoE block takes ``run_experts`` (the CPU path as it
    was): every call of ``routed_experts`` picks it."""
    path = make_ckpt(kind)
    r = StageRunner(path, max_rows=2)
    picked = []
    orig = moe.pick_experts
    monkeypatch.setattr(moe, "pick_experts", lambda x, e: picked.append(orig(x, e)) or picked[-1])
    x = torch.randn(5, r.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    layers = moe_layers(r, BLOCKS[kind])
    with torch.no_grad():
        for i in layers:
            getattr(r.model.layers[str(i)], BLOCKS[kind])(x)
    assert layers and len(picked) == len(layers)
    assert all(fn is moe.run_experts for fn in picked)


def per_token_reference(x, top_i, top_w, gate_up, down, act):
    """``sum_j top_w[t, j] * down[e] act(gate_up[e] x_t)``, ``e = top_i[t, j]``, one token and
    slot at a time in plain torch: ``act`` "relu2" (``relu(h)^2``), "swiglu" (``silu(gate) *
    up`` of the halves ``[gate | up]``) or "relu" (a wrong one, to show the test tells them
    apart)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_i.shape[1]):
            e = int(top_i[t, j])
            h = gate_up[e] @ x[t]
            if act == "relu2":
                a = torch.clamp(h, min=0) ** 2
            elif act == "relu":
                a = torch.clamp(h, min=0)
            else:
                g, u = h[:h.shape[0] // 2], h[h.shape[0] // 2:]
                a = g / (1 + torch.exp(-g)) * u
            out[t] += top_w[t, j] * (down[e] @ a)
    return out


@pytest.mark.parametrize("routes", ["random", "two experts"])
@pytest.mark.parametrize("act", ["relu2", "swiglu"])
@pytest.mark.parametrize("fn", RUNS, ids=lambda f: f.__name__)
def test_each_run_equals_a_per_token_reference(fn, act, routes):
    """Each run in fp32 with relu2 experts without a gate (NemotronH's: ``act = RELU2``,
    ``gate_up_proj [E, I, H]``) and with SwiGLU experts (``[E, 2I, H]``, no ``act``: the
    default) within 1e-5 of the per-token loop, 13 tokens routed to 2 of 6 experts at random
    or all to experts 1 and 4 (the other experts without rows); relu2's output is off the
    loop with relu by far more."""
    from types import SimpleNamespace

    torch.set_num_threads(1)
    E, k, H, I, T = 6, 2, 16, 8, 13
    g = torch.Generator().manual_seed(3)
    gates = 1 if act == "relu2" else 2
    gate_up = torch.randn(E, gates * I, H, generator=g) * H ** -0.5
    down = torch.randn(E, H, I, generator=g) * I ** -0.5
    experts = (SimpleNamespace(gate_up_proj=gate_up, down_proj=down, act=moe.RELU2) if act == "relu2"
               else SimpleNamespace(gate_up_proj=gate_up, down_proj=down))
    x = torch.randn(T, H, generator=g)
    top_w, top_i = torch.rand(T, E, generator=g).topk(k, dim=-1)
    if routes == "two experts":
        top_i = torch.tensor([[1, 4], [4, 1]]).repeat(T, 1)[:T]
    got = fn(x, top_i, top_w, experts)
    ref = per_token_reference(x, top_i, top_w, gate_up, down, act)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert ref.abs().max() > 0.1
    assert (got - ref).abs().max() < 1e-5
    if act == "relu2":
        assert (got - per_token_reference(x, top_i, top_w, gate_up, down, "relu")).abs().max() > 1e-2


@pytest.mark.parametrize("run,dtype", [("experts_grouped", torch.bfloat16), ("experts_dense", torch.float32)],
                         ids=["grouped-bf16", "dense-fp32"])
@pytest.mark.parametrize("kind", ["nemotron_h_a", "nemotron_h_b", "nemotron_h_latent"])
def test_nemotron_moe_block_reads_nothing_on_the_host(make_ckpt, monkeypatch, kind, run, dtype):
    """NemotronH's MoE block (router, routed experts, shared expert) with the runs CUDA takes
    on the meta device, where a host read (``.item()``, ``.tolist()``, ``nonzero``, a tensor
    in an ``if``) raises: the forward makes none, as a CUDA graph needs (the grouped run's
    meta kernel takes bf16 only); with the CPU's run (its one read of the group sizes) it
    raises."""
    from ppspec.stage_server.config import load_config
    from ppspec.stage_server.models.nemotron_h.model import MoE

    cfg = load_config(make_ckpt(kind))
    with torch.device("meta"):
        block = MoE(cfg).to(dtype)
        x = torch.empty(7, cfg.hidden_size, dtype=dtype)
    monkeypatch.setattr(moe, "pick_experts", lambda x, experts: getattr(moe, run))
    with torch.no_grad():
        out = block(x)
    assert out.device.type == "meta" and out.shape == x.shape and out.dtype == dtype
    monkeypatch.setattr(moe, "pick_experts", lambda x, experts: moe.run_experts)
    with pytest.raises((NotImplementedError, RuntimeError)):
        with torch.no_grad():
            block(x)
