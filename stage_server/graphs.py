"""CUDA graphs for a stage's decode and verify forward (:class:`StepGraphs`), its commit of
accepted state (:class:`CommitGraphs`) and its short prefill chunks (:class:`PrefillGraphs`).

A decode or verify step of a 1B model launches some 500 small kernels; issued one by one
from Python the step takes tens of milliseconds while the device needs about one
(docs/PERFORMANCE.md, "Changelog"). A CUDA graph records the launches once and replays them with one
call. Graphs need fixed shapes and fixed addresses, so each padded batch size ``b`` (see
:func:`capture_sizes`) gets its own graph over static buffers: ``req_pool_indices``,
``seq_lens`` and a per-request count (int64), and the input token ids (first stage) or
hidden states (later stages). The graph derives the tokens' positions, KV lengths and KV
slots from them on the device (``kernels.paging``): the host's time before a replay is
time the device waits. A step of ``B <= b`` requests fills the first ``B`` entries; the
other ``b - B`` are padding: the pool's padding row (``max_rows``), zero cached tokens,
hence KV slots in the KV pool's padding page (the padding row's page table points there).
Every layer works per row or per token, so padding computes garbage only in rows and pages
no request owns.

The kernels' own checks run while a graph is captured, not when it replays. Replays are
safe because the stage has validated the step on the host first (``StageRunner.check_input``,
the rows' state, KV pages reserved) and fills the buffers itself.

Where CUDA is absent (``capture=False``) the same static, padded path runs eagerly: that is
how the CPU tests check the padding against the unpadded path.
"""
from __future__ import annotations

import array
import dataclasses
import gc
import itertools
import logging
import os
import time
from typing import Callable

import torch

from ppspec.kernels.checks import known
from ppspec.kernels.gdn import SHORT_PREFILL_TOKENS
from ppspec.kernels.gdn.chunk_plan import device_chunk_plan
from ppspec.kernels.paging import paged_layout

from .batch import PREFILL, BatchMeta, MixedMeta


def host_int64(values: list[int]) -> torch.Tensor:
    """A host int64 tensor of ``values`` (sharing a buffer made in C): ~3x faster than
    ``torch.tensor(values)``, which inspects every element (~110 against ~37 us for the
    ~1400 ints of a batch-64 verify's graph inputs, on the CPU machine)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)


def load_host(dst: torch.Tensor, host: torch.Tensor) -> None:
    """``dst[:n] = host`` (``n`` values on the host) without waiting for the device.

    A plain ``copy_`` from pageable memory to CUDA synchronises the stream: the host would
    wait for every kernel queued before it (the previous micro-batch's replay, on a stage
    whose step returns before its device work ends), and a sync debug mode counts it. On
    CUDA the values go through pinned memory with an asynchronous copy instead, ordered on
    the stream after every replay that read ``dst`` before (the caching host allocator
    keeps the pinned block until the copy ran); on a CPU it is a plain copy."""
    if dst.device.type == "cuda":
        host = host.pin_memory()
    dst[: host.numel()].copy_(host, non_blocking=True)


log = logging.getLogger("ppspec.stage")


def capture_sizes(max_bs: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, then every multiple of 8 up to
    ``max_bs`` (and ``max_bs`` itself), as vLLM and SGLang pad. A batch runs in the
    smallest size that holds it, wasting at most 7 rows."""
    sizes = {s for s in (1, 2, 4) if s < max_bs} | set(range(8, max_bs, 8)) | {max_bs}
    return sorted(sizes)


