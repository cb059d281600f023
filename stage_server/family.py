"""The seam between a stage and the models it serves (docs/DESIGN.md, "Layer families").

Two kinds of family:

- A **layer family** (:class:`LayerFamily`; one module under ``stage_server/layers/``,
  e.g. ``layers/gdn.py``) is a token mixer with recurrent state: what it keeps per row
  (:class:`StateSpec`), what the replay commit design records per verify step
  (:class:`RecordSpec`), how pending replay steps are applied (:meth:`LayerFamily.flush`),
  and its ``nn.Module``, whose forward runs every mode (prefill chunks, decode, verify of
  ``D`` tokens) from a :class:`~stage_server.batch.BatchMeta`. Several model families
  share one layer family (Mamba2 serves NemotronH, Granite 4.0 hybrid, Falcon-H1, Bamba).
- A **model family** (:class:`ModelFamily`; one folder under ``stage_server/models/``,
  e.g. ``models/qwen3_next/``) is a checkpoint format: the ``model_type`` values it
  serves, its config parser, its stage model (which layers, which layer family), its
  loader mapping (checkpoint tensor names to ours, layout conversions) and whether the
  checkpoint has an MTP head. ``stage_server/models/__init__.py`` lists every family
  (``FAMILIES``) and maps ``model_type`` to it.

The stage (``StageRunner``) never names a family: it allocates the state pool from the
stage model's declaration (``pools.RowStatePool``), hands each layer its pool views, and
commits every verify through the one commit rule, ``RowStatePool.commit``
(docs/DESIGN.md, "Commit rule"), the same for every family: scratch-kept state is copied
from the accepted step, replayed state is marked pending and replayed by the family's
kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch import nn

# How a state tensor is kept across a verify (``StateSpec.verify``):
SCRATCH = "scratch"  # the state after every verify step, in a scratch at the row, in both commit
#                      designs (small: conv windows); the commit copies the accepted step's
REPLAY = "replay"    # copy design: a scratch as above; replay design: no scratch, the family's
#                      record of each step's inputs (RecordSpec) is kept and the commit marks
#                      the accepted steps pending, replayed by the row's next step (LayerFamily.flush)


@dataclass(frozen=True)
class StateSpec:
    """One tensor a layer keeps per row (``req_pool_index``).

    name: attribute of the pool and of the layer's :class:`LayerState` (``conv``, ``ssm``).
    shape: per row, e.g. GDN ``conv (conv_dim, K - 1)``, ``ssm (HV, K, V)``.
    dtype: None = the stage's dtype; recurrent states are ``torch.float32``.
    verify: :data:`SCRATCH` or :data:`REPLAY`, how a verify keeps it (see there).
    column_major: store the last two dims transposed (a conv window ``[C, W - 1]`` whose
        step columns are ``C`` consecutive elements, as the GPU conv kernels load them);
        the tensor is seen with ``shape`` either way.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    verify: str = SCRATCH
    column_major: bool = False


