"""Granite 4.0 hybrid (``model_type: granitemoehybrid``): Mamba2 (``stage_server.layers.mamba2``)
and attention layers, each followed by a shared SwiGLU MLP and a top-k MoE, with Granite's
multipliers (docs/DESIGN.md, "Granite 4.0 hybrid"). No MTP head."""
from __future__ import annotations

from ...family import ModelFamily
from . import weights
from .config import MODEL_TYPE, GraniteHybridConfig, load_granite_config
from .model import GraniteHybridStageModel


class GraniteHybridFamily(ModelFamily):
    name = "granitemoehybrid"
    model_types = (MODEL_TYPE,)

    def parse_config(self, path: str, raw: dict) -> GraniteHybridConfig:
        return load_granite_config(path, raw)

    def stage_model(self, cfg: GraniteHybridConfig, start: int, end: int, with_mtp: bool) -> GraniteHybridStageModel:
        return GraniteHybridStageModel(cfg, start, end)

    def checkpoint_key(self, cfg: GraniteHybridConfig, name: str) -> str:
        return weights.checkpoint_key(cfg, name)

    def read_param(self, reader, cfg: GraniteHybridConfig, name: str, cache: dict):
        return weights.read_param(reader, cfg, name, cache)


FAMILY = GraniteHybridFamily()
