"""Layer families served besides the GDN one (Qwen3-Next / Qwen3.5, ``stage_server/model.py``),
each one folder registered here by its config.json ``model_type``. A family's module gives
``load_config(path, raw) -> cfg`` (raw: the parsed config.json) and ``load_stage_model(model_dir,
cfg, start, end, dtype, device) -> (cfg, model)``; the config carries what the stage sizes its
pools by (``stage_server.config.HybridConfig``'s fields and properties)."""
from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES = {"kimi_linear": "ppspec.stage_server.families.kimi_linear"}


def family(model_type: str) -> ModuleType | None:
    """The module of the family serving ``model_type``, or None (the GDN family's types)."""
    name = FAMILIES.get(model_type)
    return importlib.import_module(name) if name else None
