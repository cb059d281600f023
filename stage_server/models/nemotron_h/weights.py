"""Checkpoint tensor names of a NemotronH stage: the model's parameter names under the
checkpoint's decoder prefix (``backbone.`` in published checkpoints and in what
transformers 5.24's ``save_pretrained`` writes; ``model.`` as transformers names them in
memory), and per-expert MoE weights (``experts.{e}.up_proj.weight``) stacked into
``experts.up_proj`` / ``experts.down_proj``."""
from __future__ import annotations

import torch

from ...fields import CheckpointError
from .config import NemotronHConfig

PREFIXES = ("backbone.", "model.")


def resolve_prefix(cfg: NemotronHConfig, reader) -> None:
    """Set ``cfg.weight_prefix`` to the prefix the checkpoint's decoder tensors carry.

    Raises CheckpointError when no tensor carries either prefix."""
    for p in PREFIXES:
        if any(k.startswith(p) for k in reader.where):
            cfg.weight_prefix = p
            return
    raise CheckpointError(f"{reader.model_dir}: no tensor under {' or '.join(PREFIXES)} (not a NemotronH checkpoint)")


def checkpoint_key(cfg: NemotronHConfig, name: str) -> str:
    """Checkpoint key of a ``NemotronHStageModel`` parameter name (before stacking experts):
    the MTP head's ``mtp.*`` and ``lm_head`` as they are, the head's copy of the embedding
    (``mtp_embed_tokens``, a stage past the first) the decoder's ``embeddings``."""
    if name == "lm_head.weight" or name.startswith("mtp."):
        return name
    if name.startswith("mtp_embed_tokens."):
        return cfg.weight_prefix + "embeddings." + name[len("mtp_embed_tokens."):]
    return cfg.weight_prefix + name


MTP_MARKER = "mtp.layers.0.eh_proj.weight"  # the head's first tensor: present iff it is


def has_mtp(cfg: NemotronHConfig, reader) -> bool:
    """Whether the checkpoint has an MTP head: ``num_nextn_predict_layers`` at least 1 and the
    head's tensors (``mtp.layers.0.eh_proj``) present."""
    return cfg.num_nextn_predict_layers > 0 and MTP_MARKER in reader


def read_param(reader, cfg: NemotronHConfig, name: str, cache: dict) -> torch.Tensor:
    key = checkpoint_key(cfg, name)
    if key in reader:
        return reader.get(key)
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return reader.get(cfg.weight_prefix + "embeddings.weight")
    for leaf in ("up_proj", "down_proj"):
        if key.endswith(f".experts.{leaf}"):
            experts = key.rsplit(".", 1)[0]
            first = f"{experts}.0.{leaf}.weight"
            if first not in reader:
                raise CheckpointError(f"{reader.model_dir}: tensor {key!r} missing (neither stacked nor "
                                      f"per-expert weights found)")
            i, d = cfg.moe_intermediate_size, cfg.moe_latent_size or cfg.hidden_size
            return reader.stack_experts([[f"{experts}.{e}.{leaf}.weight"] for e in range(cfg.n_routed_experts)],
                                        [(i, d) if leaf == "up_proj" else (d, i)])
    return reader.get(key)  # raises, naming the tensor


# kept fp32 in a bf16 stage, as transformers' ``_keep_in_fp32_modules_strict``: the router
KEEP_FP32 = (".mixer.gate.weight", ".mixer.gate.e_score_correction_bias")
