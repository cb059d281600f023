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

from dataclasses import dataclass

from ...fields import CheckpointError, Fields, mamba2_fields, rope_fields
from ...layers.mamba2 import GATE_ONLY, GATE_THEN_NORM, NORM_THEN_GATE
from ..hybrid import PARALLEL
from ..hybrid_config import Mamba2HybridConfig, attention_fields, check_heads, refuse_unserved, rope_config

MODEL_TYPE = "falcon_h1"


@dataclass(kw_only=True)
class FalconH1Config(Mamba2HybridConfig):
    intermediate_size: int
    mlp_bias: bool
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
    refuse_unserved(f)
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
        **attention_fields(f, hidden, n_heads),
        **rope_config(rope),
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
    )
    check_heads(f, cfg)
    return cfg
