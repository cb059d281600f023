"""Load one pipeline stage's slice of a Kimi Linear safetensors checkpoint.

Only the tensors of layers ``[start, end)`` (and the embedding on the first stage, the final
norm and ``lm_head`` on the last) are read. Checkpoint layouts accepted, as transformers'
conversion mapping for ``kimi_linear`` accepts them: the MLP under ``mlp.`` or
``block_sparse_moe.``; experts per expert (``experts.{e}.w1`` gate, ``w3`` up, ``w2`` down:
the published layout, and what transformers' ``save_pretrained`` writes) or stacked
(``experts.gate_up_proj`` ``[E, 2I, hidden]``, ``experts.down_proj`` ``[E, hidden, I]``).
"""
from __future__ import annotations

import torch

from ...config import CheckpointError
from ...loader import CheckpointReader, fill_parameters
from .config import KimiLinearConfig
from .model import KimiStageModel

_MLP_PREFIXES = (".mlp.", ".block_sparse_moe.")
# kept fp32 in a bf16 stage, as transformers keeps them (``_keep_in_fp32_modules_strict``): the
# router's weight and correction bias choose the experts, dt_bias shifts the forget gate
KEEP_FP32 = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias", ".self_attn.dt_bias")


def _read(reader: CheckpointReader, cfg: KimiLinearConfig, name: str) -> torch.Tensor:
    """The checkpoint tensor of parameter ``name`` of :class:`KimiStageModel`."""
    key = cfg.weight_prefix + name if name != "lm_head.weight" else name
    if key in reader:
        return reader.get(key)
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return reader.get(cfg.weight_prefix + "embed_tokens.weight")
    if ".mlp." not in key:
        return reader.get(key)  # raises, naming the tensor
    for alt in (key.replace(".mlp.", p, 1) for p in _MLP_PREFIXES):
        if alt in reader:
            return reader.get(alt)
    if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        for p in _MLP_PREFIXES:
            experts = key.rsplit(".", 1)[0].replace(".mlp.", p, 1)
            if f"{experts}.0.w1.weight" not in reader:
                continue
            e = range(cfg.num_experts)
            if key.endswith("gate_up_proj"):
                return torch.stack([torch.cat([reader.get(f"{experts}.{i}.w1.weight"),
                                               reader.get(f"{experts}.{i}.w3.weight")]) for i in e])
            return torch.stack([reader.get(f"{experts}.{i}.w2.weight") for i in e])
    raise CheckpointError(f"{reader.model_dir}: tensor {key!r} missing from the checkpoint (also looked under "
                          f"block_sparse_moe. and for per-expert w1 / w2 / w3)")


def load_kimi_stage_model(model_dir: str, cfg: KimiLinearConfig, start: int | None, end: int | None,
                          dtype: torch.dtype = torch.float32, device="cpu") -> tuple[KimiLinearConfig, KimiStageModel]:
    """Build the stage model for layers ``[start, end)`` (default the whole model), load its
    weights and fuse its projections; as ``stage_server.loader.load_stage_model``.

    Raises:
        CheckpointError: a missing file or tensor, a tensor of the wrong shape or with NaN /
            infinite values, a layer range outside the model; the message names the file and
            the tensor.
    """
    start = 0 if start is None else start
    end = cfg.num_hidden_layers if end is None else end
    if not (0 <= start < end <= cfg.num_hidden_layers):
        raise CheckpointError(f"{model_dir}: layer range [{start}, {end}) is not inside [0, {cfg.num_hidden_layers})")
    reader = CheckpointReader(model_dir)
    with torch.device("meta"):
        model = KimiStageModel(cfg, start, end)
    model = fill_parameters(model, reader, lambda n: _read(reader, cfg, n),
                            lambda n: cfg.weight_prefix + n if n != "lm_head.weight" else n, dtype, device,
                            keep_fp32=KEEP_FP32)
    model.eval().requires_grad_(False)
    model.fuse_projections()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the per-projection blocks the fused weights replaced
    return cfg, model
