"""Model configuration read from a Hugging Face ``config.json``.

Supported ``model_type``: ``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text`` and the
multimodal wrappers ``qwen3_5`` / ``qwen3_5_moe`` (language model only: the text config
under ``text_config``, weights under ``model.language_model.``). ``kimi_linear`` is read by its
family's folder (``stage_server/families``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

PAGE_SIZE = 16  # tokens per KV page of a stage's pools (StageRunner's default)

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "kimi_linear")


class CheckpointError(ValueError):
    """A checkpoint cannot be served: the message names the file and, where known, the tensor."""


@dataclass(frozen=True)
class YarnScaling:
    """The fields of a ``rope_type: yarn`` config, resolved as transformers'
    ``_compute_yarn_parameters`` resolves them (the formula itself is
    ``model.rope_frequencies``): ``factor`` null is ``max_position_embeddings /
    original_max_position_embeddings``; ``beta_fast`` / ``beta_slow`` default to 32 / 1;
    ``mscale`` and ``mscale_all_dim`` count only when both are set and non-zero;
    ``attention_factor`` None means derived from ``factor`` (and the two mscales)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass
class HybridConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    rms_norm_eps: float
    hidden_act: str
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    attention_bias: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP / MoE
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    tie_word_embeddings: bool = False
    # None: config.json does not say (Qwen3-Next's does not): the checkpoint's mtp.* tensors decide
    mtp_num_hidden_layers: int | None = 0
    rope_type: str = "default"  # one of ROPE_TYPES
    rope_scaling_factor: float = 1.0  # linear RoPE scaling only; 1.0 = none (YaRN's is rope_yarn.factor)
    rope_yarn: YarnScaling | None = None  # rope_type "yarn" only
    # whether the MTP layer's MLP is the sparse MoE block: None = as the decoder layers'
    # config says (every layer MoE when num_experts > 0); the loader sets it from the
    # checkpoint's mtp.* tensors, which config.json does not describe
    mtp_is_moe: bool | None = None
    # where the decoder's weights live in the checkpoint
    weight_prefix: str = "model."
    fused_gdn_projections: bool = False  # qwen3_next: in_proj_qkvz / in_proj_ba
    eos_token_ids: list[int] = field(default_factory=list)
    # what a family states about its pools (stage_server/families): the linear layers' replay
    # buffers keep the log decay per key channel (KDA); the KV pool holds keys and values as
    # one tensor (MLA's latent); the stage may capture CUDA graphs of its steps
    per_channel_gate: bool = False
    shared_kv: bool = False
    cuda_graphs: bool = True

    @property
    def max_context(self) -> int:
        """Longest sequence (tokens) the checkpoint serves: ``max_position_embeddings``,
        stretched by RoPE scaling as vLLM derives it (``_get_and_verify_max_len``): YaRN
        serves ``factor x original_max_position_embeddings``, linear scaling
        ``factor x max_position_embeddings``."""
        if self.rope_yarn is not None:
            return max(self.max_position_embeddings,
                       int(self.rope_yarn.factor * self.rope_yarn.original_max_position_embeddings))
        return max(self.max_position_embeddings, int(self.rope_scaling_factor * self.max_position_embeddings))

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (or the MTP layer, ``layer = -1``) uses the sparse MoE block."""
        if self.num_experts <= 0:
            return False
        if layer < 0 and self.mtp_is_moe is not None:
            return self.mtp_is_moe
        if self.model_type == "qwen3_next" and layer >= 0:
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return True


_REQUIRED = object()


class _Fields:
    """Typed reads of one ``config.json`` dict: a missing required field, a value of the
    wrong type or outside its range raises :class:`CheckpointError` naming the file and
    the field (``bool`` is not taken for a number)."""

    def __init__(self, path: str, d: dict, where: str = ""):
        self.path, self.d, self.where = path, d, where

    def _bad(self, key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {self.where}{key} {why}")

    def get(self, key: str, default=_REQUIRED):
        v = self.d.get(key)
        if v is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.path}: missing field {self.where + key!r}")
            return default
        return v

    def int(self, key: str, default=_REQUIRED, lo: int | None = None) -> int:
        v = self.get(key, default)
        if v is None:  # absent, and None is its default
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(key, f"must be an integer, got {v!r}")
        if lo is not None and v < lo:
            raise self._bad(key, f"must be at least {lo}, got {v}")
        return v

    def float(self, key: str, default=_REQUIRED, positive: bool = False, lo: float | None = None) -> float:
        v = self.get(key, default)
        if v is None:  # absent, and None is its default
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
            raise self._bad(key, f"must be a finite number, got {v!r}")
        if positive and v <= 0:
            raise self._bad(key, f"must be positive, got {v}")
        if lo is not None and v < lo:
            raise self._bad(key, f"must be at least {lo}, got {v}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, f"must be true or false, got {v!r}")
        return v

    def ints(self, key: str, lo: int | None = None, scalar: bool = True) -> list[int]:
        """A list of integers, or [] when absent; with ``scalar`` one integer is a list of
        one (``eos_token_id``)."""
        v = self.get(key, [])
        vals = [v] if scalar and isinstance(v, int) and not isinstance(v, bool) else v
        if not isinstance(vals, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in vals):
            raise self._bad(key, f"must be {'an integer or ' if scalar else ''}a list of integers, got {v!r}")
        if lo is not None and any(x < lo for x in vals):
            raise self._bad(key, f"must be at least {lo}, got {v!r}")
        return list(vals)


# RoPE variants served: ``default``; ``linear`` (position interpolation: Chen et al.
# 2023, "Extending Context Window of Large Language Models via Positional Interpolation";
# inverse frequencies divided by ``factor``, as transformers'
# ``_compute_linear_scaling_rope_parameters``); ``yarn`` (Peng et al. 2023, "YaRN:
# Efficient Context Window Extension of Large Language Models": fields read by
# ``_yarn_fields``, frequencies and attention factor by ``model.rope_frequencies``). Other
# types (``dynamic``, ``longrope``, ``llama3``, ...) are refused by name. The mrope fields
# of Qwen3.5 (``mrope_section``, ``mrope_interleaved``; ``type: mrope`` in older configs)
# are ignored: for text, every section's position is the token's position, which is the
# plain rotation.
ROPE_TYPES = ("default", "linear", "yarn")
# Activations served: the MLPs, the experts and the GDN conv all apply SiLU (swish).
HIDDEN_ACTS = ("silu", "swish")


def _yarn_fields(rope: _Fields, text: _Fields, max_position_embeddings: int) -> YarnScaling:
    """The ``yarn`` fields of ``rope`` (the rope_parameters / rope_scaling object) as
    transformers 5's ``_compute_yarn_parameters`` reads them: ``factor`` must be present
    (null: ``max_position_embeddings / original_max_position_embeddings``);
    ``original_max_position_embeddings`` is the text config's top-level field when it has
    one (transformers gives that priority, for Phi-3), else the object's, else
    ``max_position_embeddings``; ``beta_fast`` / ``beta_slow`` null or 0 are 32 / 1;
    ``mscale`` / ``mscale_all_dim`` null or 0 are unset; ``truncate`` defaults to true.
    Unlike transformers, which only warns, ``beta_fast`` below ``beta_slow`` is refused."""
    if "factor" not in rope.d:
        raise CheckpointError(f"{rope.path}: missing field {rope.where + 'factor'!r} (rope_type yarn)")
    omp = text.int("original_max_position_embeddings", None, lo=1)
    if omp is None:
        omp = rope.int("original_max_position_embeddings", max_position_embeddings, lo=1)
    factor = rope.float("factor", None, positive=True)
    if factor is None:
        factor = max_position_embeddings / omp
    beta_fast = rope.float("beta_fast", 0.0, lo=0.0) or 32.0
    beta_slow = rope.float("beta_slow", 0.0, lo=0.0) or 1.0
    if beta_fast < beta_slow:
        raise rope._bad("beta_fast", f"({beta_fast}) must be at least beta_slow ({beta_slow})")
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=omp,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        mscale=rope.float("mscale", 0.0, lo=0.0) or None,
        mscale_all_dim=rope.float("mscale_all_dim", 0.0, lo=0.0) or None,
        attention_factor=rope.float("attention_factor", None, positive=True),
        truncate=rope.bool("truncate", True),
    )


def load_config(model_dir: str) -> HybridConfig:
    """Parse ``model_dir/config.json``.

    Fields absent from the file that would change the output without changing a weight's
    shape take transformers' defaults for the model type (``Qwen3NextConfig``,
    ``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig``): ``partial_rotary_factor`` 0.25,
    ``full_attention_interval`` 4, ``rms_norm_eps`` 1e-6, ``max_position_embeddings`` 32768. For the multimodal
    wrappers the top-level ``tie_word_embeddings`` decides when present (the language
    model head is the wrapper's), as in transformers.

    Raises:
        CheckpointError: missing or unreadable config, unsupported ``model_type``,
            ``rope_type`` or ``hidden_act``, a missing required field, or a field of the wrong
            type or out of range; the message names the file and the field.
    """
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (a Hugging Face checkpoint needs config.json)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    from .families import family

    fam = family(model_type) if isinstance(model_type, str) else None
    if fam is not None:  # a family of its own folder
        return fam.load_config(path, raw)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{path}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    top = _Fields(path, raw)
    text, prefix = top, "model."
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        sub = raw.get("text_config")
        if not isinstance(sub, dict):
            raise CheckpointError(f"{path}: {model_type} needs a text_config object, got {sub!r}")
        text, prefix = _Fields(path, sub, "text_config."), "model.language_model."
    rope_d = text.d.get("rope_parameters") or text.d.get("rope_scaling") or {}
    if not isinstance(rope_d, dict):
        raise CheckpointError(f"{path}: {text.where}rope_parameters must be an object, got {rope_d!r}")
    rope = _Fields(path, rope_d, text.where + "rope_parameters.")
    rope_type = rope_d.get("rope_type", rope_d.get("type")) or "default"
    if rope_type == "mrope":  # the older spelling of multimodal RoPE (Qwen2-VL): default for text
        rope_type = "default"
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{path}: rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    act = text.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise CheckpointError(f"{path}: {text.where}hidden_act {act!r} is not supported; supported: "
                              f"{', '.join(HIDDEN_ACTS)}")

    n_layers = text.int("num_hidden_layers", lo=1)
    layer_types = text.get("layer_types", None)
    if layer_types is None or layer_types == []:
        interval = text.int("full_attention_interval", 4, lo=1)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list):
        raise CheckpointError(f"{path}: {text.where}layer_types must be a list, got {layer_types!r}")
    hidden = text.int("hidden_size", lo=1)
    n_heads = text.int("num_attention_heads", lo=1)
    num_experts = text.int("num_experts", 0, lo=0)
    mlp_only = text.ints("mlp_only_layers", scalar=False)
    max_pos = text.int("max_position_embeddings", 32768, lo=1)
    tie = top.bool("tie_word_embeddings", False) if text is not top and "tie_word_embeddings" in raw else None
    cfg = HybridConfig(
        model_type=model_type,
        vocab_size=text.int("vocab_size", lo=1),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=list(layer_types),
        rms_norm_eps=text.float("rms_norm_eps", 1e-6, positive=True),
        hidden_act=act,
        num_attention_heads=n_heads,
        num_key_value_heads=text.int("num_key_value_heads", n_heads, lo=1),
        head_dim=text.int("head_dim", hidden // n_heads, lo=1),
        rope_theta=rope.float("rope_theta", text.float("rope_theta", 10000.0, positive=True), positive=True),
        partial_rotary_factor=rope.float("partial_rotary_factor",
                                         text.float("partial_rotary_factor", 0.25, positive=True), positive=True),
        rope_type=rope_type,
        rope_scaling_factor=rope.float("factor", positive=True) if rope_type == "linear" else 1.0,
        rope_yarn=_yarn_fields(rope, text, max_pos) if rope_type == "yarn" else None,
        max_position_embeddings=max_pos,
        attention_bias=text.bool("attention_bias", False),
        linear_num_key_heads=text.int("linear_num_key_heads", lo=1),
        linear_num_value_heads=text.int("linear_num_value_heads", lo=1),
        linear_key_head_dim=text.int("linear_key_head_dim", lo=1),
        linear_value_head_dim=text.int("linear_value_head_dim", lo=1),
        linear_conv_kernel_dim=text.int("linear_conv_kernel_dim", 4, lo=1),
        intermediate_size=text.int("intermediate_size", 0, lo=0),
        num_experts=num_experts,
        num_experts_per_tok=text.int("num_experts_per_tok", _REQUIRED if num_experts else 0, lo=1 if num_experts else 0),
        moe_intermediate_size=text.int("moe_intermediate_size", _REQUIRED if num_experts else 0,
                                       lo=1 if num_experts else 0),
        shared_expert_intermediate_size=text.int("shared_expert_intermediate_size", 0, lo=0),
        # transformers' Qwen3.5-MoE router always renormalises its top-k weights; only
        # Qwen3-Next reads the flag
        norm_topk_prob=text.bool("norm_topk_prob", True) if model_type == "qwen3_next" else True,
        decoder_sparse_step=text.int("decoder_sparse_step", 1, lo=1),
        mlp_only_layers=list(mlp_only),
        tie_word_embeddings=tie if tie is not None else text.bool("tie_word_embeddings", False),
        mtp_num_hidden_layers=text.int("mtp_num_hidden_layers", top.int("mtp_num_hidden_layers", None, lo=0), lo=0),
        weight_prefix=prefix,
        fused_gdn_projections=model_type == "qwen3_next",
        eos_token_ids=top.ints("eos_token_id", lo=0) or text.ints("eos_token_id", lo=0),
    )
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise CheckpointError(f"{path}: layer_types has {len(cfg.layer_types)} entries for {n_layers} layers")
    bad = [t for t in cfg.layer_types if t not in ("linear_attention", "full_attention")]
    if bad:
        raise CheckpointError(f"{path}: unsupported layer types {sorted(set(map(repr, bad)))}")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise CheckpointError(f"{path}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{path}: num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.partial_rotary_factor > 1:
        raise CheckpointError(f"{path}: partial_rotary_factor must be in (0, 1], got {cfg.partial_rotary_factor}")
    if cfg.rope_type == "yarn" and cfg.rope_theta <= 1:  # YaRN divides by log(rope_theta)
        raise CheckpointError(f"{path}: rope_theta must be above 1 for rope_type yarn, got {cfg.rope_theta}")
    if num_experts and cfg.num_experts_per_tok > num_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok ({cfg.num_experts_per_tok}) is above num_experts "
                              f"({num_experts})")
    gen_path = os.path.join(model_dir, "generation_config.json")
    if not cfg.eos_token_ids and os.path.isfile(gen_path):
        try:
            with open(gen_path) as f:
                gen = json.load(f)
            if isinstance(gen, dict):
                cfg.eos_token_ids = _Fields(gen_path, gen).ints("eos_token_id", lo=0)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            pass
    return cfg
