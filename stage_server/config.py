"""Model configuration read from a Hugging Face ``config.json``.

Supported ``model_type``: ``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text`` and the
multimodal wrappers ``qwen3_5`` / ``qwen3_5_moe`` (language model only: the text config
under ``text_config``, weights under ``model.language_model.``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")


class CheckpointError(ValueError):
    """A checkpoint cannot be served: the message names the file and, where known, the tensor."""


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
    mtp_num_hidden_layers: int = 0
    # where the decoder's weights live in the checkpoint
    weight_prefix: str = "model."
    fused_gdn_projections: bool = False  # qwen3_next: in_proj_qkvz / in_proj_ba
    eos_token_ids: list[int] = field(default_factory=list)

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
        if self.model_type == "qwen3_next" and layer >= 0:
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return True


def load_config(model_dir: str) -> HybridConfig:
    """Parse ``model_dir/config.json``.

    Raises:
        CheckpointError: missing or unreadable config, unsupported ``model_type``, or a
            missing field; the message names the file.
    """
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (a Hugging Face checkpoint needs config.json)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse: {e}") from None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{path}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    text = raw
    prefix = "model."
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        text = dict(raw.get("text_config") or {})
        prefix = "model.language_model."
        for k in ("mtp_num_hidden_layers", "tie_word_embeddings"):
            if k in raw and k not in text:
                text[k] = raw[k]
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    try:
        n_layers = int(text["num_hidden_layers"])
        layer_types = list(text.get("layer_types") or [])
        if not layer_types:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
            ]
        hidden = int(text["hidden_size"])
        n_heads = int(text["num_attention_heads"])
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        cfg = HybridConfig(
            model_type=model_type,
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            hidden_act=text.get("hidden_act", "silu"),
            num_attention_heads=n_heads,
            num_key_value_heads=int(text.get("num_key_value_heads", n_heads)),
            head_dim=int(text.get("head_dim") or hidden // n_heads),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            attention_bias=bool(text.get("attention_bias", False)),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(text.get("intermediate_size") or 0),
            num_experts=int(text.get("num_experts") or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=int(text.get("decoder_sparse_step") or 1),
            mlp_only_layers=list(text.get("mlp_only_layers") or []),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers") or raw.get("mtp_num_hidden_layers") or 0),
            weight_prefix=prefix,
            fused_gdn_projections=model_type == "qwen3_next",
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: missing field {e.args[0]!r}") from None
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise CheckpointError(f"{path}: layer_types has {len(cfg.layer_types)} entries for {n_layers} layers")
    bad = set(cfg.layer_types) - {"linear_attention", "full_attention"}
    if bad:
        raise CheckpointError(f"{path}: unsupported layer types {sorted(bad)}")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise CheckpointError(f"{path}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    gen_path = os.path.join(model_dir, "generation_config.json")
    if not cfg.eos_token_ids and os.path.isfile(gen_path):
        try:
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            cfg.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        except (OSError, json.JSONDecodeError):
            pass
    return cfg
