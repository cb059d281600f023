"""Falcon-H1 configuration read from a Hugging Face ``config.json`` (``model_type``
``falcon_h1``), as transformers 5.24's ``FalconH1Config`` and ``modeling_falcon_h1`` read it.

Every layer runs attention (RoPE over the whole head) and a Mamba2 mixer
(``stage_server.layers.mamba2``) side by side on one normed input, sums them, then a SwiGLU
MLP. The muP multipliers: ``embedding_multiplier`` (the embedding), ``lm_head_multiplier``
(the logits), ``attention_in_multiplier`` / ``attention_out_multiplier`` (attention's input
and output), ``key_multiplier`` (the keys), ``ssm_in_multiplier`` / ``ssm_out_multiplier``
(the mixer's input and output), ``ssm_multipliers`` (five: the mixer's in-projection
sections z, x, B, C, dt; transformers' ``mup_vector``, a buffer computed from them, never
read from the checkpoint) and ``mlp_multipliers`` (gate, down). ``mamba_d_ssm`` sets the
mixer's width (null: ``mamba_expand x hidden_size``); ``mamba_rms_norm`` /
``mamba_norm_before_gate`` choose its output gate and norm; ``projectors_bias`` is the
mixer's out-projection bias, ``mamba_proj_bias`` its in-projection's. ``time_step_limit``
clamps ``dt`` in the chunked scan (prefill) only, as transformers does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...fields import CheckpointError, Fields, YarnScaling, mamba2_fields, rope_fields
from ...layers.mamba2 import GATE_ONLY, GATE_THEN_NORM, NORM_THEN_GATE
from ..hybrid import PARALLEL

MODEL_TYPE = "falcon_h1"


@dataclass
class FalconH1Config:
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
    mamba_norm: str          # layers.mamba2.NORMS, from mamba_rms_norm / mamba_norm_before_gate
    projectors_bias: bool    # the mixer's out_proj bias
    # multipliers (muP)
    embedding_multiplier: float = 1.0
    logits_multiplier: float = 1.0  # lm_head_multiplier
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0,) * 5  # z, x, B, C, dt sections of the in-projection
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # gate, down
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    # RoPE (layers.rotary.rope_frequencies)
    partial_rotary_factor: float = 1.0
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


def _floats(f: Fields, key: str, n: int) -> tuple[float, ...]:
    """A list of ``n`` finite numbers (absent or null: ``n`` ones, as FalconH1Config)."""
    v = f.get(key, [1.0] * n)
    ok = isinstance(v, list) and len(v) == n and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) < float("inf") for x in v)
    if not ok:
        raise CheckpointError(f"{f.path}: {key} must be a list of {n} finite numbers, got {v!r}")
    return tuple(float(x) for x in v)


def load_falcon_h1_config(path: str, raw: dict) -> FalconH1Config:
    """Parse the ``config.json`` dict ``raw`` of a ``falcon_h1`` checkpoint (defaults of absent
    fields: transformers 5.24's ``FalconH1Config``).

    Raises:
        CheckpointError: a missing required field, a value of the wrong type or out of
            range, or a setting not served (an activation other than SiLU, a
            ``quantization_config``, a partial rotary embedding, Mamba sizes that do not
            match, multiplier lists of the wrong length); the message names the file and
            the field.
    """
    f = Fields(path, raw)
    if raw.get("quantization_config") is not None:
        raise CheckpointError(f"{path}: quantization_config is not supported (fp32 / bf16 weights only)")
    act = f.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported; supported: 'silu'")
    hidden = f.int("hidden_size", 4096, lo=1)
    n_layers = f.int("num_hidden_layers", 32, lo=1)
    n_heads = f.int("num_attention_heads", 32, lo=1)
    rope = rope_fields(f, default_partial=1.0, default_max_pos=8192)
    if rope.partial_rotary_factor != 1.0:
        # transformers' default RoPE of Falcon-H1 rotates the whole head whatever it says
        raise CheckpointError(f"{path}: partial_rotary_factor {rope.partial_rotary_factor} is not supported for "
                              f"falcon_h1; supported: 1.0")
    # mamba_d_ssm: absent is FalconH1Config's 1024, null the mixer's mamba_expand x hidden_size
    d_ssm = raw.get("mamba_d_ssm", 1024)
    inner = None if d_ssm is None else f.int("mamba_d_ssm", lo=1)
    if f.bool("mamba_rms_norm", False):
        norm = NORM_THEN_GATE if f.bool("mamba_norm_before_gate", True) else GATE_THEN_NORM
    else:
        norm = GATE_ONLY
    cfg = FalconH1Config(
        model_type=MODEL_TYPE,
        vocab_size=f.int("vocab_size", 128000, lo=1),
        hidden_size=hidden,
        layer_types=[PARALLEL] * n_layers,
        rms_norm_eps=f.float("rms_norm_eps", 1e-5, positive=True),
        intermediate_size=f.int("intermediate_size", 14336, lo=1),
        mlp_bias=f.bool("mlp_bias", False),
        num_attention_heads=n_heads,
        # absent: FalconH1Config's default 8; null: one KV head per query head
        num_key_value_heads=n_heads if raw.get("num_key_value_heads", 8) is None else f.int("num_key_value_heads", 8, lo=1),
        head_dim=f.int("head_dim", hidden // n_heads, lo=1),
        attention_bias=f.bool("attention_bias", False),
        rope_theta=rope.theta,
        max_position_embeddings=rope.max_position_embeddings,
        **mamba2_fields(f, hidden, inner),
        mamba_norm=norm,
        projectors_bias=f.bool("projectors_bias", False),
        embedding_multiplier=f.float("embedding_multiplier", 1.0),
        logits_multiplier=f.float("lm_head_multiplier", 1.0),
        attention_in_multiplier=f.float("attention_in_multiplier", 1.0),
        attention_out_multiplier=f.float("attention_out_multiplier", 1.0),
        key_multiplier=f.float("key_multiplier", 1.0),
        ssm_in_multiplier=f.float("ssm_in_multiplier", 1.0),
        ssm_out_multiplier=f.float("ssm_out_multiplier", 1.0),
        ssm_multipliers=_floats(f, "ssm_multipliers", 5),
        mlp_multipliers=_floats(f, "mlp_multipliers", 2),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        eos_token_ids=f.ints("eos_token_id", lo=0),
        partial_rotary_factor=1.0,
        rope_type=rope.rope_type,
        rope_scaling_factor=rope.scaling_factor,
        rope_yarn=rope.yarn,
    )
    if n_heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{path}: num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads "
                              f"({cfg.num_key_value_heads})")
    return cfg
