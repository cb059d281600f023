"""config.json as transformers reads it: fields that change the output without changing a
weight's shape (tied embeddings of the multimodal wrappers, RoPE scaling, defaults of absent
fields, the MoE router's renormalisation) give transformers' tokens, and a field ppspec
cannot serve, or a bad value, is one CheckpointError naming the file and the field."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.config import CheckpointError, load_config
from ppspec.stage_server.loader import load_stage_model

from checkpoints import BASE

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 9, 31]
N_NEW = 24


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _hf_greedy(model, prompt=PROMPT, n=N_NEW):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _ppspec_greedy(path, prompt=PROMPT, n=N_NEW, **kw):
    llm = LLM(str(path), max_rows=4, **kw)
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].token_ids


def _edit(src, dst, fn):
    """Copy checkpoint ``src`` to ``dst`` with ``fn(config dict)`` applied to config.json
    (in place, or the JSON value ``fn`` returns instead when not None)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg = fn(cfg) or cfg
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _text_model(tmp_path, name, **over):
    """A random qwen3_5_text checkpoint written by transformers, with config overrides."""
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(**{**BASE, "num_hidden_layers": 4, "linear_num_value_heads": 4,
                               "intermediate_size": 96, **over})
    model = Qwen3_5ForCausalLM(cfg).eval()
    path = tmp_path / name
    model.save_pretrained(path)
    return path, model


