"""Bamba configuration read from a Hugging Face ``config.json`` (``model_type`` ``bamba``), as
transformers 5.24's ``BambaConfig`` and ``modeling_bamba`` read it.

Layers are Mamba2 (``stage_server.layers.mamba2``) except those in ``attn_layer_indices``
(attention with RoPE over the first ``partial_rotary_factor`` of each head: ``BambaConfig``
sets 0.5 whatever the top level says, a ``rope_parameters`` object's own value counts);
every layer ends in a SwiGLU MLP. ``hidden_act`` is both the MLP's and the Mamba2 conv's
activation: SiLU only. ``time_step_limit`` clamps ``dt`` in the chunked scan (prefill)
only, as transformers does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...fields import CheckpointError, Fields, YarnScaling, mamba2_fields, rope_fields
from ..hybrid import ATTENTION, MAMBA

MODEL_TYPE = "bamba"


@dataclass
class BambaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: list[str]
    rms_norm_eps: float
    intermediate_size: int
    mlp_bias: bool
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_theta: float
    max_position_embeddings: int
    # Mamba2 (the names stage_server.layers.mamba2 reads: fields.mamba2_fields)
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool
    dt_limit: tuple[float, float]
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    # RoPE (layers.rotary.rope_frequencies)
    partial_rotary_factor: float = 0.5
    rope_type: str = "default"
    rope_scaling_factor: float = 1.0
    rope_yarn: YarnScaling | None = None
    use_rope: bool = True
    weight_prefix: str = "model."

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    @property
    def conv_dim(self) -> int:
        """Channels of the Mamba2 conv: x, B and C, ``H P + 2 G N``."""
        return self.mamba_num_heads * self.mamba_head_dim + 2 * self.n_groups * self.ssm_state_size


def load_bamba_config(path: str, raw: dict) -> BambaConfig:
    """Parse the ``config.json`` dict ``raw`` of a ``bamba`` checkpoint (defaults of absent
    fields: transformers 5.24's ``BambaConfig``).

    Raises:
        CheckpointError: a missing required field, a value of the wrong type or out of
            range, or a setting not served (an activation other than SiLU, a
            ``quantization_config``, an attention layer index outside the model, Mamba
            sizes that do not match); the message names the file and the field.
    """
    f = Fields(path, raw)
    if raw.get("quantization_config") is not None:
        raise CheckpointError(f"{path}: quantization_config is not supported (fp32 / bf16 weights only)")
    act = f.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported; supported: 'silu'")
    hidden = f.int("hidden_size", 4096, lo=1)
    n_layers = f.int("num_hidden_layers", 32, lo=1)
    attn = f.ints("attn_layer_indices", lo=0, scalar=False)
    if any(i >= n_layers for i in attn):
        raise CheckpointError(f"{path}: attn_layer_indices {attn} has an index not below num_hidden_layers "
                              f"({n_layers})")
    n_heads = f.int("num_attention_heads", 32, lo=1)
    # BambaConfig passes partial_rotary_factor 0.5 over any top-level value
    rope = rope_fields(Fields(path, {k: v for k, v in raw.items() if k != "partial_rotary_factor"}),
                       default_partial=0.5, default_max_pos=262144)
    cfg = BambaConfig(
        model_type=MODEL_TYPE,
        vocab_size=f.int("vocab_size", 128000, lo=1),
        hidden_size=hidden,
        layer_types=[ATTENTION if i in attn else MAMBA for i in range(n_layers)],
        rms_norm_eps=f.float("rms_norm_eps", 1e-5, positive=True),
        intermediate_size=f.int("intermediate_size", 14336, lo=1),
        mlp_bias=f.bool("mlp_bias", False),
        num_attention_heads=n_heads,
        # absent: BambaConfig's default 8; null: one KV head per query head, as BambaConfig
        num_key_value_heads=n_heads if raw.get("num_key_value_heads", 8) is None else f.int("num_key_value_heads", 8, lo=1),
        head_dim=f.int("head_dim", hidden // n_heads, lo=1),
        attention_bias=f.bool("attention_bias", False),
        rope_theta=rope.theta,
        max_position_embeddings=rope.max_position_embeddings,
        **mamba2_fields(f, hidden),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        eos_token_ids=f.ints("eos_token_id", lo=0),
        partial_rotary_factor=rope.partial_rotary_factor,
        rope_type=rope.rope_type,
        rope_scaling_factor=rope.scaling_factor,
        rope_yarn=rope.yarn,
    )
    if n_heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{path}: num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads "
                              f"({cfg.num_key_value_heads})")
    return cfg
