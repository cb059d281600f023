"""Kimi Linear checkpoint tensors to the stage model's parameters (the generic loader,
``stage_server.loader``, reads only those of the stage's slice). Checkpoint layouts accepted, as transformers'
conversion mapping for ``kimi_linear`` accepts them: the MLP under ``mlp.`` or
``block_sparse_moe.``; experts per expert (``experts.{e}.w1`` gate, ``w3`` up, ``w2`` down:
the published layout, and what transformers' ``save_pretrained`` writes) or stacked
(``experts.gate_up_proj`` ``[E, 2I, hidden]``, ``experts.down_proj`` ``[E, hidden, I]``).
"""
from __future__ import annotations

import torch

from ...fields import CheckpointError
from .config import KimiLinearConfig

_MLP_PREFIXES = (".mlp.", ".block_sparse_moe.")
# kept fp32 in a bf16 stage, as transformers keeps them (``_keep_in_fp32_modules_strict``): the
# router's weight and correction bias choose the experts, dt_bias shifts the forget gate
KEEP_FP32 = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias", ".self_attn.dt_bias")


def checkpoint_key(cfg: KimiLinearConfig, name: str) -> str:
    """The checkpoint key of parameter ``name`` of ``KimiStageModel`` (before layout conversions)."""
    return cfg.weight_prefix + name if name != "lm_head.weight" else name


def read_param(reader, cfg: KimiLinearConfig, name: str) -> torch.Tensor:
    """The checkpoint tensor of parameter ``name`` of ``KimiStageModel``, in its layout."""
    key = checkpoint_key(cfg, name)
    if key in reader:
        return reader.get(key)
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return reader.get(cfg.weight_prefix + "embed_tokens.weight")
    if ".mlp." not in key:
        return reader.get(key)  # raises, naming the tensor
    for alt in (key.replace(".mlp.", p, 1) for p in _MLP_PREFIXES):
        if alt in reader:
            return reader.get(alt)
    if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        for p in _MLP_PREFIXES:
            experts = key.rsplit(".", 1)[0].replace(".mlp.", p, 1)
            if f"{experts}.0.w1.weight" not in reader:
                continue
            e, i, h = range(cfg.num_experts), cfg.moe_intermediate_size, cfg.hidden_size
            if key.endswith("gate_up_proj"):
                return reader.stack_experts([[f"{experts}.{n}.w1.weight", f"{experts}.{n}.w3.weight"] for n in e],
                                            [(i, h), (i, h)])
            return reader.stack_experts([[f"{experts}.{n}.w2.weight"] for n in e], [(h, i)])
    raise CheckpointError(f"{reader.model_dir}: tensor {key!r} missing from the checkpoint (also looked under "
                          f"block_sparse_moe. and for per-expert w1 / w2 / w3)")
