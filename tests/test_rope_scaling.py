"""YaRN RoPE scaling (Peng et al. 2023) as transformers computes it: the inverse
frequencies and attention factor of ``rope_frequencies`` equal transformers'
``_compute_yarn_parameters`` for every field, and on tiny random Qwen3-Next / Qwen3.5
checkpoints written by transformers ppspec's logits match transformers' at positions past
``original_max_position_embeddings``, where the scaling changes them. The config checks
(bad fields, refused RoPE types) are in test_checkpoint_config.py's table."""
import json

import pytest
import torch

from ppspec.kernels.rotary import apply_rotary
from ppspec.proto.messages import StepInput
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.config import load_config
from ppspec.stage_server.model import rope_frequencies
from ppspec.stage_server.runner import StageRunner

from checkpoints import BASE, KINDS, _model_class
from test_model_reference import TOL, hf_logits, hf_model, run

ORIGINAL = 16  # original_max_position_embeddings: the prompts below run to 3x past it


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _hf_rope(path, text_config=False):
    """transformers' own (inv_freq, attention_factor) for the checkpoint config at ``path``."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.from_pretrained(path)
    cfg = cfg.text_config if text_config else cfg
    return ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg)


def _config_only(tmp_path, name, rope, model_type="qwen3_next", **over):
    """config.json alone (no weights): what load_config and transformers' config read."""
    cfg_cls, _ = _model_class(model_type)
    path = tmp_path / name
    cfg_cls(**{**BASE, **KINDS["qwen3_next_dense"][1], "max_position_embeddings": 64, **over,
               "rope_parameters": rope}).save_pretrained(path)
    return path


YARN_FIELDS = {
    # name: (rope_parameters beside rope_type yarn, top-level overrides)
    "plain": ({"factor": 4.0, "original_max_position_embeddings": ORIGINAL}, {}),
    "long_original": ({"factor": 4.0, "original_max_position_embeddings": 4096}, {}),
    "no_truncate_theta_100": ({"factor": 8.0, "original_max_position_embeddings": 100, "truncate": False,
                               "rope_theta": 100.0}, {}),
    "betas_and_mscales": ({"factor": 2.5, "original_max_position_embeddings": 300, "beta_fast": 16, "beta_slow": 2,
                           "mscale": 0.7, "mscale_all_dim": 1.0}, {}),
    "mscale_alone_is_ignored": ({"factor": 2.5, "original_max_position_embeddings": 300, "mscale": 0.7}, {}),
    "attention_factor": ({"factor": 4, "original_max_position_embeddings": ORIGINAL, "attention_factor": 0.9}, {}),
    # factor null: max_position_embeddings / original_max_position_embeddings
    "factor_null": ({"factor": None, "original_max_position_embeddings": ORIGINAL}, {}),
    # original_max_position_embeddings absent: max_position_embeddings
    "no_original": ({"factor": 4.0}, {}),
    "full_rotary": ({"factor": 4.0, "original_max_position_embeddings": 256, "partial_rotary_factor": 1.0}, {}),
    # a top-level original_max_position_embeddings wins over the rope object's (transformers' Phi-3 rule)
    "top_level_original": ({"factor": 4.0, "original_max_position_embeddings": ORIGINAL},
                           {"original_max_position_embeddings": 4096}),
}


@pytest.mark.parametrize("name", sorted(YARN_FIELDS))
def test_yarn_frequencies_and_attention_factor_equal_transformers(tmp_path, name):
    fields, over = YARN_FIELDS[name]
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, **fields}
    path = _config_only(tmp_path, name, rope)
    if over:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **over}))
    ref_inv, ref_att = _hf_rope(path)
    inv, att = rope_frequencies(load_config(str(path)))
    assert inv.dtype == torch.float32 and torch.equal(inv, ref_inv)
    assert att == ref_att
    if name == "plain":  # the factor and frequencies differ from plain RoPE's
        plain = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
        assert att > 1.1 and not torch.equal(inv, plain) and inv[0] == plain[0]


