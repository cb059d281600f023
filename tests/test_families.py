"""The family seam (docs/DESIGN.md, "Layer families"): a checkpoint's model_type picks its
family or is one CheckpointError naming the file and the field; a layer family's state
declaration alone lays out the pool, and the one commit (RowStatePool.commit) commits any
declared state the same way on every path (host lists, tensors, the padded graph path)."""
from __future__ import annotations

import json
from typing import NamedTuple

import pytest
import torch

from ppspec.stage_server.config import CheckpointError, load_config
from ppspec.stage_server.family import REPLAY, SCRATCH, LayerFamily, RecordSpec, StateLayout, StateSpec
from ppspec.stage_server.graphs import CommitGraphs
from ppspec.stage_server.models import BY_MODEL_TYPE, FAMILIES
from ppspec.stage_server.pools import RowStatePool


class ToyRecord(NamedTuple):
    dt: torch.Tensor
    x: torch.Tensor
    pending: torch.Tensor
    slot: torch.Tensor


class ToyFamily(LayerFamily):
    """A Mamba2-shaped declaration: a conv window and an SSM state ``[H, P, N]``, the replay
    design recording ``dt [H]`` and ``x [H, P]`` per step; and a second scratch-kept tensor."""

    name = "toy"
    record_type = ToyRecord

    def layout(self, cfg=None) -> StateLayout:
        return StateLayout(self, state=(StateSpec("conv", (12, 3), None, SCRATCH, column_major=True),
                                        StateSpec("ssm", (2, 4, 5), torch.float32, REPLAY),
                                        StateSpec("extra", (6,), torch.float32, SCRATCH)),
                           record=(RecordSpec("dt", (2,)), RecordSpec("x", (2, 4))))


def test_unsupported_model_type_is_one_error_naming_file_field_and_the_types_served(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError) as e:
        load_config(str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'config.json'}: unsupported model_type 'llama'; supported: ")
    assert msg.split("supported: ")[1].split(", ") == sorted(BY_MODEL_TYPE)
    assert {"qwen3_next", "qwen3_5_text", "kimi_linear"} <= set(BY_MODEL_TYPE)
    # each model_type is served by exactly one family, the one that lists it
    assert all(BY_MODEL_TYPE[t] is f for f in FAMILIES for t in f.model_types)


@pytest.mark.parametrize("design", ["copy", "replay"])
def test_a_declared_layout_is_the_pool(design):
    L, rows, D = 3, 5, 4
    pool = RowStatePool(ToyFamily().layout(), L, rows, D, torch.bfloat16, "cpu", commit_design=design)
    assert pool.conv.shape == (L, rows + 1, 12, 3) and pool.conv.dtype == torch.bfloat16
    assert pool.conv.stride()[-2:] == (1, 12)  # column-major windows
    assert pool.ssm.shape == (L, rows + 1, 2, 4, 5) and pool.ssm.dtype == torch.float32
    assert pool.conv_scratch.shape == (L, rows + 1, D, 12, 3) and pool.extra_scratch.shape == (L, rows + 1, D, 6)
    if design == "copy":
        assert pool.ssm_scratch.shape == (L, rows + 1, D, 2, 4, 5) and pool.replay is None
    else:
        assert pool.ssm_scratch is None
        rec = pool.replay[1]
        assert isinstance(rec, ToyRecord) and rec.dt.shape == (rows + 1, 2, D, 2) and rec.x.shape == (rows + 1, 2, D, 2, 4)
        assert rec.pending.data_ptr() == pool.replay_pending[1].data_ptr()
    st = pool.layer(2)
    assert st.ssm.data_ptr() == pool.ssm[2].data_ptr() and st.conv_scratch.shape == (rows + 1, D, 12, 3)
    assert RowStatePool.nbytes_of(ToyFamily().layout(), L, rows, D, torch.bfloat16, design) == pool.nbytes
    assert RowStatePool(ToyFamily().layout(), L, rows, 1, torch.float32, "cpu", commit_design=design).nbytes[
        "verify_scratch"] == 0


def test_a_family_without_a_replay_record_refuses_the_replay_design():
    bare = StateLayout(ToyFamily(), state=(StateSpec("ssm", (2, 2), torch.float32, REPLAY),))
    with pytest.raises(ValueError, match="layer family 'toy' declares no replay record"):
        RowStatePool(bare, 1, 2, 3, torch.float32, "cpu", commit_design="replay")


def _filled(design: str, seed: int = 0) -> RowStatePool:
    pool = RowStatePool(ToyFamily().layout(), 2, 6, 4, torch.float32, "cpu", commit_design=design)
    g = torch.Generator().manual_seed(seed)
    for t in list(pool.state.values()) + [t for t in pool.scratch.values() if t is not None]:
        t.copy_(torch.randn(t.shape, generator=g))
    return pool


