"""Qwen3-Next / Qwen3.5 checkpoint tensors to the stage model's parameters.

Parameter names equal the checkpoint's without its decoder prefix (``model.`` or
``model.language_model.``; ``HybridConfig.weight_prefix``). Two checkpoint layouts are
converted on the fly into the one ``model.py`` runs: Qwen3-Next's fused ``in_proj_qkvz`` /
``in_proj_ba`` (grouped per key head) and per-expert MoE weights
(``experts.{e}.gate_proj``...), stacked into ``gate_up_proj`` / ``down_proj``.
"""
from __future__ import annotations

import torch

from ...fields import CheckpointError
from .config import HybridConfig


def _split_qwen3_next_gdn(cfg: HybridConfig, qkvz: torch.Tensor, ba: torch.Tensor) -> dict[str, torch.Tensor]:
    """Regroup Qwen3-Next's per-key-head interleaved projections into q|k|v, z, b, a rows
    (the reordering of transformers' ``fix_query_key_value_ordering``)."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    grp = cfg.linear_num_value_heads // hk
    h = qkvz.shape[-1]
    per = qkvz.view(hk, 2 * dk + 2 * grp * dv, h)
    q, k, v, z = torch.split(per, [dk, dk, grp * dv, grp * dv], dim=1)
    b, a = torch.split(ba.view(hk, 2 * grp, h), [grp, grp], dim=1)
    flat = lambda t: t.reshape(-1, h)  # noqa: E731
    return {
        "in_proj_qkv": torch.cat([flat(q), flat(k), flat(v)], dim=0),
        "in_proj_z": flat(z),
        "in_proj_b": flat(b),
        "in_proj_a": flat(a),
    }


def checkpoint_key(cfg: HybridConfig, name: str) -> str:
    """Checkpoint key of a StageModel parameter name (before layout conversions)."""
    if name.startswith("mtp.") or name == "lm_head.weight":
        return name
    if name.startswith("mtp_embed_tokens."):
        return cfg.weight_prefix + name[len("mtp_") :]
    return cfg.weight_prefix + name


def read_param(reader, cfg: HybridConfig, name: str, cache: dict) -> torch.Tensor:
    key = checkpoint_key(cfg, name)
    if key in reader:
        return reader.get(key)
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return reader.get(cfg.weight_prefix + "embed_tokens.weight")
    base, _, leaf = key.rpartition(".")
    if ".linear_attn.in_proj_" in key and cfg.fused_gdn_projections:
        # base = "...linear_attn.in_proj_qkv" etc; leaf = "weight"
        attn = base.rsplit(".", 1)[0]
        if attn not in cache:
            hk, dk, dv, h = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                             cfg.hidden_size)
            grp = cfg.linear_num_value_heads // hk
            cache[attn] = _split_qwen3_next_gdn(
                cfg, reader.get(attn + ".in_proj_qkvz.weight", (hk * (2 * dk + 2 * grp * dv), h)),
                reader.get(attn + ".in_proj_ba.weight", (hk * 2 * grp, h))
            )
        return cache[attn][base.rsplit(".", 1)[1]]
    if key.endswith(".experts.gate_up_proj") or key.endswith(".experts.down_proj"):
        experts = key.rsplit(".", 1)[0]
        e_first = experts + ".0.gate_proj.weight"
        if e_first not in reader:
            raise CheckpointError(
                f"{reader.model_dir}: tensor {key!r} missing (neither stacked nor per-expert weights found)"
            )
        n, i, h = range(cfg.num_experts), cfg.moe_intermediate_size, cfg.hidden_size
        if key.endswith("gate_up_proj"):
            return reader.stack_experts(
                [[f"{experts}.{e}.gate_proj.weight", f"{experts}.{e}.up_proj.weight"] for e in n], [(i, h), (i, h)])
        return reader.stack_experts([[f"{experts}.{e}.down_proj.weight"] for e in n], [(h, i)])
    return reader.get(key)  # raises, naming the tensor


def has_mtp(cfg: HybridConfig, reader) -> bool:
    """Whether the checkpoint has the ``mtp.*`` head. Published Qwen3-Next config.json
    files do not state ``mtp_num_hidden_layers``: the head's tensors do; an explicit 0
    turns it off. Sets ``cfg.mtp_is_moe`` from the head's tensors (config.json does not
    describe its MLP)."""
    found = cfg.mtp_num_hidden_layers != 0 and "mtp.fc.weight" in reader
    if found and cfg.num_experts > 0:
        # a router weight makes the MTP layer's MLP the MoE block, gate_proj a dense one
        moe, dense = "mtp.layers.0.mlp.gate.weight" in reader, "mtp.layers.0.mlp.gate_proj.weight" in reader
        if moe != dense:
            cfg.mtp_is_moe = moe
    return found
