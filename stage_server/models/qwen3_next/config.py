"""Qwen3-Next / Qwen3.5 configuration, read from a Hugging Face ``config.json``.

``model_type``: ``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text`` and the multimodal
wrappers ``qwen3_5`` / ``qwen3_5_moe`` (language model only: the text config under
``text_config``, weights under ``model.language_model.``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...fields import REQUIRED, CheckpointError, Fields, YarnScaling, rope_fields

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
# Activations served: the MLPs, the experts and the GDN conv all apply SiLU (swish).
HIDDEN_ACTS = ("silu", "swish")


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


def parse_config(path: str, raw: dict) -> HybridConfig:
    """The :class:`HybridConfig` of ``raw``, the parsed ``config.json`` at ``path``
    (``stage_server.config.load_config`` reads it and picks this family by ``model_type``).

    Fields absent from the file that would change the output without changing a weight's
    shape take transformers' defaults for the model type (``Qwen3NextConfig``,
    ``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig``): ``partial_rotary_factor`` 0.25,
    ``full_attention_interval`` 4, ``rms_norm_eps`` 1e-6, ``max_position_embeddings`` 32768. For the multimodal
    wrappers the top-level ``tie_word_embeddings`` decides when present (the language
    model head is the wrapper's), as in transformers.

    Raises:
        CheckpointError: unsupported ``rope_type``, ``hidden_act`` or layer type, a missing
            required field, or a field of the wrong type or out of range; the message names
            the file and the field.
    """
    model_type = raw["model_type"]
    top = Fields(path, raw)
    text, prefix = top, "model."
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        sub = raw.get("text_config")
        if not isinstance(sub, dict):
            raise CheckpointError(f"{path}: {model_type} needs a text_config object, got {sub!r}")
        text, prefix = Fields(path, sub, "text_config."), "model.language_model."
    rope = rope_fields(text, default_partial=0.25)
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
        rope_theta=rope.theta,
        partial_rotary_factor=rope.partial_rotary_factor,
        rope_type=rope.rope_type,
        rope_scaling_factor=rope.scaling_factor,
        rope_yarn=rope.yarn,
        max_position_embeddings=rope.max_position_embeddings,
        attention_bias=text.bool("attention_bias", False),
        linear_num_key_heads=text.int("linear_num_key_heads", lo=1),
        linear_num_value_heads=text.int("linear_num_value_heads", lo=1),
        linear_key_head_dim=text.int("linear_key_head_dim", lo=1),
        linear_value_head_dim=text.int("linear_value_head_dim", lo=1),
        linear_conv_kernel_dim=text.int("linear_conv_kernel_dim", 4, lo=1),
        intermediate_size=text.int("intermediate_size", 0, lo=0),
        num_experts=num_experts,
        num_experts_per_tok=text.int("num_experts_per_tok", REQUIRED if num_experts else 0, lo=1 if num_experts else 0),
        moe_intermediate_size=text.int("moe_intermediate_size", REQUIRED if num_experts else 0,
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
        raise CheckpointError(f"{path}: {text.where}layer_types: unsupported layer types {sorted(set(map(repr, bad)))}")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise CheckpointError(f"{path}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{path}: num_attention_heads must be a multiple of num_key_value_heads")
    if num_experts and cfg.num_experts_per_tok > num_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok ({cfg.num_experts_per_tok}) is above num_experts "
                              f"({num_experts})")
    return cfg