def test_multimodal_wrapper_ties_embeddings_by_its_top_level_flag(tmp_path):
    # transformers writes tie_word_embeddings at the top level of a Qwen3.5 wrapper (the head
    # is the wrapper's) and leaves text_config's at its default, false; lm_head.weight is
    # not saved
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    text = {**BASE, "num_hidden_layers": 4, "linear_num_value_heads": 4, "intermediate_size": 96}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=BASE["hidden_size"],
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    model = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)).eval()
    path = tmp_path / "mm_tied"
    model.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    assert raw["tie_word_embeddings"] is True and raw["text_config"].get("tie_word_embeddings") is not True
    assert load_config(str(path)).tie_word_embeddings
    assert _ppspec_greedy(path) == _hf_greedy(model)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    path, model = _text_model(tmp_path, "rope_linear", rope_parameters={
        "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    cfg = load_config(str(path))
    assert cfg.rope_scaling_factor == 4.0
    ref = _hf_greedy(model)
    assert _ppspec_greedy(path) == ref
    # the factor matters on this checkpoint: without it the tokens differ
    plain = _edit(path, tmp_path / "rope_plain", lambda c: c["rope_parameters"].update(rope_type="default"))
    assert _ppspec_greedy(plain) != ref


def test_multimodal_rope_fields_are_plain_rope_for_text(tmp_path, make_ckpt):
    """mrope sections (and the older ``type: mrope`` spelling) rotate text tokens as plain
    RoPE: the same tokens as the checkpoint without them."""
    src = make_ckpt("qwen3_5_ratio1")
    ref = _ppspec_greedy(src)

    def mrope(c):
        c["rope_parameters"].update(mrope_section=[1, 1, 0], mrope_interleaved=True)

    def old_style(c):
        theta = c["rope_parameters"]["rope_theta"]
        c["rope_parameters"] = None
        c["rope_scaling"] = {"type": "mrope", "mrope_section": [1, 1, 0]}
        c["rope_theta"] = theta

    for name, fn in (("mrope", mrope), ("old_mrope", old_style)):
        assert _ppspec_greedy(_edit(src, tmp_path / name, fn)) == ref, name


def test_absent_partial_rotary_factor_takes_the_transformers_default(tmp_path, make_ckpt):
    src = make_ckpt("qwen3_5_ratio1")

    def drop(c):
        c.pop("partial_rotary_factor", None)
        c.get("rope_parameters", {}).pop("partial_rotary_factor", None)

    path = _edit(src, tmp_path / "no_prf", drop)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["partial_rotary_factor"] == load_config(str(path)).partial_rotary_factor == 0.25
    assert _ppspec_greedy(path) == _hf_greedy(hf)


def test_qwen3_5_moe_router_renormalises_whatever_norm_topk_prob_says(tmp_path, make_ckpt):
    src = make_ckpt("qwen3_5_moe")
    path = _edit(src, tmp_path / "moe_ntp", lambda c: c.update(norm_topk_prob=False))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert load_config(str(path)).norm_topk_prob
    assert _ppspec_greedy(path) == _hf_greedy(hf)


def _set(*keys_value):
    *keys, value = keys_value

    def fn(c):
        d = c
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
    return fn


_DROP = object()


def _yarn(**fields):
    """Make rope_parameters a valid YaRN object, then apply ``fields`` (``_DROP`` removes one)."""
    def fn(c):
        rope = c["rope_parameters"]
        rope.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
        for k, v in fields.items():
            if v is _DROP:
                del rope[k]
            else:
                rope[k] = v
    return fn


BAD = {
    # name: (edit, message pattern)
    "old_rope_scaling": (lambda c: c.update(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}),
                         r"rope_type 'dynamic' is not supported"),
    "dynamic": (_yarn(rope_type="dynamic"), r"rope_type 'dynamic' is not supported"),
    "longrope": (_yarn(rope_type="longrope"), r"rope_type 'longrope' is not supported"),
    "llama3": (_yarn(rope_type="llama3"), r"rope_type 'llama3' is not supported"),
    "yarn_without_factor": (_yarn(factor=_DROP), r"missing field 'rope_parameters\.factor'"),
    "yarn_factor_string": (_yarn(factor="4"), r"rope_parameters\.factor must be a finite number, got '4'"),
    "yarn_factor_zero": (_yarn(factor=0), r"rope_parameters\.factor must be positive, got 0"),
    "yarn_original_float": (_yarn(original_max_position_embeddings=16.5),
                            r"rope_parameters\.original_max_position_embeddings must be an integer, got 16\.5"),
    "yarn_original_zero": (_yarn(original_max_position_embeddings=0),
                           r"rope_parameters\.original_max_position_embeddings must be at least 1, got 0"),
    "yarn_beta_fast_negative": (_yarn(beta_fast=-1), r"rope_parameters\.beta_fast must be at least 0\.0, got -1"),
    "yarn_beta_slow_bool": (_yarn(beta_slow=True), r"rope_parameters\.beta_slow must be a finite number, got True"),
    "yarn_betas_crossed": (_yarn(beta_fast=2, beta_slow=4),
                           r"rope_parameters\.beta_fast \(2\.0\) must be at least beta_slow \(4\.0\)"),
    "yarn_mscale_nan": (_yarn(mscale=float("nan")), r"rope_parameters\.mscale must be a finite number, got nan"),
    "yarn_mscale_all_dim_negative": (_yarn(mscale_all_dim=-0.5),
                                     r"rope_parameters\.mscale_all_dim must be at least 0\.0, got -0\.5"),
    "yarn_attention_factor_zero": (_yarn(attention_factor=0.0),
                                   r"rope_parameters\.attention_factor must be positive, got 0\.0"),
    "yarn_truncate_string": (_yarn(truncate="false"), r"rope_parameters\.truncate must be true or false, got 'false'"),
    "yarn_theta_one": (_yarn(rope_theta=1.0), r"rope_theta must be above 1 for rope_type yarn, got 1\.0"),
    "linear_without_factor": (_set("rope_parameters", "rope_type", "linear"), r"missing field 'rope_parameters\.factor'"),
    "gelu": (_set("hidden_act", "gelu"), r"hidden_act 'gelu' is not supported"),
    "null_hidden_size": (_set("hidden_size", None), r"missing field 'hidden_size'"),
    "str_hidden_size": (_set("hidden_size", "sixty-four"), r"hidden_size must be an integer, got 'sixty-four'"),
    "float_layers": (_set("num_hidden_layers", 4.5), r"num_hidden_layers must be an integer"),
    "zero_layers": (_set("num_hidden_layers", 0), r"num_hidden_layers must be at least 1, got 0"),
    "zero_key_heads": (_set("linear_num_key_heads", 0), r"linear_num_key_heads must be at least 1"),
    "kv_heads_not_dividing": (_set("num_key_value_heads", 3), r"multiple of num_key_value_heads"),
    "bool_eps": (_set("rms_norm_eps", True), r"rms_norm_eps must be a finite number"),
    "negative_eps": (_set("rms_norm_eps", -1e-6), r"rms_norm_eps must be positive"),
    "eos_string": (_set("eos_token_id", "2"), r"eos_token_id must be an integer or a list of integers, got '2'"),
    "layer_types_string": (_set("layer_types", "linear_attention"), r"layer_types must be a list"),
    "layer_types_nested": (_set("layer_types", [["full_attention"]] * 4), r"unsupported layer types"),
    "tie_string": (_set("tie_word_embeddings", "yes"), r"tie_word_embeddings must be true or false"),
    "rotary_above_one": (_set("rope_parameters", "partial_rotary_factor", 2.0), r"partial_rotary_factor must be in"),
    "config_is_a_list": (lambda c: [c], r"must hold a JSON object, got list"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_config_values_are_one_checkpoint_error_naming_the_field(tmp_path, make_ckpt, name):
    edit, pattern = BAD[name]
    path = _edit(make_ckpt("qwen3_5_ratio1"), tmp_path / name, edit)
    with pytest.raises(CheckpointError, match=r"config\.json: .*" + pattern):
        load_config(str(path))


def test_moe_config_values_are_checked(tmp_path, make_ckpt):
    src = make_ckpt("qwen3_5_moe")
    path = _edit(src, tmp_path / "topk", _set("num_experts_per_tok", 5))
    with pytest.raises(CheckpointError, match=r"num_experts_per_tok \(5\) is above num_experts \(4\)"):
        load_config(str(path))
    path = _edit(src, tmp_path / "no_topk", lambda c: c.pop("num_experts_per_tok") and None)
    with pytest.raises(CheckpointError, match=r"missing field 'num_experts_per_tok'"):
        load_config(str(path))


def test_non_finite_weights_are_refused_at_load(tmp_path, make_ckpt):
    from safetensors.torch import load_file, save_file

    src = make_ckpt("qwen3_5_ratio1")
    path = tmp_path / "nan"
    shutil.copytree(src, path)
    w = load_file(path / "model.safetensors")
    w["model.layers.0.linear_attn.out_proj.weight"][3, 5] = float("nan")
    save_file(w, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.linear_attn\.out_proj"
                                              r"\.weight' has NaN or infinite values"):
        load_stage_model(str(path))
    # a layer range that does not hold the tensor loads
    load_stage_model(str(path), start=1, end=4)
    # finite in fp32, infinite once cast to fp16
    path = tmp_path / "overflow"
    shutil.copytree(src, path)
    w = load_file(path / "model.safetensors")
    w["model.norm.weight"][0] = 1e6
    save_file(w, path / "model.safetensors")
    load_stage_model(str(path))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has NaN or infinite values in float16"):
        load_stage_model(str(path), dtype=torch.float16)


def test_serve_reports_a_bad_config_value_in_one_line(tmp_path, make_ckpt):
    path = _edit(make_ckpt("qwen3_5_ratio1"), tmp_path / "bad", _set("hidden_size", None))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = subprocess.run([sys.executable, "-m", "ppspec.cli", "serve", "--model", str(path), "--port", str(port)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert "config.json: missing field 'hidden_size'" in p.stderr


def test_mtp_layer_mlp_kind_comes_from_its_weights(make_ckpt):
    """Qwen3-Next with experts configured but every decoder layer dense (mlp_only_layers):
    config.json does not say what the MTP layer's MLP is; its tensors do (here a dense
    one, copied from an attention layer). MTP drafts leave greedy tokens unchanged."""
    from transformers import AutoModelForCausalLM

    path = make_ckpt("qwen3_next_dense")
    from safetensors import safe_open

    keys = set(safe_open(f"{path}/model.safetensors", "pt").keys())
    assert "mtp.layers.0.mlp.gate_proj.weight" in keys and "mtp.layers.0.mlp.gate.weight" not in keys
    assert load_config(path).num_experts > 0
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert _ppspec_greedy(path, speculative_algorithm="mtp") == _hf_greedy(hf)


def test_mtp_head_found_by_its_tensors_when_config_does_not_state_it(tmp_path, make_ckpt):
    """Published Qwen3-Next config.json files have no mtp_num_hidden_layers although the
    checkpoint carries the mtp.* head: the tensors decide; an explicit 0 turns it off."""
    from transformers import AutoModelForCausalLM

    src = make_ckpt("qwen3_next_moe")
    path = _edit(src, tmp_path / "unstated", lambda c: c.pop("mtp_num_hidden_layers") and None)
    assert load_config(str(path)).mtp_num_hidden_layers is None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), max_rows=4, speculative_algorithm="mtp")
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))[0]
    assert out.token_ids == _hf_greedy(hf) and out.accept_lengths  # the head drafted
    off = _edit(src, tmp_path / "zero", _set("mtp_num_hidden_layers", 0))
    with pytest.raises(ValueError, match="mtp needs an mtp"):
        LLM(str(off), max_rows=4, speculative_algorithm="mtp")


def test_generation_config_eos_ids_end_requests_as_in_transformers(tmp_path):
    """transformers' generate stops on generation_config.json's eos_token_id (the demo's:
    <|im_end|> and <|endoftext|>) and vLLM adds its ids to the stop tokens; config.json names
    one of them. Every one ends a request here too, config.json's first."""
    from transformers import GenerationConfig

    from ppspec.router.llm import DEMO_MODEL

    want = GenerationConfig.from_pretrained(DEMO_MODEL).eos_token_id
    with open(os.path.join(DEMO_MODEL, "config.json")) as f:
        first = json.load(f)["eos_token_id"]
    cfg = load_config(DEMO_MODEL)
    assert len(want) == 2 and cfg.eos_token_ids[0] == first and sorted(cfg.eos_token_ids) == sorted(want)
    other = next(t for t in want if t != first)
    llm = LLM(DEMO_MODEL, max_rows=2)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[other]))[0]
    assert out.token_ids == [other] and out.finish_reason == "stop"
    # a generation_config.json without eos_token_id leaves config.json's alone
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DEMO_MODEL, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert load_config(str(ckpt)).eos_token_ids == [first]
