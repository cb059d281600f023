"""NemotronH (``model_type: nemotron_h``), a Mamba2 hybrid: Mamba2 (``stage_server.layers.mamba2``),
attention, relu2 MLP and MoE blocks in the checkpoint's pattern
(docs/DESIGN.md, "NemotronH (Mamba2)"), and the MTP head of the checkpoints that carry one
(Nemotron 3: ``num_nextn_predict_layers``, ``mtp.*``; ``model.MTPHead``)."""
from __future__ import annotations

from ...family import ModelFamily
from ...fields import CheckpointError
from . import weights
from .config import MODEL_TYPE, NemotronHConfig, load_nemotron_h_config
from .model import NemotronHStageModel


class NemotronHFamily(ModelFamily):
    name = "nemotron_h"
    model_types = (MODEL_TYPE,)
    keep_fp32 = weights.KEEP_FP32
    serves_mtp = True

    def parse_config(self, path: str, raw: dict) -> NemotronHConfig:
        return load_nemotron_h_config(path, raw)

    def stage_model(self, cfg: NemotronHConfig, start: int, end: int, with_mtp: bool) -> NemotronHStageModel:
        if with_mtp and end == cfg.num_hidden_layers and cfg.mtp_error is not None:
            raise CheckpointError(cfg.mtp_error)  # a head whose setting is not served
        return NemotronHStageModel(cfg, start, end, with_mtp)

    def checkpoint_key(self, cfg: NemotronHConfig, name: str) -> str:
        return weights.checkpoint_key(cfg, name)

    def read_param(self, reader, cfg: NemotronHConfig, name: str, cache: dict):
        return weights.read_param(reader, cfg, name, cache)

    def has_mtp(self, cfg: NemotronHConfig, reader) -> bool:
        # called with the reader before the model is built: the decoder prefix is settled here
        weights.resolve_prefix(cfg, reader)
        return weights.has_mtp(cfg, reader)


FAMILY = NemotronHFamily()
