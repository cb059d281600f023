"""What the configs of the Mamba2 + attention hybrids that name their mixer fields
``mamba_*`` (Granite 4.0 hybrid, Bamba, Falcon-H1) share: the fields a
:class:`~.hybrid.HybridStageModel` and ``stage_server.layers.mamba2`` read, the refusals
every one of them makes, and RoPE's fields as the dataclass takes them. Each family's own
``config.py`` adds its fields and reads ``config.json`` as its transformers config does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..fields import CheckpointError, Fields, RopeFields, YarnScaling


@dataclass(kw_only=True)
class Mamba2HybridConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: list[str]
    rms_norm_eps: float
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
    use_rope: bool = True
    partial_rotary_factor: float = 1.0
    rope_type: str = "default"
    rope_scaling_factor: float = 1.0
    rope_yarn: YarnScaling | None = None
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


def refuse_unserved(f: Fields) -> None:
    """The settings none of these families serves: quantised weights, an activation other
    than SiLU (the MLPs' and the Mamba2 conv's). Raises a CheckpointError naming the field."""
    if f.d.get("quantization_config") is not None:
        raise CheckpointError(f"{f.path}: quantization_config is not supported (fp32 / bf16 weights only)")
    act = f.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{f.path}: hidden_act {act!r} is not supported; supported: 'silu'")


def rope_config(rope: RopeFields) -> dict:
    """``rope`` under the dataclass's field names."""
    return dict(rope_theta=rope.theta, max_position_embeddings=rope.max_position_embeddings,
                partial_rotary_factor=rope.partial_rotary_factor, rope_type=rope.rope_type,
                rope_scaling_factor=rope.scaling_factor, rope_yarn=rope.yarn)


def attention_fields(f: Fields, hidden: int, n_heads: int) -> dict:
    """KV heads, head size and bias as Bamba's and Falcon-H1's configs read them:
    ``num_key_value_heads`` absent is 8, null one KV head per query head; ``head_dim``
    absent is ``hidden / n_heads``."""
    kv = n_heads if f.d.get("num_key_value_heads", 8) is None else f.int("num_key_value_heads", 8, lo=1)
    return dict(num_attention_heads=n_heads, num_key_value_heads=kv,
                head_dim=f.int("head_dim", hidden // n_heads, lo=1), attention_bias=f.bool("attention_bias", False))


def check_heads(f: Fields, cfg: Mamba2HybridConfig) -> None:
    """Query heads in whole groups of KV heads, or a CheckpointError naming both fields."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{f.path}: num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({cfg.num_key_value_heads})")
