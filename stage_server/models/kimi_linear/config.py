"""Kimi Linear's ``config.json``, read as transformers' ``KimiLinearConfig`` reads it.

Two spellings are accepted for most fields: the ones transformers writes (``save_pretrained``
applies its ``attribute_map``: ``num_experts``, ``num_experts_per_token``,
``num_shared_experts``, ``num_expert_group``, ``moe_renormalize``, ``model_max_length``) and
the attribute names (``num_local_experts``, ``num_experts_per_tok``, ``n_shared_experts``,
``n_group``, ``norm_topk_prob``, ``max_position_embeddings``). The published checkpoints
describe the KDA layers in a ``linear_attn_config`` object (``head_dim``, ``num_heads``,
``short_conv_kernel_size``, and 1-based ``kda_layers`` / ``full_attn_layers``) and the dense
layers by ``first_k_dense_replace``; transformers' defaults apply where a field is absent.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...fields import CheckpointError, Fields as _Fields

MODEL_TYPE = "kimi_linear"
HIDDEN_ACTS = ("silu", "swish")  # the MLPs, the experts and the KDA conv apply SiLU
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class KimiLinearConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    mlp_layer_types: list[str]  # "dense" or "sparse" per layer
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    # MLA (full attention layers): no RoPE (transformers' KimiLinearAttention: "NoPE"), so
    # the ``qk_rope_head_dim`` part of the key is a shared, unrotated key slice
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    # MLP / MoE (DeepSeek-V3 routing: sigmoid scores, grouped top-k, a correction bias)
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    weight_prefix: str = "model."
    mtp_num_hidden_layers: int = 0

    # ---- the stage's view, by which StageRunner sizes its pools
    @property
    def num_key_value_heads(self) -> int:
        """Heads of the paged KV cache: the MLA latent is one head shared by every query head."""
        return 1

    @property
    def head_dim(self) -> int:
        """Width of a KV cache entry: the compressed latent and the shared key slice."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def linear_num_key_heads(self) -> int:
        return self.linear_num_heads

    @property
    def linear_num_value_heads(self) -> int:
        return self.linear_num_heads

    @property
    def linear_key_head_dim(self) -> int:
        return self.linear_head_dim

    @property
    def linear_value_head_dim(self) -> int:
        return self.linear_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the KDA short convolution: q, k and v (``3 H K``)."""
        return 3 * self.linear_num_heads * self.linear_head_dim

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= 0 and self.mlp_layer_types[layer] == "sparse"


def _either(f: _Fields, kind: str, names: tuple[str, str], default, **kw):
    """Field read under the first of ``names`` present (transformers' written name, then the
    attribute name)."""
    name = next((n for n in names if f.d.get(n) is not None), names[0])
    return getattr(f, kind)(name, default, **kw)


def load_kimi_config(path: str, raw: dict) -> KimiLinearConfig:
    """Parse a ``kimi_linear`` config.json (``raw``, read from ``path``).

    Raises:
        CheckpointError: a field we do not serve (a quantisation, a router activation other
            than sigmoid, RoPE in MLA, ``num_key_value_heads`` other than the head count, an
            activation other than SiLU, unknown layer or MLP types), a missing required field,
            or one of the wrong type or out of range; the message names the file and the field.
    """
    f = _Fields(path, raw)
    if raw.get("quantization_config") is not None:
        raise CheckpointError(f"{path}: quantization_config is not supported for {MODEL_TYPE} (fp32 / bf16 weights only)")
    act = f.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported; supported: {', '.join(HIDDEN_ACTS)}")
    router_act = raw.get("moe_router_activation_func", "sigmoid")
    if router_act != "sigmoid":
        raise CheckpointError(f"{path}: moe_router_activation_func {router_act!r} is not supported (sigmoid only)")
    if raw.get("mla_use_nope", True) is not True:
        raise CheckpointError(f"{path}: mla_use_nope {raw['mla_use_nope']!r} is not supported (MLA without RoPE only)")
    lin = raw.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise CheckpointError(f"{path}: linear_attn_config must be an object, got {lin!r}")
    lf = _Fields(path, lin, "linear_attn_config.")
    n_layers = f.int("num_hidden_layers", lo=1)
    n_heads = f.int("num_attention_heads", lo=1)
    if f.int("num_key_value_heads", n_heads, lo=1) != n_heads:
        raise CheckpointError(f"{path}: num_key_value_heads must equal num_attention_heads ({n_heads}) for "
                              f"{MODEL_TYPE}: MLA expands the latent to every head")

    layer_types = f.get("layer_types", None)
    if layer_types is None:
        if "kda_layers" in lin and "full_attn_layers" in lin:
            layer_types = [None] * n_layers
            for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
                for i in lf.ints(key, lo=1, scalar=False):
                    if i > n_layers:
                        raise lf._bad(key, f"names layer {i} of {n_layers} (1-based)")
                    layer_types[i - 1] = kind
        else:  # transformers' default
            layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise CheckpointError(f"{path}: layer_types must list {n_layers} layer types, got {layer_types!r}")
    bad = sorted({repr(t) for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise CheckpointError(f"{path}: layer_types: unsupported layer types {', '.join(bad)}")
    mlp_types = f.get("mlp_layer_types", None)
    if mlp_types is None:
        k = f.int("first_k_dense_replace", 1, lo=0)
        mlp_types = ["dense" if i < k else "sparse" for i in range(n_layers)]
    if not isinstance(mlp_types, list) or len(mlp_types) != n_layers or any(t not in ("dense", "sparse") for t in mlp_types):
        raise CheckpointError(f"{path}: mlp_layer_types must list 'dense' or 'sparse' for each of {n_layers} layers, "
                              f"got {mlp_types!r}")

    moe = "sparse" in mlp_types
    cfg = KimiLinearConfig(
        model_type=MODEL_TYPE,
        vocab_size=f.int("vocab_size", lo=1),
        hidden_size=f.int("hidden_size", lo=1),
        num_hidden_layers=n_layers,
        layer_types=list(layer_types),
        mlp_layer_types=list(mlp_types),
        rms_norm_eps=f.float("rms_norm_eps", 1e-5, positive=True),
        hidden_act=act,
        max_position_embeddings=_either(f, "int", ("model_max_length", "max_position_embeddings"), 1048576, lo=1),
        num_attention_heads=n_heads,
        q_lora_rank=f.int("q_lora_rank", None, lo=1),
        kv_lora_rank=f.int("kv_lora_rank", 512, lo=1),
        qk_nope_head_dim=f.int("qk_nope_head_dim", 128, lo=1),
        qk_rope_head_dim=f.int("qk_rope_head_dim", 64, lo=0),
        v_head_dim=f.int("v_head_dim", 128, lo=1),
        attention_bias=f.bool("attention_bias", False),
        linear_num_heads=lf.int("num_heads", f.int("linear_num_heads", 32, lo=1), lo=1),
        linear_head_dim=lf.int("head_dim", f.int("linear_head_dim", 128, lo=1), lo=1),
        linear_conv_kernel_dim=lf.int("short_conv_kernel_size", f.int("linear_conv_kernel_dim", 4, lo=2), lo=2),
        intermediate_size=f.int("intermediate_size", 9216, lo=1),
        moe_intermediate_size=f.int("moe_intermediate_size", 1024, lo=1),
        num_experts=_either(f, "int", ("num_experts", "num_local_experts"), 256, lo=1),
        num_experts_per_tok=_either(f, "int", ("num_experts_per_token", "num_experts_per_tok"), 8, lo=1),
        n_shared_experts=_either(f, "int", ("num_shared_experts", "n_shared_experts"), 1, lo=0),
        n_group=_either(f, "int", ("num_expert_group", "n_group"), 1, lo=1),
        topk_group=f.int("topk_group", 1, lo=1),
        norm_topk_prob=_either(f, "bool", ("moe_renormalize", "norm_topk_prob"), True),
        routed_scaling_factor=f.float("routed_scaling_factor", 2.446, positive=True),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        eos_token_ids=f.ints("eos_token_id", lo=0),
    )
    if moe:
        e, g = cfg.num_experts, cfg.n_group
        if e % g or e // g < 2:
            # transformers scores a group by its two best experts
            raise CheckpointError(f"{path}: num_experts ({e}) must split into num_expert_group ({g}) groups of at "
                                  f"least 2 experts")
        if cfg.topk_group > g:
            raise CheckpointError(f"{path}: topk_group ({cfg.topk_group}) is above num_expert_group ({g})")
        if cfg.num_experts_per_tok > cfg.topk_group * (e // g):
            raise CheckpointError(f"{path}: num_experts_per_token ({cfg.num_experts_per_tok}) is above the "
                                  f"{cfg.topk_group * (e // g)} experts of the top {cfg.topk_group} groups")
    return cfg