@pytest.mark.parametrize("design", ["copy", "replay"])
def test_the_one_commit_of_any_declared_state(design):
    """Every scratch-kept tensor takes the accepted step at exactly the named rows; the
    replay design marks the rest pending (slot flipped); the other rows are untouched. The
    same through host lists, tensors and the padded graph path."""
    rows, acc = [4, 1], [3, 1]
    ref = _filled(design)
    want = {k: t.clone() for k, t in ref.state.items()}
    for k, sc in ref.scratch.items():
        if sc is not None:
            for r, a in zip(rows, acc):
                want[k][:, r] = sc[:, r, a - 1]
    results = []
    for path in ("lists", "tensors", "graphs"):
        pool = _filled(design)
        if path == "graphs":
            pool.use_graphs(CommitGraphs(pool.launch_commit, max_bs=4, pad_row=6, device=pool.device, capture=False))
            pool.commit(rows, acc)
        elif path == "tensors":
            pool.commit(torch.tensor(rows), torch.tensor(acc))
        else:
            pool.commit(rows, acc)
        for k in want:
            assert torch.equal(pool.state[k], want[k]), (path, k)
        if design == "replay":
            assert pool.replay_pending.tolist() == [[0, 1, 0, 0, 3, 0, 0]] * 2
            assert pool.replay_slot.tolist() == [[0, 1, 0, 0, 1, 0, 0]] * 2
        results.append(pool)
    with pytest.raises(IndexError):
        results[0].commit([1, 1], [1, 1])
    with pytest.raises(ValueError):
        results[0].commit([1], [5])
    with pytest.raises(IndexError):
        results[0].commit([7], [1])


@pytest.mark.parametrize("kind,key", [
    ("qwen3_next_moe", "model.layers.0.mlp.experts.1.up_proj.weight"),       # per-expert, stacked
    ("qwen3_next_moe", "model.layers.0.linear_attn.in_proj_qkvz.weight"),    # fused, split
    ("qwen3_next_moe", "model.layers.2.linear_attn.in_proj_ba.weight"),
    ("kimi_moe_5l", "model.layers.1.block_sparse_moe.experts.0.w1.weight"),  # per-expert w1 | w3, stacked
    ("kimi_moe_5l", "model.layers.2.block_sparse_moe.experts.7.w2.weight"),
    ("kimi_moe_5l", "model.layers.0.block_sparse_moe.down_proj.weight"),     # read for mlp.down_proj
    ("kimi_moe_5l", "model.layers.1.self_attn.f_b_proj.weight"),
    ("nemotron_h_a", "backbone.layers.5.mixer.experts.2.up_proj.weight"),    # per-expert, stacked
    ("nemotron_h_a", "backbone.layers.0.mixer.in_proj.weight"),
    ("granite_a", "model.layers.0.block_sparse_moe.input_linear.weight"),
    ("granite_a", "model.layers.2.mamba.in_proj.weight"),
    ("bamba_a", "model.layers.0.mamba.in_proj.weight"),
    ("falcon_h1_a", "model.layers.1.mamba.in_proj.weight"),
])
def test_a_tensor_of_the_wrong_shape_is_one_error_naming_its_file_and_name(make_ckpt, tmp_path, kind, key):
    """Every family, the layouts converted at load included (per-expert weights stacked,
    Qwen3-Next's fused projections split, Kimi's MLP under ``block_sparse_moe.``): one
    tensor one row longer than config.json implies is a CheckpointError naming the file
    and that tensor as the checkpoint names it, and the shape expected."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ppspec.stage_server.loader import load_stage_model

    path = tmp_path / kind
    shutil.copytree(make_ckpt(kind), path)
    weights = load_file(path / "model.safetensors")
    good = tuple(weights[key].shape)
    bad = (good[0] + 1,) + good[1:]
    weights[key] = torch.zeros(bad)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_stage_model(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path / 'model.safetensors'}: tensor {key!r} has shape {bad}, expected "), msg
    assert msg.endswith(" from config.json") and f"expected {good}" in msg, msg


@pytest.mark.parametrize("kind", ["kimi_moe_5l", "granite_a", "bamba_a", "falcon_h1_a"])
def test_mtp_speculation_on_a_family_without_an_mtp_head_is_refused_by_name(make_ckpt, tmp_path, kind):
    """A family that loads no MTP head refuses speculative_algorithm mtp naming its model_type,
    also where the checkpoint holds ``mtp.*`` tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ppspec.router.llm import LLM

    path = tmp_path / kind
    shutil.copytree(make_ckpt(kind), path)
    weights = load_file(path / "model.safetensors")
    weights["mtp.layers.0.norm.weight"] = torch.ones(weights["lm_head.weight"].shape[1])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    with pytest.raises(ValueError, match=f"speculative algorithm mtp is not served for model_type '{model_type}'"):
        LLM(str(path), max_rows=2, speculative_algorithm="mtp")


def test_nemotron_h_mtp_is_served_where_the_checkpoint_has_a_head(make_ckpt, tmp_path):
    """NemotronH loads the head of a checkpoint that has one (``num_nextn_predict_layers`` and
    the ``mtp.*`` tensors) and drafts with it; a checkpoint without one is refused: no head
    at all, the tensors without ``num_nextn_predict_layers``, or the field without the tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    with_head = make_ckpt("nemotron_h_mtp")
    llm = LLM(with_head, max_rows=2, speculative_algorithm="mtp", num_speculative_steps=2)
    assert len(llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6))[0].token_ids) == 6
    no_field = tmp_path / "no_field"
    shutil.copytree(with_head, no_field)
    cfg = json.loads((no_field / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (no_field / "config.json").write_text(json.dumps(cfg))
    no_tensors = tmp_path / "no_tensors"
    shutil.copytree(with_head, no_tensors)
    weights = load_file(no_tensors / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")}, no_tensors / "model.safetensors",
              metadata={"format": "pt"})
    for path in (make_ckpt("nemotron_h_a"), no_field, no_tensors):
        with pytest.raises(ValueError, match="speculative algorithm mtp needs an mtp.* head in the checkpoint"):
            LLM(str(path), max_rows=2, speculative_algorithm="mtp")
