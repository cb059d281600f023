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

from dataclasses import dataclass

from ...fields import CheckpointError, Fields, mamba2_fields, rope_fields
from ..hybrid import ATTENTION, MAMBA
from ..hybrid_config import Mamba2HybridConfig, attention_fields, check_heads, refuse_unserved, rope_config

MODEL_TYPE = "bamba"


@dataclass(kw_only=True)
class BambaConfig(Mamba2HybridConfig):
    intermediate_size: int
    mlp_bias: bool
    partial_rotary_factor: float = 0.5


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
    refuse_unserved(f)
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
        **attention_fields(f, hidden, n_heads),
        **rope_config(rope),
        **mamba2_fields(f, hidden),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        eos_token_ids=f.ints("eos_token_id", lo=0),
    )
    check_heads(f, cfg)
    return cfg
