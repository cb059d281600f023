"""Load one pipeline stage's slice of a Hugging Face safetensors checkpoint.

Only the tensors the slice needs are read: layers ``[start, end)``, the embedding on the
first stage, the final norm, ``lm_head`` and the ``mtp.*`` head on the last. Two
checkpoint layouts are converted on the fly into the single layout ``model.py`` runs:
Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per key head) and per-expert
MoE weights (``experts.{e}.gate_proj``...), stacked into ``gate_up_proj`` / ``down_proj``.
"""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from .config import CheckpointError, HybridConfig, load_config
from .model import StageModel, rope_frequencies


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

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        path = self.where.get(key)
        if path is None:
            raise CheckpointError(f"{self.model_dir}: tensor {key!r} missing from the checkpoint")
        try:
            if path not in self._handles:
                self._handles[path] = safe_open(path, "pt")
            return self._handles[path].get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {key!r}: {e}") from None

    def file_of(self, key: str) -> str:
        return self.where.get(key, self.model_dir)


def _split_qwen3_next_gdn(cfg: HybridConfig, qkvz: torch.Tensor, ba: torch.Tensor) -> dict[str, torch.Tensor]:
    """Regroup Qwen3-Next's per-key-head interleaved projections into q|k|v, z, b, a rows
    (the reordering of transformers' ``fix_query_key_value_ordering``)."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    grp = cfg.linear_num_value_heads // hk
    h = qkvz.shape[-1]
    per = qkvz.view(hk, 2 * dk + 2 * grp * dv, h)
    q, k, v, z = torch.split(per, [dk, dk, grp * dv, grp * dv], dim=1)
    b, a = torch.split(ba.view(hk, 2 * grp, h), [grp, grp], dim=1)
    flat = lambda t: t.reshape(-1, h)  # noqa: E731
    return {
        "in_proj_qkv": torch.cat([flat(q), flat(k), flat(v)], dim=0),
        "in_proj_z": flat(z),
        "in_proj_b": flat(b),
        "in_proj_a": flat(a),
    }


def _checkpoint_key(cfg: HybridConfig, name: str) -> str:
    """Checkpoint key of a StageModel parameter name (before layout conversions)."""
    if name.startswith("mtp.") or name == "lm_head.weight":
        return name
    if name.startswith("mtp_embed_tokens."):
        return cfg.weight_prefix + name[len("mtp_") :]
    return cfg.weight_prefix + name


def _read_param(reader: CheckpointReader, cfg: HybridConfig, name: str, cache: dict) -> torch.Tensor:
    key = _checkpoint_key(cfg, name)
    if key in reader:
        return reader.get(key)
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return reader.get(cfg.weight_prefix + "embed_tokens.weight")
    base, _, leaf = key.rpartition(".")
    if ".linear_attn.in_proj_" in key and cfg.fused_gdn_projections:
        # base = "...linear_attn.in_proj_qkv" etc; leaf = "weight"
        attn = base.rsplit(".", 1)[0]
        if attn not in cache:
            cache[attn] = _split_qwen3_next_gdn(
                cfg, reader.get(attn + ".in_proj_qkvz.weight"), reader.get(attn + ".in_proj_ba.weight")
            )
        return cache[attn][base.rsplit(".", 1)[1]]
    if key.endswith(".experts.gate_up_proj") or key.endswith(".experts.down_proj"):
        experts = key.rsplit(".", 1)[0]
        e_first = experts + ".0.gate_proj.weight"
        if e_first not in reader:
            raise CheckpointError(
                f"{reader.model_dir}: tensor {key!r} missing (neither stacked nor per-expert weights found)"
            )
        n = cfg.num_experts
        if key.endswith("gate_up_proj"):
            return torch.stack(
                [
                    torch.cat([reader.get(f"{experts}.{e}.gate_proj.weight"), reader.get(f"{experts}.{e}.up_proj.weight")])
                    for e in range(n)
                ]
            )
        return torch.stack([reader.get(f"{experts}.{e}.down_proj.weight") for e in range(n)])
    return reader.get(key)  # raises, naming the tensor


def fill_parameters(model, reader: CheckpointReader, read, key_of, dtype: torch.dtype, device,
                    keep_fp32: tuple[str, ...] = ()):
    """Materialise ``model`` (built on the meta device) on ``device`` in ``dtype`` with every
    parameter read from the checkpoint: ``read(name)`` gives the tensor of parameter
    ``name``, ``key_of(name)`` the checkpoint key an error names. Parameters whose name ends
    with one of ``keep_fp32`` stay fp32 whatever ``dtype`` (as transformers'
    ``_keep_in_fp32_modules_strict``). Returns the model.

    Raises:
        CheckpointError: a tensor missing, of the wrong shape, or with NaN / infinite values
            (in ``dtype``: an fp16 cast can overflow); the message names the file and tensor.
    """
    state = {}
    for name, p in model.named_parameters():
        t = read(name)
        if tuple(t.shape) != tuple(p.shape):
            key = key_of(name)
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
        key = key_of(names[finite.index(False)])
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
) -> tuple[HybridConfig, StageModel]:
    """Build the stage model for layers ``[start, end)``, load its weights and fuse its
    projections (:meth:`StageModel.fuse_projections`): the one way a StageModel is made.

    Args:
        model_dir: checkpoint folder (config.json + safetensors).
        start, end: global decoder-layer range (default: the whole model).
        with_mtp: load the ``mtp.*`` head on the last stage when the checkpoint has one.
        dtype: parameter dtype (``torch.float32`` or ``torch.bfloat16``).

    Raises:
        CheckpointError: missing file or tensor, unsupported model type, a tensor of the
            wrong shape or with NaN / infinite values (in ``dtype``: an fp16 cast can
            overflow); the message names the file and the tensor.
    """
    cfg = load_config(model_dir)
    from .families import family

    fam = family(cfg.model_type)
    if fam is not None:  # a family of its own folder
        return fam.load_stage_model(model_dir, cfg, start, end, dtype, device)
    start = 0 if start is None else start
    end = cfg.num_hidden_layers if end is None else end
    if not (0 <= start < end <= cfg.num_hidden_layers):
        raise CheckpointError(
            f"{model_dir}: layer range [{start}, {end}) is not inside [0, {cfg.num_hidden_layers})"
        )
    reader = CheckpointReader(model_dir)
    # published Qwen3-Next config.json files do not state mtp_num_hidden_layers: the head's
    # tensors do; an explicit 0 turns it off
    has_mtp = cfg.mtp_num_hidden_layers != 0 and "mtp.fc.weight" in reader
    if has_mtp and cfg.num_experts > 0:
        # a router weight makes the MTP layer's MLP the MoE block, gate_proj a dense one
        moe, dense = "mtp.layers.0.mlp.gate.weight" in reader, "mtp.layers.0.mlp.gate_proj.weight" in reader
        if moe != dense:
            cfg.mtp_is_moe = moe
    with torch.device("meta"):
        model = StageModel(cfg, start, end, with_mtp=with_mtp and has_mtp)
    cache: dict = {}
    model = fill_parameters(model, reader, lambda name: _read_param(reader, cfg, name, cache),
                            lambda name: _checkpoint_key(cfg, name), dtype, device)
    # Non-persistent buffers were allocated on "meta": rebuild them on the device.
    model.rotary.inv_freq = rope_frequencies(cfg)[0].to(device)
    model.eval().requires_grad_(False)
    # one GEMM per set of projections reading the same input; on the final device and dtype
    model.fuse_projections()
    if torch.device(device).type == "cuda":
        # hand back the blocks of the per-projection weights the fused ones replaced (the
        # caching allocator would keep them reserved, outside the stage's memory budget)
        torch.cuda.empty_cache()
    return cfg, model
