"""What the Mamba2 hybrids with a ``model.``-prefixed Llama-style layout share (Granite 4.0
hybrid, Bamba, Falcon-H1; docs/DESIGN.md, "Layer families"): the stage model's skeleton
(:class:`HybridStageModel`: which layers hold Mamba2 state or paged KV, the residual
stream through the layers, the embedding and logits with their multipliers) and the
checkpoint's tensor names (:class:`HybridFamily`: the parameter name under ``model.``,
``lm_head`` the embedding when tied). A family folder adds its decoder layer and its config."""
from __future__ import annotations

import torch
from torch import nn

from ..family import ModelFamily
from ..graphs import family_graphs
from ..layers.common import RMSNorm
from ..layers.mamba2 import MAMBA2
from ..layers.rotary import Rotary, rope_frequencies

MAMBA = "linear_attention"   # a layer kind (``cfg.layer_types``) with a Mamba2 mixer
ATTENTION = "full_attention"  # a layer kind with attention over paged KV
PARALLEL = "hybrid"           # both in one layer, side by side (Falcon-H1)


def checkpoint_key(cfg, name: str) -> str:
    """The checkpoint key of stage-model parameter ``name``: under ``cfg.weight_prefix``
    (``model.``), ``lm_head.weight`` as it is."""
    return name if name == "lm_head.weight" else cfg.weight_prefix + name


def read_param(reader, cfg, name: str, cache: dict | None = None) -> torch.Tensor:
    """Parameter ``name`` from the checkpoint; ``lm_head.weight`` is the embedding's when the
    checkpoint ties them and has no head of its own. Raises CheckpointError naming the tensor."""
    key = checkpoint_key(cfg, name)
    if name == "lm_head.weight" and key not in reader and cfg.tie_word_embeddings:
        return reader.get(cfg.weight_prefix + "embed_tokens.weight")
    return reader.get(key)  # raises, naming the tensor


class HybridFamily(ModelFamily):
    """A model family whose checkpoint holds the stage model's parameters under
    ``cfg.weight_prefix`` (:func:`checkpoint_key`, :func:`read_param`); a subclass gives
    ``name``, ``model_types``, ``parse_config`` and ``stage_model``."""

    def checkpoint_key(self, cfg, name: str) -> str:
        return checkpoint_key(cfg, name)

    def read_param(self, reader, cfg, name: str, cache: dict) -> torch.Tensor:
        return read_param(reader, cfg, name, cache)


class HybridStageModel(nn.Module):
    """Decoder layers ``[start, end)`` of a Mamba2 hybrid, plus the embedding (first stage)
    and the final norm and ``lm_head`` (last stage): the stage model of
    ``stage_server.family.ModelFamily`` (no MTP head).

    A subclass builds ``self.layers`` (``nn.ModuleDict`` by global index) after calling
    ``__init__``; each layer is ``layer(x, meta, state, residual) -> (h, residual)`` with the
    residual stream as a pair whose sum it is (the next norm fuses the add). ``cfg`` has
    ``layer_types`` (:data:`MAMBA`, :data:`ATTENTION`, :data:`PARALLEL`), ``use_rope``, and
    may have ``embedding_multiplier`` (the embedding's scale, applied here: the runner hands
    the first stage the raw ``embed_tokens`` output) and the logits' ``logits_multiplier``.

    final_norm: the attribute name of the final norm (the checkpoint's: ``norm``,
    ``final_layernorm``).
    """

    layer_family = MAMBA2  # the recurrent layers' family (stage_server.family.LayerFamily)
    shared_kv = False
    # the Mamba2 prefill's chunked scan (plain torch on CUDA) reads sequence bounds on the host
    prefill_capturable = False

    @property
    def capturable(self) -> bool:
        """Decode / verify in CUDA graphs: unless ``PPSPEC_FAMILY_GRAPHS=0``
        (``graphs.family_graphs``). Granite's MoE layers run their experts without a host
        read on CUDA (``layers.moe.routed_experts``)."""
        return family_graphs()

    def __init__(self, cfg, start: int, end: int, final_norm: str = "norm"):
        super().__init__()
        self.cfg, self.start, self.end = cfg, start, end
        self.is_first, self.is_last = start == 0, end == cfg.num_hidden_layers
        self.rotary = Rotary(cfg) if cfg.use_rope else None
        if self.is_first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self._final_norm = final_norm
        if self.is_last:
            setattr(self, final_norm, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def _kinds(self, *kinds: str) -> list[int]:
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] in kinds]

    @property
    def state_layers(self) -> list[int]:
        """The stage's layers with a Mamba2 mixer (global indices), in pool order."""
        return self._kinds(MAMBA, PARALLEL)

    @property
    def kv_layers(self) -> list[int]:
        """The stage's layers with attention, with paged KV."""
        return self._kinds(ATTENTION, PARALLEL)

    def finish_load(self, device) -> None:
        """After loading (``loader.load_stage_model``): the RoPE frequencies rebuilt on the
        device (made on meta), then every module's projections fused (attention q/k/v, MLP
        gate/up: one GEMM each; Mamba2 conv weights tap-major)."""
        if self.rotary is not None:
            self.rotary.inv_freq = rope_frequencies(self.cfg)[0].to(device)
        for m in self.modules():
            if m is not self and hasattr(m, "fuse_projections"):
                m.fuse_projections()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, meta, hidden: torch.Tensor, layer_states: dict) -> torch.Tensor:
        """``[T, hidden]`` after layer ``end - 1``, before the final norm. layer_states: global
        layer index -> its pool views (``stage_server.family.ModelFamily``)."""
        m = getattr(self.cfg, "embedding_multiplier", 1.0)
        if self.is_first and m != 1.0:
            hidden = hidden * m
        residual = None
        for i, layer in self.layers.items():
            hidden, residual = layer(hidden, meta, layer_states.get(int(i)), residual)
        return hidden + residual

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``lm_head(final_norm(hidden)) * logits_multiplier``; fp32 with ``upcast``."""
        logits = self.lm_head(getattr(self, self._final_norm)(hidden))
        m = getattr(self.cfg, "logits_multiplier", 1.0)
        if m != 1.0:
            logits = logits * m
        return logits.float() if upcast else logits
