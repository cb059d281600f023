"""Reading a Hugging Face ``config.json``, for every model family's parser: the error
(:class:`CheckpointError`), typed field reads that name the file and the field
(:class:`Fields`), the RoPE fields of families with rotary attention (:func:`rope_fields`),
the ``mamba_*`` fields of the Mamba2 hybrids that share them (:func:`mamba2_fields`).
What a field means for one family lives in its folder (``stage_server/models/<family>/config.py``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

class CheckpointError(ValueError):
    """A checkpoint cannot be served: the message names the file and the field or tensor."""


@dataclass(frozen=True)
class YarnScaling:
    """The fields of a ``rope_type: yarn`` config, resolved as transformers'
    ``_compute_yarn_parameters`` resolves them (the formula itself is
    ``model.rope_frequencies``): ``factor`` null is ``max_position_embeddings /
    original_max_position_embeddings``; ``beta_fast`` / ``beta_slow`` default to 32 / 1;
    ``mscale`` and ``mscale_all_dim`` count only when both are set and non-zero;
    ``attention_factor`` None means derived from ``factor`` (and the two mscales)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True



REQUIRED = object()


class Fields:
    """Typed reads of one ``config.json`` dict: a missing required field, a value of the
    wrong type or outside its range raises :class:`CheckpointError` naming the file and
    the field (``bool`` is not taken for a number)."""

    def __init__(self, path: str, d: dict, where: str = ""):
        self.path, self.d, self.where = path, d, where

    def _bad(self, key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {self.where}{key} {why}")

    def get(self, key: str, default=REQUIRED):
        v = self.d.get(key)
        if v is None:
            if default is REQUIRED:
                raise CheckpointError(f"{self.path}: missing field {self.where + key!r}")
            return default
        return v

    def int(self, key: str, default=REQUIRED, lo: int | None = None) -> int:
        v = self.get(key, default)
        if v is None:  # absent, and None is its default
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(key, f"must be an integer, got {v!r}")
        if lo is not None and v < lo:
            raise self._bad(key, f"must be at least {lo}, got {v}")
        return v

    def float(self, key: str, default=REQUIRED, positive: bool = False, lo: float | None = None) -> float:
        v = self.get(key, default)
        if v is None:  # absent, and None is its default
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
            raise self._bad(key, f"must be a finite number, got {v!r}")
        if positive and v <= 0:
            raise self._bad(key, f"must be positive, got {v}")
        if lo is not None and v < lo:
            raise self._bad(key, f"must be at least {lo}, got {v}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, f"must be true or false, got {v!r}")
        return v

    def ints(self, key: str, lo: int | None = None, scalar: bool = True) -> list[int]:
        """A list of integers, or [] when absent; with ``scalar`` one integer is a list of
        one (``eos_token_id``)."""
        v = self.get(key, [])
        vals = [v] if scalar and isinstance(v, int) and not isinstance(v, bool) else v
        if not isinstance(vals, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in vals):
            raise self._bad(key, f"must be {'an integer or ' if scalar else ''}a list of integers, got {v!r}")
        if lo is not None and any(x < lo for x in vals):
            raise self._bad(key, f"must be at least {lo}, got {v!r}")
        return list(vals)


# RoPE variants served: ``default``; ``linear`` (position interpolation: Chen et al.
# 2023, "Extending Context Window of Large Language Models via Positional Interpolation";
# inverse frequencies divided by ``factor``, as transformers'
# ``_compute_linear_scaling_rope_parameters``); ``yarn`` (Peng et al. 2023, "YaRN:
# Efficient Context Window Extension of Large Language Models": fields read by
# ``_yarn_fields``, frequencies and attention factor by ``model.rope_frequencies``). Other
# types (``dynamic``, ``longrope``, ``llama3``, ...) are refused by name. The mrope fields
# of Qwen3.5 (``mrope_section``, ``mrope_interleaved``; ``type: mrope`` in older configs)
# are ignored: for text, every section's position is the token's position, which is the
# plain rotation.
ROPE_TYPES = ("default", "linear", "yarn")


def _yarn_fields(rope: Fields, text: Fields, max_position_embeddings: int) -> YarnScaling:
    """The ``yarn`` fields of ``rope`` (the rope_parameters / rope_scaling object) as
    transformers 5's ``_compute_yarn_parameters`` reads them: ``factor`` must be present
    (null: ``max_position_embeddings / original_max_position_embeddings``);
    ``original_max_position_embeddings`` is the text config's top-level field when it has
    one (transformers gives that priority, for Phi-3), else the object's, else
    ``max_position_embeddings``; ``beta_fast`` / ``beta_slow`` null or 0 are 32 / 1;
    ``mscale`` / ``mscale_all_dim`` null or 0 are unset; ``truncate`` defaults to true.
    Unlike transformers, which only warns, ``beta_fast`` below ``beta_slow`` is refused."""
    if "factor" not in rope.d:
        raise CheckpointError(f"{rope.path}: missing field {rope.where + 'factor'!r} (rope_type yarn)")
    omp = text.int("original_max_position_embeddings", None, lo=1)
    if omp is None:
        omp = rope.int("original_max_position_embeddings", max_position_embeddings, lo=1)
    factor = rope.float("factor", None, positive=True)
    if factor is None:
        factor = max_position_embeddings / omp
    beta_fast = rope.float("beta_fast", 0.0, lo=0.0) or 32.0
    beta_slow = rope.float("beta_slow", 0.0, lo=0.0) or 1.0
    if beta_fast < beta_slow:
        raise rope._bad("beta_fast", f"({beta_fast}) must be at least beta_slow ({beta_slow})")
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=omp,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        mscale=rope.float("mscale", 0.0, lo=0.0) or None,
        mscale_all_dim=rope.float("mscale_all_dim", 0.0, lo=0.0) or None,
        attention_factor=rope.float("attention_factor", None, positive=True),
        truncate=rope.bool("truncate", True),
    )


@dataclass(frozen=True)
class RopeFields:
    """The rotary embedding of a text config: ``rope_type`` (one of :data:`ROPE_TYPES`),
    ``theta``, ``partial_rotary_factor``, ``scaling_factor`` (linear scaling; 1.0 = none)
    and ``yarn`` (``rope_type`` yarn only). ``layers.rotary.rope_frequencies`` turns them
    into frequencies."""

    rope_type: str
    theta: float
    partial_rotary_factor: float
    scaling_factor: float
    yarn: YarnScaling | None
    max_position_embeddings: int


def rope_fields(text: Fields, default_partial: float = 1.0, default_max_pos: int = 32768) -> RopeFields:
    """The RoPE fields of ``text`` (the text config), from its ``rope_parameters`` (or the
    older ``rope_scaling``) object or its top level, as transformers 5 reads them.

    Raises:
        CheckpointError: a ``rope_type`` not served, a field of the wrong type or out of
            range; the message names the file and the field.
    """
    path = text.path
    rope_d = text.d.get("rope_parameters") or text.d.get("rope_scaling") or {}
    if not isinstance(rope_d, dict):
        raise CheckpointError(f"{path}: {text.where}rope_parameters must be an object, got {rope_d!r}")
    rope = Fields(path, rope_d, text.where + "rope_parameters.")
    rope_type = rope_d.get("rope_type", rope_d.get("type")) or "default"
    if rope_type == "mrope":  # the older spelling of multimodal RoPE (Qwen2-VL): default for text
        rope_type = "default"
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{path}: rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    max_pos = text.int("max_position_embeddings", default_max_pos, lo=1)
    theta = rope.float("rope_theta", text.float("rope_theta", 10000.0, positive=True), positive=True)
    partial = rope.float("partial_rotary_factor",
                         text.float("partial_rotary_factor", default_partial, positive=True), positive=True)
    if partial > 1:
        raise CheckpointError(f"{path}: partial_rotary_factor must be in (0, 1], got {partial}")
    if rope_type == "yarn" and theta <= 1:  # YaRN divides by log(rope_theta)
        raise CheckpointError(f"{path}: rope_theta must be above 1 for rope_type yarn, got {theta}")
    return RopeFields(
        rope_type=rope_type,
        theta=theta,
        partial_rotary_factor=partial,
        scaling_factor=rope.float("factor", positive=True) if rope_type == "linear" else 1.0,
        yarn=_yarn_fields(rope, text, max_pos) if rope_type == "yarn" else None,
        max_position_embeddings=max_pos,
    )


def time_step_limit(f: Fields, key: str = "time_step_limit") -> tuple[float, float]:
    """``time_step_limit`` (or the field ``key``) ``[lo, hi]`` (default ``[0, inf]``);
    transformers writes an infinite ``hi`` as ``{"__float__": "Infinity"}``."""
    v = f.get(key, [0.0, float("inf")])
    if isinstance(v, list) and len(v) == 2:
        vals = [x.get("__float__") if isinstance(x, dict) else x for x in v]
        try:
            lo, hi = (float(x) for x in vals)
        except (TypeError, ValueError):
            lo = hi = float("nan")
        if lo == lo and hi == hi and 0.0 <= lo <= hi:
            return lo, hi
    raise CheckpointError(f"{f.path}: {key} must be [lo, hi] with 0 <= lo <= hi, got {v!r}")


def mamba2_fields(f: Fields, hidden: int, inner: int | None = None) -> dict:
    """The Mamba2 mixer's settings under the ``mamba_*`` names of Granite 4.0 hybrid, Bamba and
    Falcon-H1 configs, as their transformers configs read them, keyed by the names
    ``stage_server.layers.mamba2`` reads (a family's config dataclass takes them as they are):
    ``mamba_n_heads`` (H), ``mamba_d_head`` (P; ``"auto"``: ``inner / H``), ``mamba_n_groups``,
    ``mamba_d_state``, ``mamba_d_conv``, ``mamba_conv_bias``, ``mamba_proj_bias`` and
    ``time_step_limit`` (the prefill's clamp of ``dt``). ``inner``, the mixer's width ``H P``,
    is ``mamba_expand * hidden`` unless the family sets it (Falcon-H1's ``mamba_d_ssm``).

    Raises:
        CheckpointError: a field of the wrong type or out of range, ``H P`` other than
            ``inner``, heads that do not divide into groups; naming the file and the field.
    """
    heads = f.int("mamba_n_heads", 128, lo=1)
    if inner is None:
        inner = f.int("mamba_expand", 2, lo=1) * hidden
    d_head = f.get("mamba_d_head", "auto")
    d_head = inner // heads if d_head == "auto" else f.int("mamba_d_head", lo=1)
    if d_head * heads != inner:
        raise CheckpointError(f"{f.path}: mamba_d_head ({d_head}) x mamba_n_heads ({heads}) must equal the Mamba "
                              f"width ({inner}: mamba_expand x hidden_size, or mamba_d_ssm)")
    groups = f.int("mamba_n_groups", 1, lo=1)
    if heads % groups:
        raise CheckpointError(f"{f.path}: mamba_n_heads ({heads}) must be a multiple of mamba_n_groups ({groups})")
    return dict(mamba_num_heads=heads, mamba_head_dim=d_head, ssm_state_size=f.int("mamba_d_state", 256, lo=1),
                n_groups=groups, conv_kernel=f.int("mamba_d_conv", 4, lo=2),
                use_conv_bias=f.bool("mamba_conv_bias", True), use_bias=f.bool("mamba_proj_bias", False),
                dt_limit=time_step_limit(f))


def read_config_json(model_dir: str) -> tuple[str, dict]:
    """``(path, the parsed object)`` of ``model_dir/config.json``.

    Raises CheckpointError: the file is missing, unreadable or not a JSON object."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (a Hugging Face checkpoint needs config.json)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
    return path, raw
