"""Load one pipeline stage's slice of a Hugging Face safetensors checkpoint.

Only the tensors the slice needs are read: layers ``[start, end)``, the embedding on the
first stage, the final norm, ``lm_head`` and the MTP head on the last. The checkpoint's
family (by ``model_type``; ``stage_server.models``) builds the stage model and maps our
parameter names to its tensors, converting layouts (``models/<family>/weights.py``); what
is common to every family is here: reading safetensors files lazily, shape and finiteness
checks that name the file and the tensor.
"""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from .config import load_config
from .fields import CheckpointError
from .models import family_of


class CheckpointReader:
    """Lazy tensor access across the ``*.safetensors`` files of a checkpoint."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        self.where: dict[str, str] = {}
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: cannot parse weight_map: {e}") from None
            for key, fname in weight_map.items():
                self.where[key] = os.path.join(model_dir, fname)
            for path in sorted(set(self.where.values())):
                if not os.path.isfile(path):
                    raise CheckpointError(f"{path}: missing (listed in {index})")
        else:
            files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
            if not files:
                raise CheckpointError(f"{model_dir}: no *.safetensors weight files")
            for path in files:
                try:
                    with safe_open(path, "pt") as f:
                        for key in f.keys():
                            self.where[key] = path
                except Exception as e:  # safetensors raises its own error types
                    raise CheckpointError(f"{path}: unreadable safetensors file: {e}") from None
        self._handles: dict[str, object] = {}
        self.reads: list[str] = []  # the keys read since the caller last emptied it (fill_parameters)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Tensor ``key``; with ``shape``, checked to have it (a layout conversion checks
        the tensors it joins before joining them). Raises CheckpointError naming the file
        and the tensor."""
        path = self.where.get(key)
        if path is None:
            raise CheckpointError(f"{self.model_dir}: tensor {key!r} missing from the checkpoint")
        try:
            if path not in self._handles:
                self._handles[path] = safe_open(path, "pt")
            t = self._handles[path].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {key!r}: {e}") from None
        self.reads.append(key)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)} "
                                  "from config.json")
        return t

    def stack_experts(self, keys: list[list[str]], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        """Per-expert tensors as one stacked tensor: expert ``e``'s tensors ``keys[e]``
        (the ``j``-th of shape ``shapes[j]``, checked first) joined along dim 0, the
        experts stacked. A tensor of another shape is a CheckpointError naming it."""
        return torch.stack([torch.cat([self.get(k, shape) for k, shape in zip(ks, shapes, strict=True)])
                            for ks in keys])

    def file_of(self, key: str) -> str:
        return self.where.get(key, self.model_dir)


def _checkpoint_key(cfg, name: str) -> str:
    """Checkpoint key of a stage model parameter name (before layout conversions), as the
    config's family maps it."""
    return family_of(cfg).checkpoint_key(cfg, name)


def fill_parameters(model, reader: CheckpointReader, read, key_of, dtype: torch.dtype, device,
                    keep_fp32: tuple[str, ...] = ()):
    """Materialise ``model`` (built on the meta device) on ``device`` in ``dtype`` with every
    parameter read from the checkpoint: ``read(name)`` gives the tensor of parameter
    ``name`` (reading ``reader``); an error names the one tensor it read, or, where it
    joined several or read none (a converted layout), ``key_of(name)``. Parameters whose name ends
    with one of ``keep_fp32`` stay fp32 whatever ``dtype`` (as transformers'
    ``_keep_in_fp32_modules_strict``). Returns the model.

    Raises:
        CheckpointError: a tensor missing, of the wrong shape, or with NaN / infinite values
            (in ``dtype``: an fp16 cast can overflow); the message names the file and tensor.
    """
    state, sources = {}, {}
    for name, p in model.named_parameters():
        reader.reads = []
        t = read(name)
        # the tensor an error names: the one read where the parameter is one checkpoint
        # tensor under another name (an alternative prefix, a tied embedding), else its key
        sources[name] = reader.reads[0] if len(reader.reads) == 1 else key_of(name)
        if tuple(t.shape) != tuple(p.shape):
            key = sources[name]
            raise CheckpointError(
                f"{reader.file_of(key)}: tensor {key!r} has shape {tuple(t.shape)}, "
                f"expected {tuple(p.shape)} from config.json"
            )
        state[name] = t.to(torch.float32 if name.endswith(keep_fp32) else dtype) if keep_fp32 else t.to(dtype)
    model = model.to_empty(device=device).to(dtype)
    for name, p in model.named_parameters():
        if keep_fp32 and name.endswith(keep_fp32):
            p.data = p.data.float()
    model.load_state_dict(state, strict=False, assign=False)
    # caught here, not by whichever stage's output turns NaN (PP1 would emit token 0); on
    # the device (a CPU pass over a large bf16 checkpoint is slow), one read for all
    names, params = zip(*model.named_parameters())
    finite = torch.stack([torch.isfinite(p).all() for p in params]).tolist()
    if not all(finite):
        key = sources[names[finite.index(False)]]
        raise CheckpointError(f"{reader.file_of(key)}: tensor {key!r} has NaN or infinite values"
                              + ("" if dtype == torch.float32 else f" in {str(dtype).removeprefix('torch.')}"))
    return model


def load_stage_model(
    model_dir: str,
    start: int | None = None,
    end: int | None = None,
    with_mtp: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple:
    """Build the stage model for layers ``[start, end)`` (``ModelFamily.stage_model`` of the
    checkpoint's family), load its weights and finish it (its ``finish_load``: buffers,
    fused projections): the one way a stage model is made. Returns ``(cfg, model)``.

    Args:
        model_dir: checkpoint folder (config.json + safetensors).
        start, end: global decoder-layer range (default: the whole model).
        with_mtp: load the MTP head on the last stage when the checkpoint has one
            (``ModelFamily.has_mtp``).
        dtype: parameter dtype (``torch.float32`` or ``torch.bfloat16``).

    Raises:
        CheckpointError: missing file or tensor, unsupported model type, a tensor of the
            wrong shape or with NaN / infinite values (in ``dtype``: an fp16 cast can
            overflow); the message names the file and the tensor.
    """
    cfg = load_config(model_dir)
    start = 0 if start is None else start
    end = cfg.num_hidden_layers if end is None else end
    if not (0 <= start < end <= cfg.num_hidden_layers):
        raise CheckpointError(
            f"{model_dir}: layer range [{start}, {end}) is not inside [0, {cfg.num_hidden_layers})"
        )
    reader = CheckpointReader(model_dir)
    family = family_of(cfg)
    has_mtp = family.has_mtp(cfg, reader)
    with torch.device("meta"):
        model = family.stage_model(cfg, start, end, with_mtp and has_mtp)
    cache: dict = {}
    model = fill_parameters(model, reader, lambda name: family.read_param(reader, cfg, name, cache),
                            lambda name: family.checkpoint_key(cfg, name), dtype, device, keep_fp32=family.keep_fp32)
    model.eval().requires_grad_(False)
    # non-persistent buffers were allocated on "meta": the family rebuilds them on the
    # device, and fuses projections reading the same input (one GEMM each) on the final
    # device and dtype
    model.finish_load(device)
    if torch.device(device).type == "cuda":
        # hand back the blocks of the per-projection weights the fused ones replaced (the
        # caching allocator would keep them reserved, outside the stage's memory budget)
        torch.cuda.empty_cache()
    return cfg, model
