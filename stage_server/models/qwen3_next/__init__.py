"""Qwen3-Next and Qwen3.5 (dense and MoE, text and the multimodal wrappers' language
model): GDN layers (``stage_server.layers.gdn``), gated full attention, an MTP head where
the checkpoint has one. Serves :data:`config.MODEL_TYPES`."""
from __future__ import annotations

from ...family import ModelFamily
from . import weights
from .config import MODEL_TYPES, HybridConfig, parse_config
from .model import StageModel


class Qwen3NextFamily(ModelFamily):
    name = "qwen3_next"
    model_types = MODEL_TYPES
    serves_mtp = True

    def parse_config(self, path: str, raw: dict) -> HybridConfig:
        return parse_config(path, raw)

    def stage_model(self, cfg: HybridConfig, start: int, end: int, with_mtp: bool) -> StageModel:
        return StageModel(cfg, start, end, with_mtp)

    def checkpoint_key(self, cfg: HybridConfig, name: str) -> str:
        return weights.checkpoint_key(cfg, name)

    def read_param(self, reader, cfg: HybridConfig, name: str, cache: dict):
        return weights.read_param(reader, cfg, name, cache)

    def has_mtp(self, cfg: HybridConfig, reader) -> bool:
        return weights.has_mtp(cfg, reader)


FAMILY = Qwen3NextFamily()
