"""Kimi Linear (``model_type: kimi_linear``): KDA layers (``stage_server.layers.kda``), MLA
full attention with the compressed KV latent in the paged KV cache, MoE with shared experts
(docs/DESIGN.md, "Kimi Linear"). No MTP head."""
from __future__ import annotations

from ...family import ModelFamily
from . import weights
from .config import MODEL_TYPE, KimiLinearConfig, load_kimi_config
from .model import KimiStageModel


class KimiLinearFamily(ModelFamily):
    name = "kimi_linear"
    model_types = (MODEL_TYPE,)
    keep_fp32 = weights.KEEP_FP32

    def parse_config(self, path: str, raw: dict) -> KimiLinearConfig:
        return load_kimi_config(path, raw)

    def stage_model(self, cfg: KimiLinearConfig, start: int, end: int, with_mtp: bool) -> KimiStageModel:
        return KimiStageModel(cfg, start, end)

    def checkpoint_key(self, cfg: KimiLinearConfig, name: str) -> str:
        return weights.checkpoint_key(cfg, name)

    def read_param(self, reader, cfg: KimiLinearConfig, name: str, cache: dict):
        return weights.read_param(reader, cfg, name)


FAMILY = KimiLinearFamily()
