"""Granite 4.0 hybrid configuration read from a Hugging Face ``config.json`` (``model_type``
``granitemoehybrid``), as transformers 5.24's ``GraniteMoeHybridConfig`` and
``modeling_granitemoehybrid`` read it.

Layers (``layer_types`` / ``layers_block_type``: ``linear_attention`` or ``mamba``, and
``full_attention`` or ``attention``) are ``x + m * mixer(rmsnorm(x))`` then ``x + m *
ffn(rmsnorm(x))``, the mixer a Mamba2 layer (``stage_server.layers.mamba2``) or attention
(RoPE when ``position_embedding_type`` is ``rope``, none otherwise; softmax scale
``attention_multiplier``), the FFN a shared SwiGLU MLP plus, with ``num_local_experts > 0``,
a top-k softmax MoE of SwiGLU experts; ``m = residual_multiplier``, the embedding times
``embedding_multiplier``, the logits divided by ``logits_scaling``. ``time_step_limit``
clamps ``dt`` in the chunked scan (prefill) only, as transformers does.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...fields import CheckpointError, Fields, mamba2_fields, rope_fields
from ..hybrid_config import Mamba2HybridConfig, check_heads, refuse_unserved, rope_config

MODEL_TYPE = "granitemoehybrid"
_KINDS = {"linear_attention": "linear_attention", "mamba": "linear_attention",
          "full_attention": "full_attention", "attention": "full_attention"}


@dataclass(kw_only=True)
class GraniteHybridConfig(Mamba2HybridConfig):
    # FFN
    shared_intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # multipliers
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @property
    def logits_multiplier(self) -> float:
        return 1.0 / self.logits_scaling


def load_granite_config(path: str, raw: dict) -> GraniteHybridConfig:
    """Parse the ``config.json`` dict ``raw`` of a ``granitemoehybrid`` checkpoint (defaults
    of absent fields: transformers 5.24's ``GraniteMoeHybridConfig``).

    Raises:
        CheckpointError: a missing required field, a value of the wrong type or out of
            range, or a setting not served (an activation other than SiLU, a
            ``quantization_config``, an unknown layer type, Mamba sizes that do not match);
            the message names the file and the field.
    """
    f = Fields(path, raw)
    refuse_unserved(f)
    hidden = f.int("hidden_size", 4096, lo=1)
    n_layers = f.int("num_hidden_layers", 32, lo=1)
    kinds = raw.get("layer_types", raw.get("layers_block_type"))
    if kinds is None:
        kinds = ["linear_attention"] * n_layers
    if not isinstance(kinds, list) or not kinds:
        raise CheckpointError(f"{path}: layer_types must be a non-empty list, got {kinds!r}")
    bad = sorted({repr(k) for k in kinds if k not in _KINDS})
    if bad:
        raise CheckpointError(f"{path}: layer_types has unsupported layer types {bad}; supported: "
                              f"{', '.join(_KINDS)}")
    n_heads = f.int("num_attention_heads", 32, lo=1)
    pos = raw.get("position_embedding_type")
    # transformers: RoPE for "rope", no positional encoding otherwise; its documented values
    # are null and "rope", and Granite 4.0-H checkpoints write "nope"
    if pos not in (None, "rope", "nope"):
        raise CheckpointError(f"{path}: position_embedding_type {pos!r} is not supported; supported: 'rope', "
                              "'nope', null")
    rope = rope_fields(f, default_partial=1.0, default_max_pos=2048)
    n_experts = f.int("num_local_experts", 8, lo=0)
    cfg = GraniteHybridConfig(
        model_type=MODEL_TYPE,
        vocab_size=f.int("vocab_size", 32000, lo=1),
        hidden_size=hidden,
        layer_types=[_KINDS[k] for k in kinds],
        rms_norm_eps=f.float("rms_norm_eps", 1e-6, positive=True),
        num_attention_heads=n_heads,
        num_key_value_heads=f.int("num_key_value_heads", n_heads, lo=1),
        head_dim=hidden // n_heads,
        attention_bias=f.bool("attention_bias", False),
        use_rope=pos == "rope",
        **rope_config(rope),
        **mamba2_fields(f, hidden),
        shared_intermediate_size=f.int("shared_intermediate_size", 1024, lo=1),
        num_experts=n_experts,
        num_experts_per_tok=f.int("num_experts_per_tok", 2, lo=1) if n_experts else 0,
        moe_intermediate_size=f.int("intermediate_size", 11008, lo=1) if n_experts else 0,
        embedding_multiplier=f.float("embedding_multiplier", 1.0),
        residual_multiplier=f.float("residual_multiplier", 1.0),
        attention_multiplier=f.float("attention_multiplier", 1.0),
        logits_scaling=f.float("logits_scaling", 1.0, positive=True),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        eos_token_ids=f.ints("eos_token_id", lo=0),
    )
    if hidden % n_heads:
        raise CheckpointError(f"{path}: num_attention_heads ({n_heads}) must divide hidden_size ({hidden})")
    check_heads(f, cfg)
    if n_experts and cfg.num_experts_per_tok > n_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok ({cfg.num_experts_per_tok}) is above "
                              f"num_local_experts ({n_experts})")
    return cfg