def test_yarn_of_the_multimodal_wrapper_is_read_from_text_config(tmp_path):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    text = {**BASE, **KINDS["qwen3_5_ratio1"][1],
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=BASE["hidden_size"],
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    path = tmp_path / "mm_yarn"
    Qwen3_5Config(text_config=text, vision_config=vision).save_pretrained(path)
    cfg = load_config(str(path))
    assert cfg.rope_type == "yarn" and cfg.rope_yarn.original_max_position_embeddings == ORIGINAL
    ref_inv, ref_att = _hf_rope(path, text_config=True)
    inv, att = rope_frequencies(cfg)
    assert torch.equal(inv, ref_inv) and att == ref_att


def test_rotary_scale_multiplies_cos_and_sin():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    positions = torch.tensor([0, 3, 17, 40, 1000])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
    q1, k1 = apply_rotary(q, k, positions, inv_freq)
    q2, k2 = apply_rotary(q, k, positions, inv_freq, 1.25)
    for a, b, x in ((q1, q2, q), (k1, k2, k)):
        torch.testing.assert_close(b[..., :8], 1.25 * a[..., :8], rtol=1e-6, atol=1e-6)
        assert torch.equal(b[..., 8:], x[..., 8:])  # the dims past rotary_dim pass through
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale must be a finite positive float"):
            apply_rotary(q, k, positions, inv_freq, bad)


# Checkpoints: qwen3_next with the defaults (theta 1e4, truncated ramp, rotary dim 8), and
# qwen3_5 with a ramp of fractional weights (theta 100, truncate false, rotary dim 16).
MODELS = {
    "qwen3_next_dense": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                         "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "qwen3_5_ratio1": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                       "rope_theta": 100.0, "partial_rotary_factor": 1.0, "truncate": False, "beta_fast": 16.0},
}


@pytest.fixture(scope="module")
def yarn_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("yarn")
    made = {}

    def _make(kind, **rope_over):
        key = (kind, tuple(sorted(rope_over.items())))
        if key not in made:
            model_type, over = KINDS[kind]
            cfg_cls, model_cls = _model_class(model_type)
            torch.manual_seed(0)
            model = model_cls(cfg_cls(**{**BASE, **over, "rope_parameters": {**MODELS[kind], **rope_over}}))
            path = root / f"{kind}_{len(made)}"
            model.eval().save_pretrained(path)
            made[key] = path
        return made[key]

    return _make


def _ppspec_logits(path, ids):
    """Chunked prefill (two chunks), one decode and one verify of ``ids``' last 5 tokens,
    on row 3: the logits of every position."""
    r = [StageRunner(str(path), max_rows=4, num_speculative_steps=3)]
    n = len(ids)
    out = [run(r, StepInput(0, 0, "prefill", [3], [0], [20], ids[:20])),
           run(r, StepInput(0, 1, "prefill", [3], [20], [n - 25], ids[20:n - 5])),
           run(r, StepInput(0, 2, "decode", [3], [n - 5], [1], ids[n - 5:n - 4])),
           run(r, StepInput(0, 3, "verify", [3], [n - 4], [4], ids[n - 4:], num_drafts=[3]))]
    return torch.cat(out)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_yarn_logits_match_transformers_past_the_original_context(yarn_ckpt, kind):
    path = yarn_ckpt(kind)
    cfg = load_config(str(path))
    assert cfg.rope_type == "yarn" and rope_frequencies(cfg)[1] > 1.1
    ids = torch.randint(0, 256, (3 * ORIGINAL,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf_model(path), ids)
    assert ref.abs().max() > 0.5, "logits too small for a meaningful comparison"
    got = _ppspec_logits(path, ids)
    assert (got - ref).abs().max() < TOL
    # both halves of YaRN matter on this checkpoint past the original context: with the
    # attention factor at 1 (frequencies kept), or plain RoPE, the logits move far beyond
    # the tolerance, so the match above needs the frequencies and the factor
    far = ORIGINAL + 1
    for over in ({"attention_factor": 1.0}, {"rope_type": "default"}):
        other = yarn_ckpt(kind, **over)
        moved = (_ppspec_logits(other, ids) - ref)[far:].abs().max()
        assert moved > 100 * TOL, (over, float(moved))
    # and ppspec follows transformers with the factor at 1 too
    other = yarn_ckpt(kind, attention_factor=1.0)
    assert (_ppspec_logits(other, ids) - hf_logits(hf_model(other), ids)).abs().max() < TOL


def test_yarn_greedy_generation_equals_transformers_generate(yarn_ckpt):
    path = yarn_ckpt("qwen3_next_dense")
    # no token 0 in the prompt: generate would take it for padding (pad_token_id=0) and mask it
    prompt = torch.randint(1, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40,
                                      do_sample=False, pad_token_id=0)[0, 12:].tolist()
    llm = LLM(str(path), max_rows=4)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    assert out.token_ids == ref


def test_scaled_rope_stretches_the_context_as_vllm_derives_it(tmp_path):
    """``HybridConfig.max_context``: YaRN serves factor x original_max_position_embeddings,
    linear scaling factor x max_position_embeddings; a sequence past max_position_embeddings
    then runs, and its greedy tokens are transformers'."""
    model_type, over = KINDS["qwen3_next_dense"]
    cfg_cls, model_cls = _model_class(model_type)
    paths = {}
    for name, rope in (("yarn", {**MODELS["qwen3_next_dense"]}),
                       ("linear", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5})):
        torch.manual_seed(0)
        model = model_cls(cfg_cls(**{**BASE, **over, "max_position_embeddings": 32, "rope_parameters": rope}))
        paths[name] = tmp_path / name
        model.eval().save_pretrained(paths[name])
    assert load_config(str(paths["yarn"])).max_context == 4 * ORIGINAL == 64
    assert load_config(str(paths["linear"])).max_context == 2 * 32
    assert StageRunner(str(paths["yarn"]), max_rows=2).max_context == 64
    with pytest.raises(ValueError, match="max_context 65 is more than the checkpoint's 64 tokens"):
        StageRunner(str(paths["yarn"]), max_rows=2, max_context=65)
    prompt = torch.randint(1, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf_model(paths["yarn"]).generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                                               do_sample=False, pad_token_id=0)[0, 40:].tolist()
    out = LLM(str(paths["yarn"]), max_rows=2).generate([prompt], SamplingParams(temperature=0.0, max_tokens=20,
                                                                                 ignore_eos=True))[0]
    assert out.token_ids == ref  # 60 tokens, past max_position_embeddings 32
