"""StageRunner: one pipeline stage's compute — its model slice, pools, and the commit.

The path of one micro-batch through a stage, top to bottom, is :meth:`StageRunner.step`:
build the batch layout, take KV pages, run the layers; on the last stage also compute
logits, accept drafts, sample, and draft the next round with the MTP head.
:meth:`StageRunner.commit_accept` is the one commit every stage runs, the last included.

The runner is synchronous and single-threaded; the gRPC servicer (``server.py``) and the
in-process pipeline (``ppspec.router.pipeline``) call it the same way.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import time
import weakref

import torch

from .batch import DECODE, PREFILL, VERIFY, BatchMeta, MixedMeta
from .budget import check_fits, gib, pool_bytes
from .config import PAGE_SIZE
from .family import ModelConfig, split_layers  # noqa: F401  (split_layers: tests import it from here)
from .loader import load_stage_model
from .models import family_of
from .graphs import CommitGraphs, MixedGraphs, PrefillGraphs, StepGraphs
from .graphs import mixed_graph_tokens as default_mixed_graph_tokens
from .pools import COMMIT_DESIGNS, KVPool, RowStatePool, device_int64
from ppspec.kernels.attention import flashinfer as fi_attention
from ppspec.kernels.checks import known
from ppspec.proto.messages import SamplingSpec, StepInput, StepOutput

from .grammar import GrammarRows
from .rows import RowTable
from .sampler import accept, sample_targets
from .faults import FAULTS, SNAPSHOT_FAULTS, CommitFaults  # noqa: F401  (FAULTS: tests import it from here)
from .mtp import ChainIndex, MTPDrafter
from .snapshots import SnapshotPool, snapshot_nbytes, slots_for_budget
from .validation import RowStateError, StepChecker, brief  # noqa: F401  (RowStateError, brief: the server's)


def on_stage_device(method):
    """Run a :class:`StageRunner` method with the stage's CUDA device current. Kernels
    (Triton's), graph replays and host-to-device copies go to the *current* device, which in a
    process holding stages on several GPUs (an in-process pipeline) is not this stage's."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)

    return wrapper

log = logging.getLogger("ppspec.stage")
_GREEDY = SamplingSpec()  # the sampling of a request whose step names none
# prefill chunks of a mixed micro-batch that may replay one prefill graph each (StageRunner._graph_runs):
# not measured; a replay's host fill is ~0.1-0.3 ms where an eager forward of the 1.46B
# checkpoint takes tens of ms of host time on the H200 (docs/PERFORMANCE.md, "Prefill and the token budget")
MAX_CHUNK_REPLAYS = 8



@dataclasses.dataclass
class _Sampling:
    """One part of a step on the last stage between its targets and their read
    (``StageRunner._targets`` / ``_sampled``)."""

    sample: list[bool]
    specs: list[SamplingSpec]
    output_lens: list[int]
    drafts: list[list[int]] = dataclasses.field(default_factory=list)
    num_drafts: list[int] = dataclasses.field(default_factory=list)
    cu: list[int] | None = None  # a prefill's cu_seqlens, host ints
    mask: object | None = None  # the grammar's TokenMask
    targets: torch.Tensor | None = None  # [B, D] on the device; None: nothing sampled
    logits: torch.Tensor | None = None


def _device_uuid(device: torch.device) -> str:
    """The accelerator's identity, equal for stages that share it whatever their
    ``CUDA_VISIBLE_DEVICES`` numbering; "" on the CPU (each CPU stage counts on its own)."""
    if device.type != "cuda":
        return ""
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")


def _reserved(device: torch.device) -> int:
    """Bytes the caching allocator holds on ``device`` (0 off CUDA)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


class StageRunner:
    """One stage of the pipeline.

    Args:
        model_dir: Hugging Face checkpoint folder.
        pp_rank, pp_size: this stage's rank and the pipeline size; layers split by
            its family (``ModelFamily.layer_ranges``; by default :func:`split_layers`)
            unless ``layer_range`` is given.
        max_rows: request rows (``req_pool_index`` in ``[0, max_rows)``; row ``max_rows`` pads).
        kv_tokens: KV token budget of this stage's attention pool (tokens).
        num_speculative_steps: drafts per round (verify D = steps + 1); 0 = no speculation.
        use_mtp: draft with the checkpoint's MTP head (last stage).
        max_context: longest sequence (tokens); default the checkpoint's
            (the config's ``max_context``: max_position_embeddings with its RoPE scaling).
        memory_budget: bytes this stage may use for weights, pools and CUDA graphs (several
            stages can share one GPU); weights and pools beyond it raise ValueError once
            the weights are loaded, before any pool is allocated, and the graphs (measured
            as captured: the allocator's growth over the capture) right after capture.
        commit_design: how a verify's accepted GDN state is committed (``StatePool``):
            ``"copy"`` (the state after every verify step in a scratch, the commit copies
            one back; the reference) or ``"replay"`` (the verify keeps only the steps'
            inputs, the commit records the accept length, the next verify or decode
            replays it: docs/DESIGN.md, "Commit rule"). None: ``"replay"`` on CUDA, ``"copy"`` on CPU.
        strict_lengths: refuse a step whose ``seq_lens`` differ from the tokens its row
            holds (prefill and decode add their tokens, a commit adds the accepted ones).
            The gRPC stage turns it on; off, a caller may re-run a step at one length
            (benchmarks do).
        cuda_graph_max_bs: decode and verify steps of up to this many requests replay CUDA
            graphs (``stage_server.graphs``), one per padded batch size, captured at start,
            and so do commits of as many rows and short prefill chunks (``PrefillGraphs``);
            0 runs every step eagerly. None: ``min(max_rows, 256)`` on CUDA, 0 on CPU. On a
            CPU stage a positive value runs the graphs' padded path eagerly (tests). The Mamba2
            hybrids and Kimi Linear run eagerly with ``PPSPEC_FAMILY_GRAPHS=0``
            (``graphs.family_graphs``; their prefill chunks always).
        mixed_graph_tokens: a mixed micro-batch of decodes or verifies beside one request's
            chunk of this many tokens (the long prefill bucket that holds it: both of its
            graphs) replays one graph per batch size (``graphs.MixedGraphs``); 0: none.
            None: ``PPSPEC_MIXED_GRAPH_TOKENS`` (default 512, the router's
            ``--mixed-prefill-tokens`` on CUDA). Long buckets exist where graphs are captured.

    Eager prefill chunks take FlashInfer's attention where it is installed and the stage
    allows it (bf16/fp16 on CUDA; ``PPSPEC_ATTENTION_BACKEND``, ``auto`` by default, see
    ``kernels.attention.flashinfer``), its kernel built at start; decode, verify and
    graph-replayed chunks take the Triton kernel.

    Every step is validated before any pool is touched (:meth:`check_input`, the rows'
    state, then KV pages for the whole step, MTP head included, all or nothing). A step
    that still fails while running releases the rows it started; rows it continued whose
    state it may have half-written are refused (:class:`RowStateError`) until released.

    Raises:
        CheckpointError: the checkpoint cannot be loaded. ValueError: bad arguments, CUDA
        asked for but absent, ``PPSPEC_ATTENTION_BACKEND=flashinfer`` where FlashInfer
        cannot run (checked before the weights load) or its kernel fails to build (after
        the pools), or the memory budget is too small.
    """

    def __init__(
        self,
        model_dir: str,
        pp_rank: int = 0,
        pp_size: int = 1,
        *,
        max_rows: int = 64,
        kv_tokens: int = 65536,
        page_size: int = PAGE_SIZE,
        num_speculative_steps: int = 0,
        use_mtp: bool = False,
        max_context: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        layer_range: tuple[int, int] | None = None,
        fault: str | None = None,
        memory_budget: int | None = None,
        commit_design: str | None = None,
        strict_lengths: bool = False,
        cuda_graph_max_bs: int | None = None,
        prefix_cache_gb: float = 0.0,
        mixed_graph_tokens: int | None = None,
    ):
        from .config import load_config

        for name, v, least in (("max_rows", max_rows, 1), ("kv_tokens", kv_tokens, 1), ("page_size", page_size, 1),
                               ("num_speculative_steps", num_speculative_steps, 0),
                               ("max_context", 1 if max_context is None else max_context, 1),
                               ("mixed_graph_tokens", 0 if mixed_graph_tokens is None else mixed_graph_tokens, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {v!r}")
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pp_rank must be in [0, pp_size = {pp_size}), got {pp_rank}")
        if commit_design is None:
            commit_design = "replay" if str(device).startswith("cuda") else "copy"
        if commit_design not in COMMIT_DESIGNS:
            raise ValueError(
                f"commit_design must be one of {', '.join(COMMIT_DESIGNS)} (or None: replay on CUDA, copy on CPU), "
                f"got {commit_design!r}"
            )
        self.commit_design = commit_design
        if str(device).startswith("cuda"):
            if not torch.cuda.is_available():
                raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
            idx = torch.device(device).index
            if idx is None:  # "cuda": the current device
                idx = torch.cuda.current_device()
            if idx >= torch.cuda.device_count():
                raise ValueError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA devices")
            # loading, the pools and graph capture below launch on the current device; a
            # stage's methods make it current again (on_stage_device) for later calls
            torch.cuda.set_device(idx)
            device = f"cuda:{idx}"
        cfg = load_config(model_dir)
        # before the weights load: a stage that cannot honour PPSPEC_ATTENTION_BACKEND
        # says so at once (eager prefill attention: FlashInfer or Triton)
        self.flashinfer_prefill = fi_attention.stage_uses_flashinfer(
            device, dtype, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
        start, end = layer_range or family_of(cfg).layer_ranges(cfg, pp_size)[pp_rank]
        self.cfg: ModelConfig
        self.cfg, self.model = load_stage_model(model_dir, start, end, with_mtp=use_mtp, dtype=dtype, device=device)
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.is_first, self.is_last = self.model.is_first, self.model.is_last
        if use_mtp and self.is_last and not hasattr(self.model, "mtp"):
            family = family_of(cfg)
            if not family.serves_mtp:  # e.g. Granite, Bamba, Falcon-H1, Kimi Linear: no head loaded
                raise ValueError(f"{model_dir}: speculative algorithm mtp is not served for model_type "
                                 f"{cfg.model_type!r} (family {family.name} loads no MTP head, whatever the "
                                 "checkpoint holds); use ngram")
            raise ValueError(f"{model_dir}: speculative algorithm mtp needs an mtp.* head in the checkpoint")
        self.use_mtp = use_mtp and self.is_last
        self.num_steps = num_speculative_steps
        self.max_rows = max_rows
        self.device, self.dtype = torch.device(device), dtype
        if max_context is not None and max_context > cfg.max_context:
            raise ValueError(f"max_context {max_context} is more than the checkpoint's {cfg.max_context} tokens "
                             f"(max_position_embeddings {cfg.max_position_embeddings}, with its RoPE scaling)")
        self.max_context = max_context or cfg.max_context
        if fault is not None and fault not in FAULTS + SNAPSHOT_FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        c = self.cfg
        d = num_speculative_steps + 1
        lin, att = self.model.state_layers, self.model.kv_layers
        # the recurrent layers' per-row state, as their family declares it (docs/DESIGN.md,
        # "Layer families")
        layout = self.model.layer_family.layout(c) if lin else None
        # FlashInfer only where this stage has attention to run (its layers or the MTP head's)
        self.flashinfer_prefill = self.flashinfer_prefill and bool(att or self.use_mtp)
        self._state_slot = {layer: i for i, layer in enumerate(lin)}
        self._kv_slot = {layer: i for i, layer in enumerate(att)}
        # Verify writes up to D - 1 tokens past the committed length: reserve them.
        ctx = self.max_context + d
        # a long prefill bucket's padding sequence runs on the padding row through its page
        # table: every row's table covers the bucket that holds a chunk of the whole context,
        # also where it is longer than the context (an 8192-token context left an 8000-token
        # chunk without its 8256-token graph, run eagerly: docs/PERFORMANCE.md, "The served
        # path's own cost of a long prompt"); longer buckets would never be used
        longer = [t for t in PrefillGraphs._long_tokens(self.device.type == "cuda", 1 << 40) if t - 1 >= ctx]
        self.prefill_kv_len = max(ctx, min(longer, default=0) - 1)
        pool_bytes = None
        if memory_budget is not None:
            pool_bytes = self._check_budget(memory_budget, layout, len(lin), len(att), kv_tokens, page_size, d)
        self.kv = KVPool(len(att), max_rows, kv_tokens, page_size, c.num_key_value_heads, c.head_dim,
                         self.prefill_kv_len, dtype, device,
                         shared_kv=self.model.shared_kv) if att else None
        self.state = RowStatePool(layout, len(lin), max_rows, d, dtype, device,
                                  commit_design=commit_design) if lin else None
        self.mtp_kv = (
            KVPool(1, max_rows, kv_tokens, page_size, c.num_key_value_heads, c.head_dim, ctx + d, dtype, device)
            if self.use_mtp else None
        )
        # prefix-cache snapshots (stage_server.snapshots): the state of up to this many
        # prefixes; their KV pages are the KV pool's, shared
        self.snapshots = None
        if prefix_cache_gb:
            budget = int(prefix_cache_gb * 2**30)
            n = slots_for_budget(budget, snapshot_nbytes(self.state))
            self.snapshots = SnapshotPool(n, self.state, [p for p in (self.kv, self.mtp_kv) if p], fault)
            if pool_bytes is not None and pool_bytes + self.snapshots.nbytes > memory_budget:
                raise ValueError(f"stage {pp_rank} needs {gib(pool_bytes + self.snapshots.nbytes)} with "
                                 f"{n} prefix-cache snapshots; its memory budget is {gib(memory_budget)}")
        if self.flashinfer_prefill:
            # after the budget check: a stage that cannot start does not wait for a build
            self.flashinfer_prefill = fi_attention.build_at_start(
                device, dtype, c.head_dim, c.num_attention_heads, c.num_key_value_heads, page_size)
        self.checker = StepChecker(c, max_rows, self.max_context, num_speculative_steps, self.is_first, self.snapshots)
        # structured output: the grammar matcher of each constrained row (stage_server/grammar.py)
        self.grammars = GrammarRows(model_dir, c.vocab_size, list(c.eos_token_ids)) if self.is_last else None
        self.strict_lengths = strict_lengths
        # the row lifecycle: rows in use, their lengths, open verifies, broken rows (stage_server/rows.py)
        self.rows = RowTable(max_rows, num_speculative_steps, strict_lengths, self.kv, self.mtp_kv, self.snapshots,
                             self.grammars)
        self.faults = CommitFaults(fault, self.is_last, self.state)  # tests only (stage_server/faults.py)
        self.busy_seconds = 0.0
        self.graph_bytes = 0  # device memory the captured graphs took (bytes)
        self.warmup_seconds = 0.0  # stage_server.warmup.warm_up, run by the stage server
        # layer forwards by how they ran, "graph" (a replay) or "eager": an eager forward costs
        # the host tens of ms on a GPU where a replay costs a fraction of one (Info, metrics)
        self.forwards = collections.Counter()
        log.info("stage %d/%d layers [%d, %d): %s", pp_rank, pp_size, start, end, self.memory_report())
        self.graphs: dict[str, StepGraphs] = {}
        self.mtp_graphs: dict[str, StepGraphs] = {}
        # the MTP head's drafting (stage_server/mtp.py); it reaches the layout through a weak
        # proxy (no runner <-> drafter cycle: see _capture_graphs)
        me = weakref.proxy(self)
        self.drafter = MTPDrafter(self.model, self.mtp_kv, num_speculative_steps, self.device,
                                  lambda *a: me._meta(*a), self.mtp_graphs, self.grammars) if self.use_mtp else None
        self.round_graphs: dict[str, StepGraphs] = {}  # last stage, MTP, every request greedy
        self.commit_graphs: CommitGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # short prefill chunks
        # mode -> a mixed micro-batch's graphs (decodes / verifies beside one long chunk)
        self.mixed_graphs: dict[str, MixedGraphs] = {}
        self.mixed_graph_tokens = default_mixed_graph_tokens() if mixed_graph_tokens is None else mixed_graph_tokens
        on_cuda = self.device.type == "cuda"
        if cuda_graph_max_bs is None:
            cuda_graph_max_bs = min(max_rows, 256) if on_cuda else 0
        if cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {cuda_graph_max_bs}")
        if cuda_graph_max_bs and not self.model.capturable:
            # e.g. the Mamba2 / KDA families with PPSPEC_FAMILY_GRAPHS=0
            log.info("stage %d: CUDA graphs off (this stage's %s layers run eagerly)", pp_rank, c.model_type)
        elif cuda_graph_max_bs:
            before = _reserved(self.device)
            self._capture_graphs(min(cuda_graph_max_bs, max_rows), capture=on_cuda)
            # the graphs' private memory pool and their warm-up's activations, which the
            # caching allocator keeps: known only once captured, so checked after
            self.graph_bytes = max(0, _reserved(self.device) - before)
            if pool_bytes is not None and pool_bytes + self.graph_bytes > memory_budget:
                self.graphs = self.mtp_graphs = self.round_graphs = {}
                self.commit_graphs = self.prefill_graphs = None
                self.mixed_graphs = {}
                raise ValueError(
                    f"stage {pp_rank} needs {gib(pool_bytes + self.graph_bytes)}: weights and pools "
                    f"{pool_bytes / 2**30:.2f}, CUDA graphs for batches up to {min(cuda_graph_max_bs, max_rows)} "
                    f"{self.graph_bytes / 2**30:.2f}; its memory budget is {gib(memory_budget)}: lower "
                    f"--cuda-graph-max-bs (or --max-rows / --kv-tokens) or raise the budget"
                )

    def _capture_graphs(self, max_bs: int, capture: bool) -> None:
        """Graphs of the layers' decode and verify forward and, on an MTP stage, of the
        head's drafting after them (``self.mtp_graphs``)."""
        # the graphs' forwards reach the runner through a weak proxy: a closure over self
        # would make runner -> graphs -> closure -> runner a cycle, which keeps the stage's
        # pools and graphs on the device after the last reference is dropped, until a
        # collection (one inside a capture breaks the capture, see graphs.record)
        me = weakref.proxy(self)

        def layers(metas, ids, hidden, aux) -> torch.Tensor:
            h = me.model.embed_tokens(ids) if me.is_first else hidden
            return me.model(metas[0], h, me._layer_states())

        pool = None
        if self.use_mtp and self.num_steps:
            iota = torch.arange(max(max_bs, self.num_steps) + 1, device=self.device)
            self.drafter.index = ChainIndex(iota, torch.ones_like(iota),
                                           {d: iota * d - 1 for d in (1, self.num_steps + 1)})
        for mode, d in ((DECODE, 1), (VERIFY, self.num_steps + 1)):
            if mode == VERIFY and self.num_steps == 0:
                continue
            common = dict(mode=mode, tokens_per_request=d, max_bs=max_bs, pad_row=self.max_rows,
                          hidden_size=self.cfg.hidden_size, dtype=self.dtype, device=self.device, capture=capture)
            g = StepGraphs(layers, kvs=(self.kv,), takes_hidden=not self.is_first,
                           max_kv_len=self.max_context + self.num_steps + 1, pool=pool, **common)
            self.graphs[mode], pool = g, g.pool
            if self.use_mtp and self.num_steps:
                mtp_len = self.mtp_kv.max_pages_per_row * self.mtp_kv.page_size
                g = StepGraphs(lambda metas, *a: me.drafter.chain(metas[0], *a), kvs=(self.mtp_kv,), takes_hidden=True,
                               max_kv_len=mtp_len, pool=pool, **common)
                self.mtp_graphs[mode], pool = g, g.pool
                g = StepGraphs(lambda *a: me._greedy_round(*a), kvs=(self.kv, self.mtp_kv), takes_hidden=not self.is_first,
                               max_kv_len=mtp_len, pool=pool, **common)
                self.round_graphs[mode], pool = g, g.pool
        if getattr(self.model, "prefill_capturable", True):  # not where a prefill reads the device on the host
            self.prefill_graphs = PrefillGraphs(
                lambda meta, ids, hidden: layers((meta,), ids, hidden, None), pad_row=self.max_rows, kv=self.kv,
                takes_hidden=not self.is_first, hidden_size=self.cfg.hidden_size, dtype=self.dtype,
                device=self.device, max_kv_len=self.prefill_kv_len, capture=capture, pool=pool)
            pool = self.prefill_graphs.pool
            # a mixed micro-batch (decodes / verifies and one request's chunk) in one replay
            for mode, g in self.graphs.items():
                mg = MixedGraphs(lambda meta, ids, hidden: layers((meta,), ids, hidden, None), g, self.prefill_graphs,
                                 chunk_tokens=self.mixed_graph_tokens, capture=capture, pool=pool)
                pool = mg.pool
                if mg.keys:
                    self.mixed_graphs[mode] = mg
        if self.state is not None and self.state.verifies:
            self.commit_graphs = CommitGraphs(self.state.launch_commit, max_bs=max_bs, pad_row=self.max_rows,
                                              device=self.device, capture=capture, pool=pool)
            self.state.use_graphs(self.commit_graphs)

    def _check_budget(self, budget, layout, n_lin, n_att, kv_tokens, page_size, d) -> int:
        """Raise ValueError when weights and pools exceed ``budget`` (bytes), before any pool
        is allocated; else return their bytes (``stage_server.budget``)."""
        c = self.cfg
        parts = pool_bytes(self.model, self.dtype, n_att + (1 if self.use_mtp else 0), kv_tokens, page_size,
                           c.num_key_value_heads, c.head_dim, layout, n_lin, self.max_rows, d, self.commit_design)
        return check_fits(f"stage {self.pp_rank}", parts, self._attention_workspace(), budget)

    def _attention_workspace(self) -> int:
        """Device bytes of FlashInfer's workspace when this stage's prefill uses it (one per
        device, shared by the stages on it, allocated by the warm-up after the pools:
        counted here so that the budget holds it before it exists)."""
        return fi_attention.WORKSPACE_NBYTES if self.flashinfer_prefill else 0

    @property
    def prefill_attention(self) -> str:
        """The kernel of eager prefill chunks' attention: ``"flashinfer"``, else ``"triton"`` on
        CUDA and ``"torch"`` (the plain-torch reference, kernels/attention/naive.py) on the CPU."""
        if self.flashinfer_prefill:
            return "flashinfer"
        return "triton" if self.device.type == "cuda" else "torch"

    # ------------------------------------------------------------------ info
    def memory_report(self) -> dict[str, int]:
        """Pool sizes in bytes (reported at start and by ``Info``)."""
        rep = {"weights": sum(p.numel() * p.element_size() for p in self.model.parameters())}
        rep["kv_cache"] = self.kv.nbytes if self.kv else 0
        rep["mtp_kv_cache"] = self.mtp_kv.nbytes if self.mtp_kv else 0
        rep["attention_workspace"] = self._attention_workspace()
        if self.state:
            rep.update(self.state.nbytes)
        rep["cuda_graphs"] = self.graph_bytes
        rep["prefix_snapshots"] = self.snapshots.nbytes if self.snapshots else 0
        return rep

    def info(self) -> dict:
        return {
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "layer_start": self.model.start,
            "layer_end": self.model.end,
            "num_layers": self.cfg.num_hidden_layers,
            "max_rows": self.max_rows,
            "rows_in_use": len(self.rows_in_use),
            "kv_tokens": (self.kv.num_pages * self.kv.page_size) if self.kv else 1 << 30,
            "kv_pages_used": self.kv.used_pages if self.kv else 0,
            "kv_pages_total": self.kv.num_pages if self.kv else 0,
            "max_context": self.max_context,
            "num_speculative_steps": self.num_steps,
            "has_mtp": self.use_mtp,
            "commit_design": self.commit_design,
            "prefill_attention": self.prefill_attention,
            "device_type": self.device.type,
            "device_uuid": _device_uuid(self.device),
            "vocab_size": self.cfg.vocab_size,
            "eos_token_ids": list(self.cfg.eos_token_ids),
            "memory_bytes": self.memory_report(),
            "busy_seconds": self.busy_seconds,
            "forwards": dict(self.forwards),
            "warmup_seconds": self.warmup_seconds,
            "snapshot_slots": self.snapshots.num_slots if self.snapshots else 0,
            "snapshots_in_use": self.snapshots.used if self.snapshots else 0,
        }

    # ------------------------------------------------------------------ layout
    def _meta(self, mode, rows, seq_lens, extend_lens, kv: KVPool | None) -> BatchMeta:
        # Every index tensor is built from host lists, so what the kernels' checks need to
        # know about it is stated here (kernels.checks.known) instead of read back from the
        # device in every layer: a read-back waits for the device and serialises the step.
        dev = self.device
        kv_lens = [s + e for s, e in zip(seq_lens, extend_lens)]
        B = len(rows)
        # one copy that does not wait for the device (a blocking one synchronises the stream)
        ints = device_int64(list(rows) + list(seq_lens) + list(extend_lens), dev)
        rows_t, seq_t, ext_t = ints[:B], ints[B:2 * B], ints[2 * B:]
        cu = torch.zeros(B + 1, dtype=torch.long, device=dev)
        cu[1:] = ext_t.cumsum(0)
        total = sum(extend_lens)
        tok_rows = torch.repeat_interleave(rows_t, ext_t, output_size=total)
        positions = torch.repeat_interleave(seq_t - cu[:-1], ext_t, output_size=total) + torch.arange(total, device=dev)
        slots = page_table = None
        if kv is not None:
            kv.ensure(rows, kv_lens)
            slots, page_table = kv.slots(tok_rows, positions), kv.page_table
            known(slots, min=0, max=kv.num_pages * kv.page_size - 1)  # pages come from the pool
            known(page_table, pages_in_pool=True)
        if B:
            known(rows_t, min=min(rows), max=max(rows))
            known(cu, total=total, max_len=max(extend_lens), queries_fit=all(e >= 0 for e in extend_lens),
                  values=[0, *itertools.accumulate(extend_lens)])
        kv_t = known(seq_t + ext_t, min=min(kv_lens, default=0), max=max(kv_lens, default=0))
        meta = BatchMeta(mode, rows_t, seq_t, ext_t, cu, positions, slots, page_table, kv_t,
                         extend_lens[0] if B else 0)
        if mode == PREFILL:
            meta.has_init = seq_t > 0
            if kv is not None and self.flashinfer_prefill:
                # one plan for every attention layer of this step over this pool
                meta.attn_plan = fi_attention.prefill_plan(rows, kv_lens, extend_lens, kv.page_size)
        return meta

    def _layer_states(self) -> dict:
        """Global layer index -> its pool views: a ``LayerState`` (recurrent layer), the
        ``(k_cache, v_cache)`` pair (attention layer), or both as a pair (a layer with both,
        docs/DESIGN.md, "Layer families")."""
        states = {layer: self.state.layer(i) for layer, i in self._state_slot.items()}
        for layer, i in self._kv_slot.items():
            kv = self.kv.layer(i)
            states[layer] = (states[layer], kv) if layer in states else kv
        return states

    # ------------------------------------------------------------------ rows
    @property
    def rows_in_use(self) -> set[int]:
        return self.rows.rows_in_use

    @property
    def row_lens(self) -> dict[int, int]:
        return self.rows.row_lens

    @property
    def broken_rows(self) -> set[int]:
        return self.rows.broken_rows

    @property
    def _verify_open(self) -> dict[int, tuple[int, int]]:  # the row table's, by the name tests use
        return self.rows._verify_open

    def mark_broken(self, req_pool_indices: list[int]) -> None:
        """The rows' state is undefined (a later stage refused a step this stage applied):
        refuse steps on them until they are released."""
        self.rows.mark_broken(req_pool_indices)

    # ------------------------------------------------------------------ validation
    def check_input(self, inp: StepInput, hidden: bool = True) -> None:
        """Validate one micro-batch against this stage's limits; touches nothing
        (:meth:`StepChecker.check <stage_server.validation.StepChecker.check>`, which says
        what it raises). ``hidden=False`` skips the ``hidden_states`` checks (the gRPC
        server's early check, on its event loop)."""
        self.checker.check(inp, hidden)

    def _sampling_ok(self, spec: SamplingSpec) -> bool:  # the checker's, by the name tests use
        return self.checker._sampling_ok(spec)

    def _check_sampling(self, b: int, spec: SamplingSpec) -> None:  # likewise
        self.checker._check_sampling(b, spec)

    # ------------------------------------------------------------------ the path of a micro-batch
    @on_stage_device
    @torch.inference_mode()
    def step(self, inp: StepInput) -> StepOutput:
        """Run one micro-batch through this stage (see :class:`StepInput`).

        Raises:
            ValueError / IndexError: malformed input (nothing is changed).
            RowStateError (a ValueError): the step does not fit its rows' state (nothing
            is changed).
            PoolExhaustedError: no KV page left (nothing is changed).
        """
        t0 = time.perf_counter()
        self.check_input(inp)
        out = StepOutput(inp.micro_batch_id, inp.round)
        grammars = self._prepare_grammars(inp)
        parts = inp.parts()  # once: each call copies the step's lists
        with self.rows.applying(inp, parts):
            if grammars:
                self.grammars.install(grammars)
            self._forward(inp, parts, out)
        if inp.snapshot_slots:  # a prefill writes the state in place: it is committed, nothing pending
            self.snapshots.take(inp.req_pool_indices, inp.snapshot_slots,
                                [s + e for s, e in zip(inp.seq_lens, inp.extend_lens)], pending=False)
        out.compute_seconds = time.perf_counter() - t0
        self.busy_seconds += out.compute_seconds
        return out

    def _forward(self, inp: StepInput, parts: list[StepInput], out: StepOutput) -> None:
        """The step's compute, its rows checked and their pages taken: the layers, then on
        the last stage the sampling (``out.output_ids``, ``out.drafts``), else the hidden
        states for the next stage (``out.hidden_states``)."""
        graphs = self._greedy_round_graphs(inp)
        if graphs is not None:
            self._run_greedy_round(graphs, inp, out)
            return
        meta, hidden = self._run_layers(inp, parts)
        if not self.is_last:
            out.hidden_states = hidden
        else:
            self._last_stage(inp, meta, hidden, out, parts)

    def prepare_grammar(self, text: str) -> concurrent.futures.Future:
        """Compile a request's grammar (xgrammar EBNF) ahead of its steps, off the step's
        thread (last stage; ``GrammarRows.prefetch``): the future raises ValueError when it
        does not compile. Other stages have nothing to compile: a done future."""
        if self.grammars is None:
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
        return self.grammars.prefetch(text)

    def _prepare_grammars(self, inp: StepInput) -> dict:
        """Matchers for the grammars of requests this step starts (last stage), compiled
        before any pool is touched. Raises ValueError (nothing changed)."""
        if self.grammars is None or not any(s.grammar for s in inp.sampling):
            return {}
        new = [b for b, s in enumerate(inp.sampling) if s.grammar]
        return self.grammars.prepare([inp.req_pool_indices[b] for b in new], [inp.sampling[b].grammar for b in new],
                                     [inp.sampling[b].grammar_accepted_ids for b in new])

    @torch.inference_mode()
    def forward_hidden(self, inp: StepInput) -> tuple[BatchMeta, torch.Tensor]:
        """Validate, lay out and run this stage's layers: ``(meta, hidden [T, hidden])``.
        Raises as :meth:`step`."""
        self.check_input(inp)
        with self.rows.applying(inp):
            return self._run_layers(inp)

    def _run_layers(self, inp: StepInput, parts: list[StepInput] | None = None) -> tuple[BatchMeta | MixedMeta, torch.Tensor]:
        rows = inp.req_pool_indices
        graphs = None if inp.num_prefill else self.graphs.get(inp.mode)
        if graphs is not None and graphs.bucket(len(rows)) is not None:
            self.rows.touched = True
            meta, hidden = graphs.run(rows, inp.seq_lens, inp.input_ids, inp.hidden_states)
            self.forwards["graph"] += 1
            if inp.mode == VERIFY:
                self.faults.after_verify(meta)
            return meta, hidden
        parts = parts or inp.parts()
        if inp.num_prefill and len(parts[1].req_pool_indices) == 1:
            mg = self.mixed_graphs.get(parts[0].mode)
            if mg is not None and mg.bucket(len(parts[0].req_pool_indices), len(parts[1].input_ids)) is not None:
                return self._run_mixed_graph(mg, inp, *parts)
        runs = self._graph_runs(*parts) if inp.num_prefill else None
        if runs is not None:
            # a mixed micro-batch in graph replays, which cost less than one eager forward of
            # every layer (its host launches); a large one shares its GEMMs eagerly
            done = [self._run_layers(p) for p in runs]
            # a prefill graph's layout is a view of its buffers, which a later replay of the
            # same bucket overwrites: chunks run one by one get the layout of them all
            chunks = done[1][0] if len(runs) == 2 else self._meta(PREFILL, parts[1].req_pool_indices,
                                                                  parts[1].seq_lens, parts[1].extend_lens, self.kv)
            return (MixedMeta.of([done[0][0], chunks], [p.extend_lens for p in parts]),
                    torch.cat([h for _, h in done]))
        chunks = parts[-1]  # a prefill, or a mixed micro-batch's prefill chunks
        if chunks.mode == PREFILL:
            self.rows.rows_in_use.update(chunks.req_pool_indices)
            self.rows.touched = True
            self._replay_before_prefill(chunks.req_pool_indices, chunks.seq_lens)
            if (not inp.num_prefill and self.prefill_graphs is not None
                    and self.prefill_graphs.bucket(len(rows), len(inp.input_ids), max(inp.extend_lens)) is not None):
                self.forwards["graph"] += 1
                return self.prefill_graphs.run(rows, inp.seq_lens, inp.extend_lens, inp.input_ids, inp.hidden_states)
        metas = [self._meta(p.mode, p.req_pool_indices, p.seq_lens, p.extend_lens, self.kv) for p in parts]
        meta = metas[0] if len(metas) == 1 else MixedMeta.of(metas, [p.extend_lens for p in parts])
        if isinstance(meta, MixedMeta) and meta.slots is not None:  # the parts' slots, joined
            known(meta.slots, min=0, max=self.kv.num_pages * self.kv.page_size - 1)
        if self.is_first:
            hidden = self.model.embed_tokens(device_int64(inp.input_ids, self.device))
        else:
            hidden = inp.hidden_states.to(device=self.device, dtype=self.dtype)
        self.rows.touched = True
        hidden = self.model(meta, hidden, self._layer_states())
        self.forwards["eager"] += 1
        if inp.mode == VERIFY:
            self.faults.after_verify(metas[0])
        return meta, hidden

    def _run_mixed_graph(self, mg: MixedGraphs, inp: StepInput, head: StepInput,
                         chunk: StepInput) -> tuple[MixedMeta, torch.Tensor]:
        """A mixed micro-batch of decodes or verifies and one request's chunk in one replay
        of ``mg`` (the chunk's row first dropped or caught up, as before any prefill)."""
        row, seq = chunk.req_pool_indices[0], chunk.seq_lens[0]
        self.rows.rows_in_use.add(row)
        self.rows.touched = True
        self._replay_before_prefill([row], [seq])
        meta, hidden = mg.run(head.req_pool_indices, head.seq_lens, head.input_ids, row, seq, chunk.input_ids,
                              inp.hidden_states)
        self.forwards["graph"] += 1
        if head.mode == VERIFY:
            self.faults.after_verify(meta.parts[0])
        return meta, hidden

    def _graph_runs(self, head: StepInput, chunks: StepInput) -> list[StepInput] | None:
        """The steps a mixed micro-batch that no mixed graph holds (:class:`MixedGraphs`: one
        request's chunk of the beside-decode length) runs as graph replays: its decode / verify part in
        the decode or verify graphs, then its prefill chunks in one prefill bucket (short,
        batched or long), or one bucket per request where together they fit none (two
        prompts of 300 tokens fit no batched bucket, and a long one holds one request).
        None: it runs eagerly.

        At most :data:`MAX_CHUNK_REPLAYS` chunks one by one: each replay costs its own host
        fill and its padded tokens on the device, where an eager forward shares every GEMM
        among them."""
        g, pg = self.graphs.get(head.mode), self.prefill_graphs
        if g is None or g.bucket(len(head.req_pool_indices)) is None or pg is None:
            return None
        if pg.bucket(len(chunks.req_pool_indices), len(chunks.input_ids), max(chunks.extend_lens)) is not None:
            return [head, chunks]
        if len(chunks.req_pool_indices) > MAX_CHUNK_REPLAYS:
            return None
        each = chunks.per_request()
        if all(pg.bucket(1, len(c.input_ids)) is not None for c in each):
            return [head, *each]
        return None

    def _replay_before_prefill(self, rows: list[int], seq_lens: list[int]) -> None:
        """Replay commit design, before any prefill reads the state: new rows drop their
        pending steps (a previous request's), continuing rows apply theirs, in every layer
        at once (no launch when the chunk has no such row)."""
        st = self.state
        if st is None or st.replay is None:
            return
        new = [r for r, s in zip(rows, seq_lens) if s == 0]
        cont = [r for r, s in zip(rows, seq_lens) if s > 0]
        if new:
            st.drop_pending(known(device_int64(new, self.device), min=min(new), max=max(new)))
        if cont:
            st.flush(known(device_int64(cont, self.device), min=min(cont), max=max(cont)))

    def _last_stage(self, inp: StepInput, meta: BatchMeta | MixedMeta, hidden: torch.Tensor, out: StepOutput,
                    parts: list[StepInput] | None = None) -> None:
        """Logits, acceptance and sampling (and the MTP head's drafts) of the step's requests.
        A mixed micro-batch's parts sample as their own steps would, results in request order;
        the targets of every part cross to the host in ONE read (a read per part waited for
        the device once per part: docs/PERFORMANCE.md, "Prefill and the token budget")."""
        if isinstance(meta, MixedMeta):
            pieces = [(p, m, hidden[meta.bounds[i]:meta.bounds[i + 1]])
                      for i, (p, m) in enumerate(zip(parts or inp.parts(), meta.parts))]
        else:
            pieces = [(inp, meta, hidden)]
        todo = [self._targets(*p) for p in pieces]
        live = [t.targets for t in todo if t.targets is not None]
        # the step's one read of the device before its result: every part's targets at once
        flat = (live[0].flatten() if len(live) == 1 else torch.cat([t.flatten() for t in live])).tolist() if live else []
        outs, at = [], 0
        for (p, m, h), t in zip(pieces, todo):
            host = None
            if t.targets is not None:
                B, D = t.targets.shape
                host = [flat[at + b * D:at + (b + 1) * D] for b in range(B)]
                at += B * D
            o = out if len(pieces) == 1 else StepOutput(inp.micro_batch_id, inp.round)
            self._sampled(p, m, h, t, host, o)
            outs.append(o)
        if len(pieces) == 1:
            return
        out.output_ids = [t for o in outs for t in o.output_ids]
        if any(o.drafts for o in outs):
            out.drafts = [d for o in outs for d in (o.drafts or [[]] * len(o.output_ids))]
        for name in ("logprobs", "prompt_logprobs"):
            if any(getattr(o, name) is not None for o in outs):
                setattr(out, name, [x for o in outs for x in (getattr(o, name) or [None] * len(o.output_ids))])

    def _targets(self, inp: StepInput, meta: BatchMeta, hidden: torch.Tensor) -> "_Sampling":
        """One part's logits and target tokens on the device (``sampler.sample_targets``), nothing
        read. A prefill whose requests all continue inside their prompts samples nothing: no
        logits, no targets (its MTP head and prompt logprobs still run, in :meth:`_sampled`)."""
        B = meta.batch_size
        t = _Sampling(sample=inp.sample or [True] * B, specs=inp.sampling or [_GREEDY] * B,  # read only: shared
                      output_lens=inp.output_lens or [0] * B)
        rows = inp.req_pool_indices
        constrained = self.grammars.constrained(rows)
        if inp.mode == PREFILL:
            t.cu = [0, *itertools.accumulate(inp.extend_lens)]  # from the host (a device read would wait)
            t.drafts, t.num_drafts = [[] for _ in range(B)], [0] * B
            if not any(t.sample) and not constrained:
                return t
            # one logit row per request: its last token (only requests that sample are judged)
            last_idx = device_int64([t.cu[b + 1] - 1 for b in range(B)], self.device)
            logits = self.model.logits(hidden[last_idx], upcast=False).unsqueeze(1)  # [B, 1, V]
        else:
            d = meta.tokens_per_request
            # in the model's dtype: the sampler upcasts only the rows that sample
            logits = self.model.logits(hidden, upcast=False).view(B, d, -1)
            t.num_drafts = inp.num_drafts or [0] * B
            ids = inp.input_ids  # each request's d tokens: its last one, then its drafts (host lists)
            t.drafts = [list(ids[b * d + 1:b * d + 1 + t.num_drafts[b]]) for b in range(B)]
        if constrained:
            t.mask = self.grammars.token_mask(rows, t.drafts, t.sample, logits.shape[1])
        t.targets, t.logits = sample_targets(logits, t.drafts, t.num_drafts, t.specs, t.output_lens, t.mask)
        return t

    def _sampled(self, inp: StepInput, meta: BatchMeta, hidden: torch.Tensor, t: "_Sampling",
                 targets: list[list[int]] | None, out: StepOutput) -> None:
        """One part's results from its targets read on the host (``targets``; None where it
        sampled nothing): acceptance, grammar, logprobs, prompt logprobs, MTP drafts."""
        B, specs, sample, rows = meta.batch_size, t.specs, t.sample, inp.req_pool_indices
        results = None
        if targets is not None:
            results = accept(targets, t.drafts, t.num_drafts, specs, t.logits)
        out.output_ids = ([r.tokens if sample[b] else [] for b, r in enumerate(results)] if results
                          else [[] for _ in range(B)])
        if t.mask is not None:
            self.grammars.advance(rows, t.mask, out.output_ids)
        if any(s.logprobs is not None for s in specs):
            out.logprobs = [r.logprobs if sample[b] else None for b, r in enumerate(results)] if results else [None] * B
        if inp.mode == PREFILL and any(s.prompt_logprobs is not None for s in specs):
            out.prompt_logprobs = self._prompt_logprobs(inp, hidden, specs, t.cu)
        if self.use_mtp:
            graphs = self.mtp_graphs.get(inp.mode)
            # a constrained request's draft chain is masked step by step on the host: eagerly
            if graphs is not None and graphs.bucket(B) is not None and not self.grammars.constrained(rows):
                # decode / verify: the head runs over all D positions of each request (the
                # KV past the accepted ones is rewritten by the chain and the next round)
                d = meta.tokens_per_request
                ids = [tok for e in out.output_ids for tok in e + [0] * (d - len(e))]
                acc = [len(e) for e in out.output_ids]
                out.drafts = graphs.run(inp.req_pool_indices, inp.seq_lens, ids, hidden, acc)[1].tolist()
            else:
                out.drafts = self.drafter.draft(inp, meta, hidden, out.output_ids)

    def _prompt_logprobs(self, inp: StepInput, hidden: torch.Tensor, specs: list[SamplingSpec],
                         cu: list[int]) -> list:
        """Per request of a prefill chunk, None or ``[(token, logprob, [(id, logprob)] top-n, rank)]``
        for each prompt token its positions predict: the chunk's own tokens after its first,
        then the next chunk's first (``next_token_ids``, -1 for a prompt's last chunk, whose
        last position predicts the first output token instead). Log-probabilities of the
        model's logits (fp32, before any penalty or bias: vLLM's prompt_logprobs); ``rank``
        is 1 + the number of tokens more likely than the prompt token (vLLM's)."""
        ids = list(inp.input_ids)
        nxt = inp.next_token_ids or [-1] * len(specs)
        out: list = []
        for b, spec in enumerate(specs):
            if spec.prompt_logprobs is None:
                out.append(None)
                continue
            targets = ids[cu[b] + 1:cu[b + 1]] + ([nxt[b]] if nxt[b] >= 0 else [])
            if not targets:
                out.append([])
                continue
            lp = torch.log_softmax(self.model.logits(hidden[cu[b]:cu[b] + len(targets)], upcast=True).float(), dim=-1)
            chosen_t = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])  # [n, 1]
            ranks = ((lp > chosen_t).sum(1) + 1).tolist()
            chosen = chosen_t[:, 0].tolist()
            tops: list = [[] for _ in targets]
            if spec.prompt_logprobs > 0:
                v, i = lp.topk(spec.prompt_logprobs, dim=-1)
                tops = [list(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]
            out.append(list(zip(targets, chosen, tops, ranks)))
        return out

    # ------------------------------------------------------------------ greedy MTP rounds in one graph
    def _greedy_round_graphs(self, inp: StepInput) -> StepGraphs | None:
        """The fused round's graphs when this step may take them: last stage with MTP, a
        decode or verify small enough, and every request greedy with no logprobs, no
        min_tokens ban in force, no penalty, no logit_bias and no grammar (those need the
        host sampler: the fused round takes the raw logits' argmax)."""
        graphs = self.round_graphs.get(inp.mode)
        if graphs is None or inp.num_prefill or graphs.bucket(len(inp.req_pool_indices)) is None:
            return None
        if self.grammars.constrained(inp.req_pool_indices):  # the grammar's mask is the host sampler's
            return None
        out_lens = inp.output_lens or [0] * len(inp.req_pool_indices)
        for spec, n in zip(inp.sampling, out_lens):
            if (spec.temperature != 0.0 or spec.logprobs is not None or (spec.banned_until_min and n < spec.min_tokens)
                    or spec.penalized or spec.logit_bias_ids or spec.allowed_token_ids or spec.bad_word_lens):
                return None
        return graphs

    def _run_greedy_round(self, graphs: StepGraphs, inp: StepInput, out: StepOutput) -> None:
        self.rows.touched = True
        B = len(inp.req_pool_indices)
        self.forwards["graph"] += 1
        meta, res = graphs.run(inp.req_pool_indices, inp.seq_lens, inp.input_ids, inp.hidden_states,
                               inp.num_drafts or [0] * B)
        D = meta.tokens_per_request
        res = res.tolist()  # the round's one host read: [B, D + 1 + num_steps]
        out.output_ids = [r[: r[D]] for r in res]
        out.drafts = [r[D + 1:] for r in res]
        if inp.mode == VERIFY:
            self.faults.after_verify(meta)

    def _greedy_round(self, metas, ids: torch.Tensor, hidden: torch.Tensor | None, num_drafts: torch.Tensor) -> torch.Tensor:
        """A decode or verify round of the last stage with MTP, on the device alone
        (CUDA-graph capturable): the layers, greedy acceptance and the MTP chain.

        ``metas``: the layout in the KV pool and in the MTP KV pool. ``ids`` ``[B * D]``:
        the step's tokens (the last emitted token, then the drafts); ``num_drafts`` ``[B]``.
        Acceptance is :func:`sampler.verify_and_sample`'s greedy rule: drafts are accepted
        while each equals the target argmax at its position, then the target's token.
        Returns ``[B, D + 1 + num_steps]`` int64: the ``D`` target tokens, the accept
        length ``a`` (the first ``a`` targets are emitted), the next round's drafts.
        """
        meta, mtp_meta = metas
        h = self.model(meta, self.model.embed_tokens(ids) if self.is_first else hidden, self._layer_states())
        B, D = meta.batch_size, meta.tokens_per_request
        targets = self.model.logits(h, upcast=False).view(B, D, -1).argmax(-1)  # [B, D]
        j = self.drafter.index.iota[: D - 1]  # made before capture: no arange kernel per replay
        match = (ids.view(B, D)[:, 1:] == targets[:, :-1]) & (j < num_drafts[:, None])
        accepted = 1 + match.long().cumprod(1).sum(1)
        drafts = self.drafter.chain(mtp_meta, targets.flatten(), h, accepted)
        return torch.cat([targets, accepted[:, None], drafts], 1)

    # ------------------------------------------------------------------ commit and release
    @on_stage_device
    def commit_accept(self, micro_batch_id: int, round: int, req_pool_indices: list[int], accept_lengths: list[int]) -> None:
        """Commit the accepted verify state of one micro-batch in every recurrent layer
        (:meth:`RowStatePool.commit <stage_server.pools.RowStatePool.commit>`, the one commit
        rule on CPU and CUDA alike: copy design ``state[row] = scratch[row, accept_length - 1]``,
        replay design ``pending[row] = accept_length``, applied by the row's next verify or
        decode; docs/DESIGN.md, "Commit rule").

        This is the only commit; every stage runs it, the last included, with the rows and
        accept lengths the router relays for exactly this micro-batch and round.

        A row's length grows by its accept length (the tokens its verify started from plus
        the accepted ones).

        Raises:
            IndexError / ValueError: rows outside ``[0, max_rows)``, repeated, accept
            lengths outside ``[1, D]`` or beyond the row's verified drafts + 1 (nothing
            is written).
            RowStateError: the stage was started without speculation.
        """
        self.rows.check_commit(micro_batch_id, round, req_pool_indices, accept_lengths)
        if not req_pool_indices:
            return
        if self.state is not None:
            if self.snapshots is not None:
                self.snapshots.before_commit(req_pool_indices)  # fault injection only
            # the one commit (RowStatePool.commit), or a test's faulty one
            self.faults.commit(req_pool_indices, accept_lengths)
        self.rows.committed(req_pool_indices, accept_lengths)

    @property
    def fault(self) -> str | None:
        """The injected fault (tests only; stage_server/faults.py), None in production."""
        return self.faults.fault

    @fault.setter
    def fault(self, fault: str | None) -> None:
        self.faults.fault = fault

    @on_stage_device
    def release(self, req_pool_indices: list[int], snapshot_slots: list[int] = (),
                drop_slots: list[int] = ()) -> None:
        """Free the rows of finished or aborted requests (their KV pages too). A row not in
        use is no error (releasing is idempotent). ``snapshot_slots`` (one per row, -1 for
        none): first snapshot the row's committed state, all its tokens, into that empty
        slot (the caller releases a row only after its last verify's commit).
        ``drop_slots``: prefix-cache snapshots to free (an empty one is no error).

        Raises IndexError / ValueError (nothing freed) for a row outside ``[0, max_rows)``
        or bad slots."""
        bad = [r for r in req_pool_indices if not 0 <= r < self.max_rows]
        if bad:
            raise IndexError(f"release: req_pool_indices {brief(bad)} outside [0, {self.max_rows})")
        snap = [s for s in snapshot_slots if s >= 0]
        if (snap or drop_slots) and self.snapshots is None:
            raise ValueError("release: snapshot slots on a stage without a prefix cache")
        if snap:
            if len(snapshot_slots) != len(req_pool_indices):
                raise ValueError(f"release: {len(snapshot_slots)} snapshot_slots for {len(req_pool_indices)} rows")
            self.snapshots.check(snapshot_slots, "release: snapshot_slots", occupied=False)
            live = [(r, s) for r, s in zip(req_pool_indices, snapshot_slots)
                    if s >= 0 and r in self.rows_in_use and r not in self.broken_rows]
            if live:
                rows, slots = map(list, zip(*live))
                self.snapshots.take(rows, slots, [self.row_lens[r] for r in rows])
        if drop_slots:
            self.snapshots.drop([s for s in drop_slots if 0 <= s < self.snapshots.num_slots])
        for r in req_pool_indices:
            self.rows.forget(r)
