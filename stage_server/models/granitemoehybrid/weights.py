"""Checkpoint tensor names of a Granite 4.0 hybrid stage: the model's parameter names under
``model.`` (published checkpoints and transformers' ``save_pretrained`` alike; the stacked
experts as ``block_sparse_moe.input_linear`` / ``output_linear``), ``lm_head`` the
embedding when tied."""
from __future__ import annotations

from .config import GraniteHybridConfig


def checkpoint_key(cfg: GraniteHybridConfig, name: str) -> str:
    return name if name == "lm_head.weight" else cfg.weight_prefix + name


def read_param(reader, cfg: GraniteHybridConfig, name: str, cache: dict):
    key = checkpoint_key(cfg, name)
    if name == "lm_head.weight" and key not in reader and cfg.tie_word_embeddings:
        return reader.get(cfg.weight_prefix + "embed_tokens.weight")
    return reader.get(key)  # raises, naming the tensor
