"""Granite 4.0 hybrid (``model_type: granitemoehybrid``): Mamba2 (``stage_server.layers.mamba2``)
and attention layers, each followed by a shared SwiGLU MLP and a top-k MoE, with Granite's
multipliers (docs/DESIGN.md, "Granite 4.0 hybrid"). No MTP head."""
from __future__ import annotations

from ..hybrid import HybridFamily
from .config import MODEL_TYPE, GraniteHybridConfig, load_granite_config
from .model import GraniteHybridStageModel


class GraniteHybridFamily(HybridFamily):
    name = "granitemoehybrid"
    model_types = (MODEL_TYPE,)

    def parse_config(self, path: str, raw: dict) -> GraniteHybridConfig:
        return load_granite_config(path, raw)

    def stage_model(self, cfg: GraniteHybridConfig, start: int, end: int, with_mtp: bool) -> GraniteHybridStageModel:
        return GraniteHybridStageModel(cfg, start, end)


FAMILY = GraniteHybridFamily()