@dataclass(frozen=True)
class RecordSpec:
    """One per-step input the replay design keeps at the row (fp32 whatever the model's
    dtype, so that a bf16 stage replays exactly what it verified). The pool allocates it
    ``[R, 2, D, *shape]`` per layer: two slots (the accepted steps of the last verify and
    the steps of the one running), ``D`` steps each. GDN: ``k (H, K)``, ``delta (HV, V)``,
    ``g (HV,)``; Mamba2 would keep ``dt``, ``B``, ``C``, ``x``."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StateLayout:
    """What one layer of ``family`` keeps per row: its state tensors, and its replay
    record (empty when the family has no replay design)."""

    family: LayerFamily
    state: tuple[StateSpec, ...]
    record: tuple[RecordSpec, ...] = ()


class LayerState:
    """One layer's views of the state pool, handed to the layer's forward.

    ``st.<name>``: ``[R, *shape]`` committed state of each :class:`StateSpec`;
    ``st.<name>_scratch``: ``[R, D, *shape]`` its verify scratch, or None (no verify, or a
    :data:`REPLAY` tensor under the replay design); ``st.replay``: the family's record
    (``LayerFamily.record_type``: the :class:`RecordSpec` tensors ``[R, 2, D, *shape]``,
    then ``pending``, ``slot`` ``[R]`` int32) under the replay design, else None.
    """

    def __init__(self, state: dict[str, torch.Tensor], scratch: dict[str, torch.Tensor | None], replay: Any):
        self.state, self.scratch, self.replay = state, scratch, replay

    def __getattr__(self, name: str) -> torch.Tensor | None:
        d = self.__dict__
        if name in d["state"]:
            return d["state"][name]
        if name.endswith("_scratch") and name[: -len("_scratch")] in d["state"]:
            return d["scratch"][name[: -len("_scratch")]]
        raise AttributeError(name)


class LayerFamily:
    """A token mixer with recurrent state. Subclass it once per family (one module under
    ``stage_server/layers/``) and hand an instance to your stage model (``layer_family``).

    The family's ``nn.Module`` has ``forward(x [T, hidden], meta, st: LayerState) ->
    [T, hidden]`` and runs every mode of ``meta`` (``BatchMeta.mode``, per part of a
    ``MixedMeta``: ``stage_server.batch.per_part``):

    - prefill: a chunk per request, packed; starts from ``st.<name>[row]`` where
      ``meta.has_init`` (a continuing chunk), else from zeros; the final state written to
      ``st.<name>[row]`` (it is committed).
    - decode: one token per request, the state updated in place at ``row``.
    - verify: ``D`` tokens per request, the committed state left as it was: copy design,
      the state after each step ``j`` into ``st.<name>_scratch[row, j]``; replay design,
      :data:`SCRATCH` tensors likewise and each step's inputs into ``st.replay`` (the
      family's replay kernel first applies the row's pending steps, as a decode does).

    Rows are always ``meta.rows`` (``req_pool_indices``), never batch positions.
    """

    name: str = ""
    # the per-layer replay record handed to the layer: a NamedTuple whose fields are the
    # RecordSpec names in order, then ``pending`` and ``slot``; None: no replay design
    record_type: type | None = None

    def layout(self, cfg) -> StateLayout:
        """The per-row state (and replay record) of one layer for config ``cfg``."""
        raise NotImplementedError

    def flush(self, st: LayerState, rows: torch.Tensor) -> None:
        """Replay design: apply ``rows``' pending accepted steps to their committed state
        now (``rows`` ``[B]`` int64 on the pool's device; before a prefill continues a row
        and before a snapshot reads it), and set their pending counts to 0."""
        raise NotImplementedError(f"layer family {self.name!r} has no replay design")


class ModelConfig(Protocol):
    """What the stage and the router read of any family's config object (the family's
    own fields are its business): sizes of the embedding and of the paged KV cache
    (``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` per token of an
    attention layer), the context and the stop tokens."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: list[int]

    @property
    def max_context(self) -> int: ...


class ModelFamily:
    """A checkpoint format, one folder ``stage_server/models/<name>/``. Subclass it in the
    folder's ``__init__.py``, fill in the attributes and methods, make one instance
    (``FAMILY``) and add it to ``stage_server.models.FAMILIES``. ``reader`` below is the
    loader's ``CheckpointReader`` (``reader.get(key)``, ``key in reader``).

    The stage model it builds (``stage_model``) is an ``nn.Module`` with parameter names
    that :meth:`checkpoint_key` maps, and:

    - ``start``, ``end``, ``is_first``, ``is_last``, ``cfg``; ``embed_tokens`` (first
      stage), ``embed(ids)`` (first stage, or the MTP head's copy), ``logits(h, upcast)``
      (last stage), and with an MTP head ``mtp`` / ``mtp_logits`` (``models/qwen3_next``,
      ``models/nemotron_h``).
    - ``layer_family``: its :class:`LayerFamily` (one per model), or None.
    - ``state_layers``: global indices of its layers with recurrent state, in pool order;
      ``kv_layers``: those with paged KV (a layer may be in both: attention and a mixer in
      parallel, as Falcon-H1's).
    - ``capturable``: whether its decode / verify forward can be recorded in a CUDA graph
      (False when a layer reads the device on the host, or the family's graphs are switched off);
      ``prefill_capturable`` (default True): whether its short prefill chunks can be too
      (``graphs.PrefillGraphs``; False where a prefill reads sequence bounds on the host).
    - ``forward(meta, hidden, layer_states) -> [T, hidden]`` (pre final norm), where
      ``layer_states[i]`` is a :class:`LayerState` for a state layer, ``(k_cache, v_cache)``
      for a KV layer, ``(LayerState, (k_cache, v_cache))`` for a layer that is both.
    - ``fuse_projections()`` and ``finish_load(device)`` hooks after the weights load.
    """

    name: str = ""
    model_types: tuple[str, ...] = ()
    # parameter name suffixes kept fp32 in a bf16 / fp16 stage (transformers'
    # ``_keep_in_fp32_modules_strict``), e.g. a router's weight
    keep_fp32: tuple[str, ...] = ()
    # whether the family loads an MTP head where the checkpoint has one (``has_mtp``); a
    # family that does not refuses ``speculative_algorithm="mtp"`` whatever the checkpoint holds
    serves_mtp: bool = False

    def parse_config(self, path: str, raw: dict) -> ModelConfig:
        """The config object of ``raw`` (the parsed ``config.json`` at ``path``).
        Raises CheckpointError naming ``path`` and the field for anything not served."""
        raise NotImplementedError

    def stage_model(self, cfg, start: int, end: int, with_mtp: bool) -> nn.Module:
        """The stage model of decoder layers ``[start, end)`` (built on the meta device by
        the loader, then loaded)."""
        raise NotImplementedError

    def checkpoint_key(self, cfg, name: str) -> str:
        """The checkpoint tensor of our parameter ``name`` (before layout conversions)."""
        return name

    def read_param(self, reader, cfg, name: str, cache: dict) -> torch.Tensor:
        """Our parameter ``name`` from the checkpoint, converted to our layout (fused or
        per-expert tensors split or stacked; ``cache`` lives for one load). Raises
        CheckpointError naming the file and the tensor."""
        return reader.get(self.checkpoint_key(cfg, name))

    def layer_ranges(self, cfg, pp_size: int) -> list[tuple[int, int]]:
        """Each PP rank's decoder layers ``[start, end)``; by default :func:`split_layers`.
        Raises ValueError for a ``pp_size`` the model cannot be split into."""
        return split_layers(cfg.num_hidden_layers, pp_size)

    def has_mtp(self, cfg, reader) -> bool:
        """Whether the checkpoint has an MTP head (may complete ``cfg`` from its tensors)."""
        return False


def split_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, the first ``num_layers % pp_size`` stages one layer longer."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pp_size must be in [1, {num_layers}] for {num_layers} layers, got {pp_size}")
    base, extra = divmod(num_layers, pp_size)
    ranges, start = [], 0
    for k in range(pp_size):
        end = start + base + (1 if k < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges
