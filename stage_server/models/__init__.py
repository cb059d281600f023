"""Model families, one folder each (``stage_server.family.ModelFamily``; docs/DESIGN.md,
"Layer families"), and the one table from ``model_type`` to family. A new folder adds its
``FAMILY`` to :data:`FAMILIES`."""
from __future__ import annotations

from ..family import ModelFamily
from ..fields import CheckpointError
from . import bamba, falcon_h1, granitemoehybrid, kimi_linear, nemotron_h, qwen3_next

FAMILIES: tuple[ModelFamily, ...] = (qwen3_next.FAMILY, kimi_linear.FAMILY, nemotron_h.FAMILY,
                                      granitemoehybrid.FAMILY, bamba.FAMILY, falcon_h1.FAMILY)


def _by_model_type() -> dict[str, ModelFamily]:
    table: dict[str, ModelFamily] = {}
    for fam in FAMILIES:
        for t in fam.model_types:
            if t in table:
                raise ValueError(f"model_type {t!r} served by two families: {table[t].name} and {fam.name}")
            table[t] = fam
    return table


BY_MODEL_TYPE = _by_model_type()


def family_for(path: str, raw: dict) -> ModelFamily:
    """The family serving ``raw["model_type"]`` (``raw``: the parsed ``config.json`` at ``path``).

    Raises CheckpointError naming the file, the field and the types served."""
    t = raw.get("model_type")
    if not isinstance(t, str) or t not in BY_MODEL_TYPE:
        raise CheckpointError(f"{path}: unsupported model_type {t!r}; supported: {', '.join(sorted(BY_MODEL_TYPE))}")
    return BY_MODEL_TYPE[t]


def family_of(cfg) -> ModelFamily:
    """The family of a parsed config (by its ``model_type``)."""
    return BY_MODEL_TYPE[cfg.model_type]
