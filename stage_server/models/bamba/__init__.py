"""Bamba (``model_type: bamba``): Mamba2 (``stage_server.layers.mamba2``) and attention layers in
the checkpoint's pattern (``attn_layer_indices``), each followed by a SwiGLU MLP
(docs/DESIGN.md, "Bamba and Falcon-H1"). No MTP head."""
from __future__ import annotations

from ..hybrid import HybridFamily
from .config import MODEL_TYPE, BambaConfig, load_bamba_config
from .model import BambaStageModel


class BambaFamily(HybridFamily):
    name = "bamba"
    model_types = (MODEL_TYPE,)

    def parse_config(self, path: str, raw: dict) -> BambaConfig:
        return load_bamba_config(path, raw)

    def stage_model(self, cfg: BambaConfig, start: int, end: int, with_mtp: bool) -> BambaStageModel:
        return BambaStageModel(cfg, start, end)


FAMILY = BambaFamily()
