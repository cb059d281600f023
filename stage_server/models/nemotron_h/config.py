"""NemotronH configuration read from a Hugging Face ``config.json`` (``model_type``
``nemotron_h``), as transformers 5.25's ``NemotronHConfig`` and ``modeling_nemotron_h``
read it.

Block kinds (``layers_block_type``, or the older ``hybrid_override_pattern`` string):
``linear_attention`` (``M``, a Mamba2 mixer), ``full_attention`` (``*``, attention without
positional encoding), ``mlp`` (``-``, ``down(relu(up(x))^2)``) and ``moe`` (``E``,
sigmoid-routed non-gated relu2 experts plus a shared expert). Each block is one pre-norm
residual mixer.

``time_step_limit`` (or ``mamba_dt_limit``) clamps ``dt`` in the mixer's chunked scan and
not in its one-token update, as in NVIDIA's modelling code (transformers up to 5.24 clamped
it at ``(time_step_min, inf)`` instead). Fields transformers' modelling code does not read
are not read here either: ``mamba_proj_bias`` (``use_bias`` gives the
in/out projections their bias), ``attention_bias`` (the attention has none),
``residual_in_fp32``.

The MTP head of NVIDIA's Nemotron 3 checkpoints (``num_nextn_predict_layers``, its blocks in
``mtp_hybrid_override_pattern`` or ``mtp_layers_block_type``; transformers has none, vLLM's
``nemotron_h_mtp`` and TensorRT-LLM's ``modeling_nemotron_h`` read it) is parsed here and
checked only when it is loaded (``NemotronHConfig.mtp_error``): a checkpoint whose head is
not served still serves without MTP.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...fields import CheckpointError, Fields, time_step_limit

MODEL_TYPE = "nemotron_h"
BLOCK_KINDS = ("linear_attention", "full_attention", "mlp", "moe")
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# the MTP head's blocks served: stateless ones (a Mamba2 block would need a recurrent state
# of its own per row), at most one attention block (the head's KV pool has one layer)
MTP_BLOCK_KINDS = ("full_attention", "moe", "mlp")
MTP_DEFAULT = ("full_attention", "moe")  # transformers' default mtp_layers_block_type
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # older block names


@dataclass
class NemotronHConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: list[str]
    rms_norm_eps: float  # layer_norm_epsilon: every RMSNorm, the gated one included
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    # Mamba2
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool
    dt_limit: tuple[float, float]  # time_step_limit: the clamp of dt in the chunked scan (prefill)
    # MLP / MoE
    intermediate_size: int
    mlp_bias: bool = False
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    # MTP head: its depth (1 served) and the kinds of its blocks, in order (empty: no head)
    num_nextn_predict_layers: int = 0
    mtp_layer_types: list[str] = field(default_factory=list)
    # why the head, where the checkpoint has one, is not served (names the file and the
    # field): raised as a CheckpointError when the head is loaded; None: served
    mtp_error: str | None = None
    weight_prefix: str = "backbone."
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def max_context(self) -> int:
        """Longest sequence served: ``max_position_embeddings`` (the attention has no
        positional encoding to stretch)."""
        return self.max_position_embeddings

    @property
    def intermediate_ssm(self) -> int:
        """Mamba2 inner width ``H P`` (x, z and the gated norm)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the Mamba2 conv: x, B and C, ``H P + 2 G N``."""
        return self.intermediate_ssm + 2 * self.n_groups * self.ssm_state_size


def load_nemotron_h_config(path: str, raw: dict) -> NemotronHConfig:
    """Parse the ``config.json`` dict ``raw`` (read from ``path``) of a ``nemotron_h`` checkpoint.

    Defaults of absent fields are ``NemotronHConfig``'s of transformers 5.25 (an absent
    ``eos_token_id`` is ``generation_config.json``'s: ``config.load_config``).

    Raises:
        CheckpointError: a missing required field, a value of the wrong type or out of
            range, or a setting not served (an activation other than relu2 / silu, a
            non-fp32 SSM cache dtype, a block kind not in the pattern table, heads that do
            not divide into groups); the message names the file and the field.
    """
    f = Fields(path, raw)
    kinds = raw.get("layers_block_type")
    if kinds is None and raw.get("layer_types") is not None:
        kinds = raw["layer_types"]
    if kinds is None:
        pattern = raw.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise CheckpointError(f"{path}: missing field 'layers_block_type' (or 'hybrid_override_pattern')")
        bad = sorted(set(pattern) - set(_PATTERN))
        if bad:
            raise CheckpointError(f"{path}: hybrid_override_pattern has unsupported block symbols {bad}; "
                                  f"supported: {''.join(_PATTERN)}")
        kinds = [_PATTERN[c] for c in pattern]
    if not isinstance(kinds, list) or not kinds:
        raise CheckpointError(f"{path}: layers_block_type must be a non-empty list, got {kinds!r}")
    bad = sorted({repr(k) for k in kinds if k not in BLOCK_KINDS})
    if bad:
        raise CheckpointError(f"{path}: layers_block_type has unsupported block kinds {bad}; "
                              f"supported: {', '.join(BLOCK_KINDS)}")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu"), ("mamba_ssm_cache_dtype", "float32")):
        v = f.get(key, want)
        if v != want:
            raise CheckpointError(f"{path}: {key} {v!r} is not supported; supported: {want!r}")
    if raw.get("quantization_config") is not None:
        raise CheckpointError(f"{path}: quantization_config is not supported (fp32 / bf16 weights only)")
    n_heads = f.int("num_attention_heads", 32, lo=1)
    depth, mtp_kinds, mtp_error = _mtp_fields(path, f, raw)
    # the MoE sizes: for the decoder's MoE blocks or the MTP head's
    moe = "moe" in kinds or (depth > 0 and "moe" in mtp_kinds)
    cfg = NemotronHConfig(
        model_type=MODEL_TYPE,
        vocab_size=f.int("vocab_size", 131072, lo=1),
        hidden_size=f.int("hidden_size", 4096, lo=1),
        layer_types=list(kinds),
        rms_norm_eps=f.float("layer_norm_epsilon", 1e-5, positive=True),
        num_attention_heads=n_heads,
        num_key_value_heads=f.int("num_key_value_heads", n_heads, lo=1),
        head_dim=f.int("head_dim", 128, lo=1),
        max_position_embeddings=f.int("max_position_embeddings", 4096, lo=1),
        mamba_num_heads=f.int("mamba_num_heads", 128, lo=1),
        mamba_head_dim=f.int("mamba_head_dim", 64, lo=1),
        ssm_state_size=f.int("ssm_state_size", 128, lo=1),
        n_groups=f.int("n_groups", f.int("mamba_n_groups", 8, lo=1), lo=1),
        conv_kernel=f.int("conv_kernel", f.int("mamba_d_conv", 4, lo=2), lo=2),
        use_conv_bias=f.bool("use_conv_bias", True),
        use_bias=f.bool("use_bias", False),
        dt_limit=time_step_limit(f, "mamba_dt_limit" if "mamba_dt_limit" in raw else "time_step_limit"),
        intermediate_size=f.int("intermediate_size", 21504, lo=1),
        mlp_bias=f.bool("mlp_bias", False),
        n_routed_experts=f.int("n_routed_experts", 8, lo=1) if moe else 0,
        num_experts_per_tok=f.int("num_experts_per_tok", 2, lo=1) if moe else 0,
        moe_intermediate_size=f.int("moe_intermediate_size", 7688, lo=1) if moe else 0,
        moe_shared_expert_intermediate_size=f.int("moe_shared_expert_intermediate_size", 7688, lo=1) if moe else 0,
        moe_latent_size=f.int("moe_latent_size", None, lo=1),
        routed_scaling_factor=f.float("routed_scaling_factor", 1.0),
        n_group=f.int("n_group", 1, lo=1),
        topk_group=f.int("topk_group", 1, lo=1),
        norm_topk_prob=f.bool("norm_topk_prob", True),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        eos_token_ids=f.ints("eos_token_id", lo=0),
        num_nextn_predict_layers=depth,
        mtp_layer_types=mtp_kinds,
        mtp_error=mtp_error,
    )
    if cfg.mamba_num_heads % cfg.n_groups:
        raise CheckpointError(f"{path}: mamba_num_heads ({cfg.mamba_num_heads}) must be a multiple of n_groups "
                              f"({cfg.n_groups})")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{path}: num_attention_heads must be a multiple of num_key_value_heads")
    if moe:
        if cfg.num_experts_per_tok > cfg.n_routed_experts:
            raise CheckpointError(f"{path}: num_experts_per_tok ({cfg.num_experts_per_tok}) is above "
                                  f"n_routed_experts ({cfg.n_routed_experts})")
        if cfg.n_routed_experts % cfg.n_group or cfg.topk_group > cfg.n_group:
            raise CheckpointError(f"{path}: n_group ({cfg.n_group}) must divide n_routed_experts and be at least "
                                  f"topk_group ({cfg.topk_group})")
    return cfg


def _mtp_fields(path: str, f: Fields, raw: dict) -> tuple[int, list[str], str | None]:
    """``(num_nextn_predict_layers, the head's block kinds, why not served or None)``."""
    depth = f.int("num_nextn_predict_layers", 0, lo=0) or 0
    # as transformers reads them: the list, unless it is absent or its default and the
    # older pattern string is given; neither: the default list (attention, then MoE)
    kinds, field_name = raw.get("mtp_layers_block_type"), "mtp_layers_block_type"
    pattern = raw.get("mtp_hybrid_override_pattern")
    if pattern is not None and kinds in (None, list(MTP_DEFAULT)):
        field_name = "mtp_hybrid_override_pattern"
        if not isinstance(pattern, str) or set(pattern) - set(_PATTERN):
            return depth, [], (f"{path}: {field_name} {pattern!r} is not served; its block symbols must be "
                               f"among {''.join(_PATTERN)}")
        kinds = [_PATTERN[c] for c in pattern]
    elif kinds is None:
        kinds = list(MTP_DEFAULT)
    elif isinstance(kinds, list):
        kinds = [_LEGACY.get(k, k) for k in kinds]
    if not isinstance(kinds, list):
        return depth, [], f"{path}: {field_name} must be a list, got {kinds!r}"
    if depth == 0:
        return 0, list(kinds), None
    if depth != 1:
        return depth, list(kinds), (f"{path}: num_nextn_predict_layers {depth} is not served for the MTP head; "
                                    f"served: 1 (one head, chained for every draft)")
    if not kinds:
        return depth, [], f"{path}: {field_name} is empty: the MTP head has no block"
    bad = sorted({repr(k) for k in kinds if k not in MTP_BLOCK_KINDS})
    if bad:
        return depth, list(kinds), (f"{path}: {field_name} has MTP block kinds [{', '.join(bad)}] that are not served; "
                                    f"served: {', '.join(MTP_BLOCK_KINDS)} (symbols *, E, -)")
    if kinds.count("full_attention") > 1:
        return depth, list(kinds), (f"{path}: {field_name} has {kinds.count('full_attention')} attention blocks "
                                    f"in the MTP head; served: at most 1")
    return depth, list(kinds), None
