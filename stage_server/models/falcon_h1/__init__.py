"""Falcon-H1 (``model_type: falcon_h1``): attention and a Mamba2 mixer (``stage_server.layers.mamba2``)
side by side in every layer, a SwiGLU MLP, muP multipliers
(docs/DESIGN.md, "Bamba and Falcon-H1"). No MTP head."""
from __future__ import annotations

from ..hybrid import HybridFamily
from .config import MODEL_TYPE, FalconH1Config, load_falcon_h1_config
from .model import FalconH1StageModel


class FalconH1Family(HybridFamily):
    name = "falcon_h1"
    model_types = (MODEL_TYPE,)

    def parse_config(self, path: str, raw: dict) -> FalconH1Config:
        return load_falcon_h1_config(path, raw)

    def stage_model(self, cfg: FalconH1Config, start: int, end: int, with_mtp: bool) -> FalconH1StageModel:
        return FalconH1StageModel(cfg, start, end)


FAMILY = FalconH1Family()