def smallest_fit(sizes: list[int], batch_size: int) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``batch_size``, or None."""
    return next((b for b in sizes if b >= batch_size), None)


def record(fn: Callable, pool=None):
    """Capture ``fn()`` in a CUDA graph after one warm-up call outside it (Triton compiles
    and cuBLAS picks its kernels there, on a side stream as capture requires): ``(graph,
    fn's output, the memory pool to share with the next capture)``.

    Python's cyclic garbage collector is off during the capture. A collection there may
    free an unreachable object that owns a CUDA graph (an earlier ``LLM`` or stage of the
    same process, say); freeing a graph is an unsafe call while a stream captures, so the
    capture fails ("operation failed due to a previous error during capture"). Seen on the
    H200: ``make test-gpu`` on a cold Triton cache, whose compiles made collections land
    inside captures. The garbage is collected after the capture instead.

    Raises:
        torch.AcceleratorError / RuntimeError: the capture failed (CUDA's message).
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    gc_on = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(g, pool=pool):
            out = fn()
    finally:
        if gc_on:
            gc.enable()
    return g, out, g.pool()


class StepGraphs:
    """Graphs of one step kind (decode, ``D = 1``, or verify, ``D`` tokens per request) for
    every padded batch size up to ``max_bs``.

    Args:
        forward: ``forward(metas, ids, hidden, aux) -> Tensor`` with ``b * n`` leading
            entries for a batch of ``b`` (``n`` per request, e.g. ``D`` hidden rows, or
            one row of drafts); called with the static buffers while capturing:
            ``metas`` one :class:`BatchMeta` per pool of ``kvs`` (same rows and positions,
            each pool's slots and page table),
            ``ids`` ``[b * D]`` int64 token ids, ``hidden`` ``[b * D, hidden]`` in
            ``dtype`` (None unless ``takes_hidden``), ``aux`` ``[b]`` int64 (a per-request
            count, e.g. accepted tokens; padding entries hold 1).
        mode: ``"decode"`` or ``"verify"``; tokens_per_request: ``D``.
        pad_row: the pools' padding row (``max_rows``).
        kvs: the ``KVPool`` s the layouts address (``(None,)`` without attention layers);
            their padding pages take the padding tokens' KV, their page tables' padding
            rows point there.
        max_kv_len: longest KV length (tokens) a step may reach, a bound the kernels'
            checks read while capturing.
        capture: record CUDA graphs (False: run the padded path eagerly).
        pool: CUDA graph memory pool shared with other ``StepGraphs`` (captures run from
            the largest batch down, so smaller graphs reuse the larger ones' memory).
    """

    def __init__(self, forward: Callable, *, mode: str, tokens_per_request: int, max_bs: int, pad_row: int,
                 kvs: tuple, takes_hidden: bool, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_kv_len: int, capture: bool, pool=None):
        self.forward, self.mode, self.D = forward, mode, tokens_per_request
        self.sizes = capture_sizes(max_bs)
        self.pad_row, self.kvs = pad_row, kvs
        D, n = tokens_per_request, max_bs
        self.max_kv_len, self.capture, self.pool = max_kv_len, capture, pool
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.launched_at = 0.0  # time.perf_counter() of the latest run's launch
        t0 = time.perf_counter()
        # inference tensors: no version counter, so the facts stated about them (below)
        # survive the copies that fill them
        with torch.inference_mode():
            # one int64 buffer, so a step's indices cross to the device in one copy
            self.ints = torch.zeros(4 * n + (2 + len(kvs)) * n * D, dtype=torch.long, device=device)
            self.hidden = torch.zeros(n * D, hidden_size, dtype=dtype, device=device) if takes_hidden else None
            self.ext = torch.full((n,), D, dtype=torch.long, device=device)
            self.cu = torch.arange(n + 1, dtype=torch.long, device=device) * D
            self.views = {b: self._views(b) for b in self.sizes}
            self.metas = {b: self._meta(b) for b in self.sizes}
            for b in reversed(self.sizes):
                self._fill(b, [], [], [], [])
                if capture:
                    self._capture(b)
        if capture:
            log.info("captured %d CUDA graphs for %s (batch sizes %s) in %.1f s",
                     len(self.sizes), mode, self.sizes, time.perf_counter() - t0)

    # ------------------------------------------------------------------ buffers
    def _views(self, b: int) -> dict[str, torch.Tensor]:
        """Bucket ``b``'s slices of the int64 buffer: what the host writes first (one
        copy), then the layout the graph derives from it (:meth:`_layout`)."""
        D, x, out, o = self.D, self.ints, {}, 0
        segments = [("rows", b), ("seq_lens", b), ("aux", b), ("ids", b * D), ("kv_lens", b), ("positions", b * D)]
        for name, n in segments + [(("slots", i), b * D) for i in range(len(self.kvs))]:
            out[name], o = x[o:o + n], o + n
        return out

    def _inputs(self, b: int):
        v = self.views[b]
        return v["ids"], None if self.hidden is None else self.hidden[: b * self.D], v["aux"]

    def _meta(self, b: int) -> tuple[BatchMeta, ...]:
        v, D = self.views[b], self.D
        # bounds the kernels' checks read while capturing (kernels.checks); they hold for
        # every step the stage admits, which is what a replay runs
        known(v["rows"], min=0, max=self.pad_row)
        cu = known(self.cu[: b + 1], total=b * D, max_len=D, queries_fit=True)
        known(v["kv_lens"], min=D, max=self.max_kv_len)
        # an admitted step's D tokens fit max_kv_len and every pool's page table
        cap = min([self.max_kv_len] + [kv.max_pages_per_row * kv.page_size for kv in self.kvs if kv is not None])
        known(v["seq_lens"], min=0, max=cap - D)
        metas = []
        for i, kv in enumerate(self.kvs):
            slots = v["slots", i]
            if kv is not None:
                known(slots, min=0, max=kv.k.shape[1] * kv.page_size - 1)
            metas.append(BatchMeta(self.mode, v["rows"], v["seq_lens"], self.ext[:b], cu, v["positions"], slots,
                                   None if kv is None else kv.page_table, v["kv_lens"], D))
        return tuple(metas)

    def _fill(self, b: int, rows: list[int], seq_lens: list[int], ids: list[int], aux: list[int]) -> None:
        """Write a step of ``len(rows) <= b`` requests and its padding into bucket ``b``:
        the pool's padding row, 0 cached tokens (so the padding tokens' slots fall in the
        padding page), token 0, aux 1. Host time here is device idle time."""
        pad = b - len(rows)
        host = host_int64(list(rows) + [self.pad_row] * pad + list(seq_lens) + [0] * pad
                          + list(aux) + [1] * (b - len(aux)) + list(ids) + [0] * (b * self.D - len(ids)))
        load_host(self.ints, host)

    def _layout(self, b: int) -> None:
        """Positions, KV lengths and every pool's KV slots of bucket ``b`` from its rows and
        ``seq_lens``, on the device (recorded in the graph before the forward)."""
        v, D = self.views[b], self.D
        pos = True  # the first pool's launch writes the positions and KV lengths too
        for i, kv in enumerate(self.kvs):
            if kv is not None:
                paged_layout(v["rows"], v["seq_lens"], D, kv.page_table, kv.page_size, v["slots", i],
                             v["positions"] if pos else None, v["kv_lens"] if pos else None)
                pos = False
        if pos:  # no KV pool: the layers still read the positions
            v["positions"].copy_((v["seq_lens"][:, None] + torch.arange(D, device=self.ints.device)).view(-1))
            v["kv_lens"].copy_(v["seq_lens"] + D)

    def _step(self, b: int):
        self._layout(b)
        return self.forward(self.metas[b], *self._inputs(b))

    def _capture(self, b: int) -> None:
        for kv in self.kvs:
            if kv is not None:
                known(kv.page_table, pages_in_pool=True)  # the pool hands out its own pages only
        self.graphs[b], self.outputs[b], self.pool = record(lambda: self._step(b), self.pool)

    # ------------------------------------------------------------------ run
    def bucket(self, batch_size: int) -> int | None:
        """The padded size a batch runs in, or None when it is larger than every graph."""
        return smallest_fit(self.sizes, batch_size)

    def run(self, rows: list[int], seq_lens: list[int], ids: list[int], hidden: torch.Tensor | None = None,
            aux: list[int] = ()) -> tuple[BatchMeta, torch.Tensor]:
        """Run one step of ``B = len(rows)`` requests (at most ``max_bs``).

        ids: ``B * D`` token ids; hidden: ``[B * D, hidden]`` (when the forward takes
        hidden states); aux: ``B`` counts. Returns the step's layout in the first pool (views
        of the static buffers, valid until the next run) and the forward's output for the ``B`` requests
        (a fresh tensor)."""
        B = len(rows)
        b = self._load(rows, seq_lens, ids, hidden, aux)
        self.launched_at = time.perf_counter()  # the host's time before the device work (bench.profile_host)
        if self.capture:
            self.graphs[b].replay()
            out = self.outputs[b]
        else:
            out = self._step(b)
        return self._result(b, B), out[: B * (out.shape[0] // b)].clone()

    def _load(self, rows, seq_lens, ids, hidden, aux) -> int:
        """Fill the bucket of ``len(rows)`` requests (ids, aux, and the hidden rows): its size."""
        b = self.bucket(len(rows))
        self._fill(b, rows, seq_lens, ids, aux)
        if self.hidden is not None:
            self.hidden[: len(rows) * self.D].copy_(hidden, non_blocking=True)
        return b

    def _result(self, b: int, B: int) -> BatchMeta:
        """The layout of the first ``B`` requests of bucket ``b`` in the first pool (views of
        the static buffers, valid until the next run)."""
        v, D = self.views[b], self.D
        return BatchMeta(self.mode, v["rows"][:B], v["seq_lens"][:B], self.ext[:B], self.cu[: B + 1],
                         v["positions"][: B * D], v["slots", 0][: B * D], self.metas[b][0].page_table,
                         v["kv_lens"][:B], D)


class CommitGraphs:
    """A stage's commit of accepted verify state (``RowStatePool.launch_commit``) replayed
    from one CUDA graph per padded batch size (:func:`capture_sizes`).

    The commit's device work is a few microseconds, but launching its Triton kernel from
    Python costs tens of microseconds of host time, once per verify round: at batch 1 on
    the demo checkpoint the commit was ~12% of an MTP round (docs/PERFORMANCE.md, "Changelog"). A commit
    of ``B`` rows writes ``[rows, accept lengths]`` of bucket ``b >= B`` into a static int64
    buffer in one host-to-device copy and replays graph ``b``. Padding entries hold the
    padding row and accept length 0, which the commit writes nothing for.

    Args:
        commit: ``commit(rows [b] int64, accept_lengths [b] int64)``, device work only
            (``RowStatePool.launch_commit``).
        max_bs: the largest batch with a graph; pad_row: the pools' padding row.
        capture: record CUDA graphs (False: run the padded path eagerly, as the CPU tests do).
        pool: CUDA graph memory pool shared with the step graphs.
    """

    def __init__(self, commit: Callable, *, max_bs: int, pad_row: int, device: torch.device, capture: bool, pool=None):
        self.commit, self.pad_row, self.capture, self.pool = commit, pad_row, capture, pool
        self.sizes = capture_sizes(max_bs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # bucket b reads ints[:b] (rows) and ints[b:2b] (accept lengths): one contiguous fill
        self.ints = torch.zeros(2 * max_bs, dtype=torch.long, device=device)
        if not capture:
            return
        for b in reversed(self.sizes):
            self._fill(b, [], [])  # all padding: the warm-up and the capture write nothing
            self.graphs[b], _, self.pool = record(lambda: self.commit(*self._views(b)), self.pool)

    def bucket(self, batch_size: int) -> int | None:
        """The padded size a commit of ``batch_size`` rows runs in, or None when too large."""
        return smallest_fit(self.sizes, batch_size)

    def _views(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ints[:b], self.ints[b:2 * b]

    def _fill(self, b: int, rows: list[int], accept_lengths: list[int]) -> None:
        pad = b - len(rows)
        load_host(self.ints, host_int64(list(rows) + [self.pad_row] * pad + list(accept_lengths) + [0] * pad))

    def run(self, rows: list[int], accept_lengths: list[int]) -> None:
        """Commit ``rows`` with ``accept_lengths`` (host lists the stage has validated:
        rows distinct and in use, lengths in ``[1, D]``); at most the largest bucket."""
        b = self.bucket(len(rows))
        self._fill(b, rows, accept_lengths)
        if self.capture:
            self.graphs[b].replay()
        else:
            self.commit(*self._views(b))


# token buckets: each within the one-launch GDN prefill's reach
PREFILL_GRAPH_TOKENS = tuple(t for t in (16, 32, 64) if t <= SHORT_PREFILL_TOKENS)
PREFILL_GRAPH_SEQS = (2, 4, 8)  # sequence buckets: requests + at least one padding sequence
# batched buckets: several prompts' chunks together (a burst of new requests beside the
# decodes, or a prefill round of them), each sequence (padding included) at most
# BATCHED_PREFILL_SEQ_TOKENS long, so the GDN layers take the recurrent prefill kernel,
# whose cost is the longest sequence's, and no host chunk plan (docs/PERFORMANCE.md,
# "Prompts in bursts"). Without them such a micro-batch ran eagerly: ~50 ms of host
# time on the H200 for a few ms of kernels.
BATCHED_PREFILL_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192)  # each bucket holds n more (padding)
BATCHED_PREFILL_SEQS = (8, 16, 32, 64, 128)
BATCHED_PREFILL_SEQ_TOKENS = 256
# long buckets: one request's chunk of up to 2^k tokens and one padding sequence of at
# least one token, whose GDN layers take fla's chunked kernels. fla sizes its grids by the
# number of 64-token chunks, ceil(T / 64) + ceil((t - T) / 64): t / 64, or one more where T
# is not a multiple of 64, so each t gets two graphs (its key's third entry). The largest
# bucket holds 2^k + 64 tokens: a chunk of a power-of-two token budget (512, 2048, 8192)
# wastes 64 tokens on padding, not its own length.
_FLA_CHUNK = 64
PREFILL_GRAPH_LONG_TOKENS = tuple(2 ** k + _FLA_CHUNK for k in range(7, 14))


def long_prefill_graph_tokens() -> int:
    """The longest chunk (tokens) that gets a long-bucket prefill graph:
    ``PPSPEC_PREFILL_GRAPH_TOKENS`` (default 8192; 0 turns them off). They need fla's direct
    path (``kernels.gdn.fla_prefill.direct``, the default)."""
    value = os.environ.get("PPSPEC_PREFILL_GRAPH_TOKENS", "8192")
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"PPSPEC_PREFILL_GRAPH_TOKENS must be an integer, got {value!r}") from None


def family_graphs() -> bool:
    """Whether the Mamba2 hybrids and Kimi Linear record their decode and verify steps in
    CUDA graphs: ``PPSPEC_FAMILY_GRAPHS`` 1 (the default; the GPU suite checks them in
    fp32, tests/gpu/test_family_graphs_gpu.py) or 0 (eager). Their decode / verify forward reads nothing on the host (the stage states every
    fact its checks need); their prefill does (the Mamba2 scan's torch path, fla's
    ``chunk_kda``), so their prefill chunks stay eager either way."""
    value = os.environ.get("PPSPEC_FAMILY_GRAPHS", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PPSPEC_FAMILY_GRAPHS must be 0 or 1, got {value!r}")
    return value == "1"


def _fla_chunks(n: int) -> int:
    return -(-n // _FLA_CHUNK)


def _batched_buckets(max_kv_len: int) -> list[tuple[int, int]]:
    """The batched prefill buckets ``(n, t + n)`` for ``t`` of :data:`BATCHED_PREFILL_TOKENS`:
    ``B`` requests of ``T <= t + B`` tokens fit with one token for each padding sequence (a
    full power-of-two token budget too); at least 4 tokens a sequence, and enough sequences
    that the tokens fit at :data:`BATCHED_PREFILL_SEQ_TOKENS` each; none where a row's KV
    holds less than one such sequence (a padding sequence's KV goes through the padding
    row's page table)."""
    if BATCHED_PREFILL_SEQ_TOKENS > max_kv_len:
        return []
    return [(n, t + n) for t in BATCHED_PREFILL_TOKENS for n in BATCHED_PREFILL_SEQS
            if 4 * n <= t and t + n <= n * BATCHED_PREFILL_SEQ_TOKENS]


def _laid_on_device(bucket: tuple) -> bool:
    """A long or batched bucket: its positions and KV slots are derived on the device."""
    return bucket[1] > SHORT_PREFILL_TOKENS


def _batched(bucket: tuple) -> bool:
    return len(bucket) == 2 and _laid_on_device(bucket)


def _longest_in(bucket: tuple) -> int:
    """The longest sequence (tokens) bucket ``bucket`` ever holds, padding included."""
    return BATCHED_PREFILL_SEQ_TOKENS if _batched(bucket) else bucket[1]


def _chunks(bucket: tuple) -> int:
    """A long bucket's fla chunk count, 0 for a short bucket."""
    return bucket[2] if len(bucket) == 3 else 0


class PrefillGraphs:
    """Graphs of the layers' prefill forward for short chunks, one per bucket ``(n, t)``
    of :data:`PREFILL_GRAPH_SEQS` x :data:`PREFILL_GRAPH_TOKENS`.

    Eager, a prefill launches a few hundred kernels, each with its Python: on the H200 a
    24-token prompt of the demo checkpoint took ~11 ms of host time for ~0.7 ms of device
    work, a fifth of a 256-token generation with MTP (docs/PERFORMANCE.md, "Changelog"). A chunk of ``B``
    requests and ``T`` tokens replays the smallest bucket with ``n >= B + 1`` sequences
    and ``t >= T + n - B`` tokens: its ``B`` sequences first, then ``n - B`` padding
    sequences on the padding row, each of at least one token (no kernel meets an empty
    sequence): the first takes what is left of ``t``, the others one token each. Padding
    sequences start from zero state (``seq_lens`` 0) and write their KV to the padding
    page, so they touch only what no request owns. Every sequence of a bucket is at most
    ``t <= 64`` tokens long, so the GDN layers take the one-launch recurrent prefill.

    Batched buckets ``(n, t)`` of :data:`BATCHED_PREFILL_SEQS` x :data:`BATCHED_PREFILL_TOKENS`
    hold several requests' chunks, every sequence at most :data:`BATCHED_PREFILL_SEQ_TOKENS`
    long: the padding tokens are spread over the padding sequences (the recurrent kernel
    costs its longest sequence), the bucket states that its GDN layers take the recurrent
    kernel (the fact ``gdn_recurrent``), and its positions and KV slots are derived on the
    device (:meth:`_device_layout`).

    Long buckets (:data:`PREFILL_GRAPH_LONG_TOKENS`, CUDA only, up to
    :func:`long_prefill_graph_tokens`) take one request's chunk beside one padding sequence,
    keyed ``(2, t, chunks)``; their GDN layers run fla's chunked kernels, whose chunk plan
    the graph derives from the bucket's ``cu_seqlens`` on the device
    (``chunk_plan.device_chunk_plan``) and states as the fact ``fla_chunks``. Without
    them a long chunk's eager forward spent ~50 ms of host time for 5 ms of kernels at 512
    tokens on the H200 (docs/PERFORMANCE.md, "Prefill and the token budget").

    Not recorded: dropping a new row's pending replay steps and applying a continuing
    row's (replay commit design); the stage does both before any prefill.

    Args:
        forward: ``forward(meta, ids [t] int64, hidden [t, hidden] or None) -> [t, hidden]``.
        pad_row: the pools' padding row. kv: the ``KVPool`` (None without attention layers).
        takes_hidden: the stage receives hidden states (not the first stage).
        max_kv_len: longest KV length (tokens) a prefill may reach (a row's KV capacity); buckets
            longer than ``max_kv_len + 1`` tokens are left out, their padding would not fit a row.
        capture: record CUDA graphs (False: run the padded path eagerly, as the CPU tests do).
        pool: CUDA graph memory pool shared with the other graphs.
    """

    def __init__(self, forward: Callable, *, pad_row: int, kv, takes_hidden: bool, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, max_kv_len: int, capture: bool, pool=None):
        self.forward, self.pad_row, self.kv, self.capture, self.pool = forward, pad_row, kv, capture, pool
        # a padding sequence is at most t - 1 tokens long and its KV goes through the padding
        # row's page table, which covers max_kv_len positions: a bucket longer than that
        # (a short max_context) would read past it
        self.buckets = sorted(((n, t) for n in PREFILL_GRAPH_SEQS for t in PREFILL_GRAPH_TOKENS if t - 1 <= max_kv_len),
                              key=lambda b: (b[1], b[0]))
        self.buckets += _batched_buckets(max_kv_len)
        self.long_tokens = self._long_tokens(capture, max_kv_len)
        self.buckets += [(2, t, _fla_chunks(t) + extra) for t in self.long_tokens for extra in (0, 1)]
        # bucket()'s candidates, smallest first
        self.short_buckets = [b for b in self.buckets if len(b) == 2 and not _batched(b)]
        self.batched_buckets = [b for b in self.buckets if _batched(b)]
        n_max = max(b[0] for b in self.buckets) if self.buckets else max(PREFILL_GRAPH_SEQS)
        t_max = max([b[1] for b in self.buckets], default=max(PREFILL_GRAPH_TOKENS))
        # keys: (n, t) short and batched buckets, (2, t, chunks) long ones
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.plans: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.prepared: dict[tuple, BatchMeta] = {}  # each bucket's layout as its forward last made it
        with torch.inference_mode():  # no version counter: the facts below survive the fills
            self.ints = torch.zeros(5 * n_max + 1 + 3 * t_max, dtype=torch.long, device=device)
            self.iota = torch.arange(t_max, dtype=torch.long, device=device)
            self.hidden = torch.zeros(t_max, hidden_size, dtype=dtype, device=device) if takes_hidden else None
            for b in self.buckets:
                if len(b) == 3:  # fla's chunk plan of a long bucket: (chunk_indices, chunk_offsets, slots)
                    n, _, nt = b
                    self.plans[b] = (torch.zeros(nt, 2, dtype=torch.long, device=device),
                                     torch.zeros(n + 1, dtype=torch.long, device=device),
                                     torch.arange(nt, dtype=torch.long, device=device))
            self.views = {b: self._views(*b[:2]) for b in self.buckets}
            self.metas = {b: self._meta(b, max_kv_len) for b in self.buckets}
            if kv is not None:
                known(kv.page_table, pages_in_pool=True)
            for b in sorted(self.buckets, key=lambda b: (b[1], b[0], _chunks(b)), reverse=True):
                self._fill(b, [], [], [], [])
                if capture:
                    self.graphs[b], self.outputs[b], self.pool = record(lambda: self._forward(b), self.pool)

    @staticmethod
    def _long_tokens(capture: bool, max_kv_len: int) -> list[int]:
        """The long buckets' sizes: on CUDA (graphs captured) where fla imports."""
        limit = long_prefill_graph_tokens()
        if not capture or not limit:
            return []
        try:
            from ppspec.kernels.gdn import fla_prefill
        except ImportError:
            return []
        if not fla_prefill.direct():
            return []
        return [t for t in PREFILL_GRAPH_LONG_TOKENS if t - _FLA_CHUNK <= limit and t - 1 <= max_kv_len]

    def _views(self, n: int, t: int) -> dict[str, torch.Tensor]:
        out, o = {}, 0
        # ids before positions and slots: a long bucket's host fill ends with its ids, its
        # positions and slots being derived on the device (_device_layout)
        for name, size in (("rows", n), ("seq_lens", n), ("ext", n), ("kv_lens", n), ("cu", n + 1),
                           ("ids", t), ("positions", t), ("slots", t)):
            out[name], o = self.ints[o:o + size], o + size
        return out

    def _meta(self, b: tuple, max_kv_len: int) -> BatchMeta:
        (n, t), nt, v = b[:2], _chunks(b), self.views[b]
        # bounds that hold for every chunk the bucket takes (the kernels' checks read them
        # while capturing, and every sequence is at most t tokens long, or a batched
        # bucket's sequence length)
        known(v["rows"], min=0, max=self.pad_row)
        plan = {}
        if nt:
            plan = {"fla_chunks": self.plans[b][:2]}
        elif _batched(b):
            plan = {"gdn_recurrent": True}
        known(v["cu"], total=t, max_len=_longest_in(b), queries_fit=True, **plan)
        known(v["kv_lens"], min=1, max=max_kv_len)
        if self.kv is not None:
            known(v["slots"], min=0, max=self.kv.k.shape[1] * self.kv.page_size - 1)
        return BatchMeta(PREFILL, v["rows"], v["seq_lens"], v["ext"], v["cu"], v["positions"], v["slots"],
                         None if self.kv is None else self.kv.page_table, v["kv_lens"], 0)

    def _prepare(self, b: tuple) -> BatchMeta:
        """Bucket ``b``'s layout, completed on the device from what the host filled (recorded
        in a graph before the forward, by this bucket's graph and by :class:`MixedGraphs`):
        ``has_init``, and for a long bucket its positions and KV slots
        (:meth:`_device_layout`) and fla's chunk plan from its ``cu_seqlens``. A copy of
        ``metas[b]``: each graph that records it keeps its own ``has_init``."""
        meta = dataclasses.replace(self.metas[b])
        meta.has_init = meta.seq_lens > 0  # inside the graph: recomputed by every replay
        if _laid_on_device(b):
            self._device_layout(b)
        if _chunks(b):
            ci, co, slots = self.plans[b]
            new_ci, new_co = device_chunk_plan(self.views[b]["cu"], _chunks(b), slots)
            ci.copy_(new_ci)
            co.copy_(new_co)
        return meta

    def _device_layout(self, b: tuple) -> None:
        """A long or batched bucket's token positions and KV slots from its rows,
        ``seq_lens`` and ``cu_seqlens`` (each token's sequence found by a search of
        ``cu_seqlens``; the padding sequences on the padding row from position 0): on the
        device, where the host would write two lists of ``t`` ints (8256 at the largest
        bucket). The padding row's page table points at the padding page, so its tokens'
        slots fall there."""
        v, t = self.views[b], b[1]
        j = self.iota[:t]
        cu = v["cu"]
        seq = torch.searchsorted(cu[1:], j, right=True)  # the sequence of each token
        pos = v["seq_lens"][seq] + j - cu[seq]
        v["positions"].copy_(pos)
        if self.kv is not None:
            ps = self.kv.page_size
            v["slots"].copy_(self.kv.page_table[v["rows"][seq], pos // ps] * ps + pos % ps)

    def _forward(self, b: tuple) -> torch.Tensor:
        meta = self.prepared[b] = self._prepare(b)
        hidden = None if self.hidden is None else self.hidden[: b[1]]
        return self.forward(meta, self.views[b]["ids"], hidden)

    def bucket(self, batch_size: int, tokens: int, longest: int | None = None) -> tuple | None:
        """The bucket a chunk of ``batch_size`` requests and ``tokens`` tokens (its longest
        sequence ``longest`` tokens, at most ``tokens``) runs in, or None when no bucket
        holds it (it runs eagerly): a short bucket, else one request's chunk in a long
        bucket, else several requests' in a batched one."""
        longest = tokens if longest is None else longest
        short = next(((n, t) for n, t in self.short_buckets if n > batch_size and t >= tokens + n - batch_size), None)
        if short is not None:
            return short
        if batch_size == 1:
            t = next((t for t in self.long_tokens if t > tokens), None)
            return None if t is None else (2, t, _fla_chunks(tokens) + _fla_chunks(t - tokens))
        if longest > BATCHED_PREFILL_SEQ_TOKENS:
            return None
        return next(((n, t) for n, t in self.batched_buckets if n > batch_size and t >= tokens + n - batch_size
                     and -(-(t - tokens) // (n - batch_size)) <= BATCHED_PREFILL_SEQ_TOKENS), None)

    def _fill(self, b, rows, seq_lens, extend_lens, ids) -> None:
        (n, t), nt, B, T = b[:2], _chunks(b), len(rows), sum(extend_lens)
        pad = n - B
        if _batched(b):  # the padding spread evenly: no sequence longer than the bucket's
            q, r = divmod(t - T, pad)
            ext = list(extend_lens) + [q + 1] * r + [q] * (pad - r)
        else:
            ext = list(extend_lens) + [t - T - (pad - 1)] + [1] * (pad - 1)
        if not B and nt == _fla_chunks(t):  # a capture's all-padding fill, in as many chunks as the graph's
            ext = [t - _FLA_CHUNK, _FLA_CHUNK]
        rows, seq = list(rows) + [self.pad_row] * pad, list(seq_lens) + [0] * pad
        cu = [0, *itertools.accumulate(ext)]
        head = rows + seq + ext + [s + e for s, e in zip(seq, ext)] + cu + list(ids) + [0] * (t - T)
        if _laid_on_device(b):  # positions and slots on the device (_device_layout), not t host ints each
            load_host(self.ints, host_int64(head))
            return
        positions = [s + j for s, e in zip(seq, ext) for j in range(e)]
        if self.kv is None:
            slots = [0] * t
        else:
            slots = [x for r, s, e in zip(rows[:B], seq, ext) for x in self.kv.slot_list([r], list(range(s, s + e)))]
            slots += [self.kv.pad_slot(i) for i in range(t - T)]
        load_host(self.ints, host_int64(head + positions + slots))

    def run(self, rows: list[int], seq_lens: list[int], extend_lens: list[int], ids: list[int],
            hidden: torch.Tensor | None = None) -> tuple[BatchMeta, torch.Tensor]:
        """Prefill one chunk (host lists the stage has validated, KV pages reserved; a
        bucket must hold it). ids: ``T`` token ids; hidden: ``[T, hidden]`` on later stages.
        Returns the chunk's layout for its ``B`` requests (views of the static buffers,
        valid until the next run) and the layers' output ``[T, hidden]`` (a fresh tensor)."""
        B, T = len(rows), sum(extend_lens)
        b = self._load(rows, seq_lens, extend_lens, ids, hidden)
        if self.capture:
            self.graphs[b].replay()
            out = self.outputs[b]
        else:
            out = self._forward(b)
        return self._result(b, B, T), out[:T].clone()

    def _load(self, rows, seq_lens, extend_lens, ids, hidden, b: tuple | None = None) -> tuple:
        """Fill bucket ``b`` (default: the smallest that holds this chunk) with the chunk, its
        ids and hidden rows too: its key."""
        T = sum(extend_lens)
        b = b or self.bucket(len(rows), T, max(extend_lens, default=0))
        self._fill(b, rows, seq_lens, extend_lens, ids)
        if self.hidden is not None:
            self.hidden[:T].copy_(hidden, non_blocking=True)
        return b

    def _result(self, b: tuple, B: int, T: int, meta: BatchMeta | None = None) -> BatchMeta:
        """The layout of bucket ``b``'s first ``B`` sequences, ``T`` tokens (views of the
        static buffers, valid until the next run); ``meta``: what the graph that ran recorded
        (:meth:`_prepare`), by default this bucket's own."""
        meta, v = meta or self.prepared[b], self.views[b]
        return BatchMeta(PREFILL, v["rows"][:B], v["seq_lens"][:B], v["ext"][:B], v["cu"][: B + 1], v["positions"][:T],
                         v["slots"][:T], meta.page_table, v["kv_lens"][:B], 0, has_init=meta.has_init[:B])


def mixed_graph_tokens() -> int:
    """The chunk length (tokens) whose long prefill bucket gets :class:`MixedGraphs`:
    ``PPSPEC_MIXED_GRAPH_TOKENS`` (default 512, the router's ``--mixed-prefill-tokens`` on
    CUDA, so the chunks of a long prompt arriving beside decodes; 0 turns them off)."""
    value = os.environ.get("PPSPEC_MIXED_GRAPH_TOKENS", "512")
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"PPSPEC_MIXED_GRAPH_TOKENS must be an integer, got {value!r}") from None


class MixedGraphs:
    """Graphs of a mixed micro-batch (decode or verify requests, then one request's prefill
    chunk) as ONE forward, one per (decode / verify bucket ``b`` of ``steps``, long prefill
    bucket ``(2, t, chunks)`` of ``prefill``).

    Replayed one after the other, a step graph and a long prefill graph each read every
    weight and run every GEMM, once for the ``b * D`` decode tokens and once for the chunk's
    ``t``: on the H200 (1.46B, 32 decodes beside 512-token chunks) a mixed round took ~10 ms,
    7.3 of them kernels, against 2.8 ms for the decode round alone. Here the eager mixed
    forward (a :class:`MixedMeta` over the ``b * D`` padded decode / verify tokens followed
    by the chunk bucket's ``t`` padded tokens, bounds ``[0, b * D, b * D + t]``, static per
    graph) is recorded once, so the token-wise work (projections, norms, MLP) runs over
    both parts in one GEMM each and attention / GDN per part with the part's kernel.

    Nothing is duplicated: the head's static buffers, host fill, device layout
    (``StepGraphs._layout``) and metas are those of ``steps`` (the mode's graphs), the
    chunk's (fill, ``has_init``, fla's chunk plan made on the device: ``PrefillGraphs._prepare``)
    those of ``prefill``'s long bucket; the forward's inputs are the two buffers joined
    inside the graph (``ids`` ``[b * D + t]`` int64, ``hidden`` ``[b * D + t, hidden]`` in
    the stage's dtype on later stages), its output ``[b * D + t, hidden]``.

    Only the long bucket that a chunk of ``chunk_tokens`` tokens takes gets graphs (both of
    its chunk-count variants), since beside decodes the router sends a long prompt in chunks
    of ``--mixed-prefill-tokens`` (:func:`mixed_graph_tokens`): ``len(steps.sizes) x 2``
    graphs, none when ``prefill`` has no such bucket. A shorter chunk that fills at least
    half the bucket pads into it (:meth:`bucket`); a longer or shorter one, or two chunks,
    runs as before (``StageRunner._graph_runs``).

    Args:
        forward: ``forward(meta: MixedMeta, ids, hidden or None) -> [b * D + t, hidden]``.
        steps: the mode's :class:`StepGraphs` (one KV pool). prefill: the stage's
            :class:`PrefillGraphs`.
        chunk_tokens: the chunk length whose long bucket gets graphs.
        capture: record CUDA graphs (False: run the padded path eagerly, as the CPU tests do).
        pool: CUDA graph memory pool shared with the other graphs.
    """

    def __init__(self, forward: Callable, steps: StepGraphs, prefill: PrefillGraphs, *, chunk_tokens: int,
                 capture: bool, pool=None):
        self.forward, self.steps, self.prefill, self.capture, self.pool = forward, steps, prefill, capture, pool
        long = prefill.bucket(1, chunk_tokens) if chunk_tokens > 0 else None
        chunk_buckets = [b for b in prefill.buckets if long is not None and len(long) == 3 and b[:2] == long[:2]]
        self.keys = {(hb, pb) for hb in steps.sizes for pb in chunk_buckets}
        self.chunk_t = chunk_buckets[0][1] if chunk_buckets else None  # the captured bucket's tokens
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.prepared: dict[tuple, tuple[BatchMeta, BatchMeta]] = {}  # each key's parts as its forward made them
        t0 = time.perf_counter()
        D = steps.D
        with torch.inference_mode():
            # the largest first: smaller graphs reuse their memory in the shared pool
            for key in sorted(self.keys, key=lambda k: (k[0] * D + k[1][1], k[1][2]), reverse=True):
                hb, pb = key
                steps._fill(hb, [], [], [], [])
                prefill._fill(pb, [], [], [], [])
                if capture:
                    self.graphs[key], self.outputs[key], self.pool = record(lambda: self._forward(key), self.pool)
        if capture and self.keys:
            log.info("captured %d CUDA graphs for %s beside a prefill chunk (batch sizes %s x chunk buckets %s) "
                     "in %.1f s", len(self.keys), steps.mode, steps.sizes, sorted(chunk_buckets),
                     time.perf_counter() - t0)

    def _forward(self, key: tuple) -> torch.Tensor:
        (hb, pb), steps, prefill = key, self.steps, self.prefill
        steps._layout(hb)
        head, chunk = steps.metas[hb][0], prefill._prepare(pb)
        self.prepared[key] = head, chunk
        n, t = hb * steps.D, pb[1]
        slots = None
        if steps.kvs[0] is not None:  # the parts' slots joined (no attention layers: placeholders)
            kv = steps.kvs[0]
            slots = known(torch.cat([head.slots, chunk.slots]), min=0, max=kv.k.shape[1] * kv.page_size - 1)
        meta = MixedMeta([head, chunk], [0, n, n + t], torch.cat([head.positions, chunk.positions]), slots)
        ids = torch.cat([steps.views[hb]["ids"], prefill.views[pb]["ids"]])
        hidden = None if steps.hidden is None else torch.cat([steps.hidden[:n], prefill.hidden[:t]])
        return self.forward(meta, ids, hidden)

    def bucket(self, batch_size: int, chunk_tokens: int) -> tuple | None:
        """The graph a micro-batch of ``batch_size`` decode / verify requests and one chunk of
        ``chunk_tokens`` tokens replays, or None.

        The chunk's own bucket (:meth:`PrefillGraphs.bucket`) where it has graphs; a chunk
        whose own bucket is a smaller one (a prompt's last, 320 tokens of an 8000-token
        prompt in chunks of 512, say) pads into the captured bucket while at least half the
        bucket's tokens are its own: one replay that pads the chunk costs less than two
        that each read every weight (on the H200 such a round took 13.4 ms in two replays,
        a mixed graph's round 8-9 ms; docs/PERFORMANCE.md, "Prefill and the token budget").
        A shorter chunk keeps the two replays, its prefill graph being small."""
        hb, t = self.steps.bucket(batch_size), self.chunk_t
        key = (hb, self.prefill.bucket(1, chunk_tokens))
        if key not in self.keys and t is not None and t // 2 <= chunk_tokens < t:
            key = (hb, (2, t, _fla_chunks(chunk_tokens) + _fla_chunks(t - chunk_tokens)))
        return key if key in self.keys else None

    def run(self, rows: list[int], seq_lens: list[int], ids: list[int], chunk_row: int, chunk_seq_len: int,
            chunk_ids: list[int], hidden: torch.Tensor | None = None) -> tuple[MixedMeta, torch.Tensor]:
        """Run ``B = len(rows)`` decode / verify requests (``ids``: ``B * D``) and one
        request's chunk (row ``chunk_row``, ``chunk_seq_len`` tokens cached, ``chunk_ids``:
        its ``T`` tokens) in one replay (host lists the stage has validated, KV pages
        reserved; :meth:`bucket` must hold it). hidden: ``[B * D + T, hidden]`` on later
        stages. Returns the micro-batch's :class:`MixedMeta` (the parts: the head's layout
        and the chunk's, bounds ``[0, B * D, B * D + T]``) and the layers' output
        ``[B * D + T, hidden]`` (a fresh tensor)."""
        B, D, T = len(rows), self.steps.D, len(chunk_ids)
        key = self.bucket(B, T)
        hb, pb = key
        n = B * D
        self.steps._load(rows, seq_lens, ids, None if hidden is None else hidden[:n], ())
        self.prefill._load([chunk_row], [chunk_seq_len], [T], chunk_ids, None if hidden is None else hidden[n:], pb)
        self.steps.launched_at = time.perf_counter()
        if self.capture:
            self.graphs[key].replay()
            out = self.outputs[key]
        else:
            out = self._forward(key)
        head = self.steps._result(hb, B)
        chunk = self.prefill._result(pb, 1, T, self.prepared[key][1])
        return MixedMeta.of([head, chunk], [[D] * B, [T]]), torch.cat([out[:n], out[hb * D:hb * D + T]])
