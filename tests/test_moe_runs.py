"""The MoE blocks of Qwen3-Next / Qwen3.5-MoE (top-k softmax routing, a sigmoid-gated shared
expert) and of Granite 4.0 hybrid (softmax over the top-k logits) against transformers' MoE
blocks on the same random checkpoints, with each of the three expert runs of
``stage_server/layers/moe.py``: the CPU's per-expert grouping (``run_experts``) and the two
host-read free runs CUDA takes (``experts_grouped``: ``torch._grouped_mm``'s loop on the
CPU; ``experts_dense``), so that the CUDA-graph capturable runs are checked where the
routing is the family's own. Kimi Linear's block: tests/test_kimi_linear.py."""
import pytest
import torch

from ppspec.stage_server.layers import moe
from ppspec.stage_server.runner import StageRunner

RUNS = (moe.run_experts, moe.experts_grouped, moe.experts_dense)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# kind -> the MoE block's attribute name in a decoder layer (ours and transformers')
BLOCKS = {"qwen3_next_moe": "mlp", "qwen3_5_moe": "mlp", "granite_a": "block_sparse_moe"}


def moe_layers(r: StageRunner, attr: str) -> list[int]:
    """The stage's layers whose ``attr`` is an MoE block (the family's own class)."""
    from ppspec.stage_server.models.granitemoehybrid.model import MoE
    from ppspec.stage_server.models.qwen3_next.model import SparseMoE

    return [int(i) for i, layer in r.model.layers.items() if isinstance(getattr(layer, attr), (SparseMoE, MoE))]


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
