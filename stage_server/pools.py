"""Per-stage memory pools, every one addressed by ``req_pool_index`` (a stable row).

Row ``max_rows`` of each pool is the padding row. Rows are allocated by the router's
scheduler; a stage only checks them and tracks which are in use (for ``Info``). The state
pool is laid out from a layer family's declaration (``StateLayout``; docs/DESIGN.md,
"Layer families"): a new family brings no pool code.
"""
from __future__ import annotations

import torch

from ppspec.kernels.checks import check_commit, known
from ppspec.kernels.commit.naive import commit_accept_conv_replay_ref, commit_accept_ref
from ppspec.kernels.gdn import alloc_replay_meta, replay_reset

from .family import SCRATCH, LayerState, StateLayout, StateSpec
from .graphs import host_int64


def device_int64(values: list[int], device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, copied without waiting for the device.

    A plain ``torch.tensor(values, device=cuda)`` or ``.to(cuda)`` copies from pageable
    memory and then synchronises the stream: the host waits for every kernel queued before
    it (a snapshot after a step waited for the step). On CUDA the values go through a
    pinned buffer with an asynchronous copy, ordered on the stream like any kernel; on a
    CPU it is the host tensor itself."""
    return to_device(host_int64(values), device)


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """The host tensor ``host`` on ``device`` without waiting for the device
    (:func:`device_int64`'s copy, for any dtype): through pinned memory on CUDA, ``host``
    itself elsewhere. ``.to(cuda, non_blocking=True)`` from pageable memory still
    synchronises the stream before it copies."""
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class PoolExhaustedError(RuntimeError):
    """The KV pool has no free page for a request; nothing was allocated."""


class KVPool:
    """Paged KV cache of ``num_layers`` attention layers.

    k, v: ``[num_layers, num_pages + 1, page_size, Hkv, hd]``; page ``num_pages`` is the
    padding page, never handed out: padded batches (CUDA graphs, ``stage_server.graphs``)
    write their padding tokens' KV there. page_table: ``[rows + 1, max_pages_per_row]``
    int64; the padding row points at the padding page, unused entries of other rows at
    page 0 (never read: attention only reads positions below each row's KV length).
    """

    def __init__(self, num_layers, max_rows, token_budget, page_size, nkv, hd, max_context, dtype, device,
                 shared_kv: bool = False):
        self.page_size = page_size
        self.num_pages = max(1, -(-token_budget // page_size))
        self.pad_page = self.num_pages
        self.max_pages_per_row = -(-max_context // page_size)
        shape = (num_layers, self.num_pages + 1, page_size, nkv, hd)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        # shared_kv: keys and values are one tensor (MLA's compressed latent, Kimi Linear:
        # stage_server/models/kimi_linear/model.py), held once
        self.v = self.k if shared_kv else torch.zeros(shape, dtype=dtype, device=device)
        self.page_table = torch.zeros(max_rows + 1, self.max_pages_per_row, dtype=torch.long, device=device)
        self.page_table[max_rows] = self.pad_page
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.row_pages: dict[int, list[int]] = {}
        # holders of each page: rows, and prefix-cache snapshots (stage_server.snapshots),
        # which share a prefix's pages; a page is free again when its last holder lets go
        self.refs = [0] * self.num_pages

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * (1 if self.v is self.k else 2)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    def ensure(self, rows: list[int], lengths: list[int], need: list[int] | None = None) -> None:
        """Give each row pages for ``length`` tokens. All or nothing. ``need``: what
        :meth:`pages_needed` returned for these rows and lengths, when the caller has it.

        Raises:
            PoolExhaustedError: not enough free pages (no page is taken).
            ValueError: a length beyond the context the page table covers.
        """
        if need is None:
            need = self.pages_needed(rows, lengths)
        if sum(need) > len(self.free_pages):
            raise PoolExhaustedError(f"KV pool: need {sum(need)} pages, {len(self.free_pages)} free")
        at_rows, at_cols, pages = [], [], []
        for row, k in zip(rows, need):
            have = self.row_pages.setdefault(row, [])  # a row ensured for 0 tokens has (no) slots
            for _ in range(k):
                at_rows.append(row)
                at_cols.append(len(have))
                have.append(self.free_pages.pop())
                pages.append(have[-1])
                self.refs[have[-1]] = 1
        if not pages:
            return
        # one host->device copy for the step's new pages (a scalar write each would be a
        # copy and a launch each: ~4 per step at batch 64, 16-token pages)
        self._set_pages(at_rows, at_cols, pages)

    def _set_pages(self, rows: list[int], cols: list[int], pages: list[int]) -> None:
        """``page_table[rows[i], cols[i]] = pages[i]``: one host-to-device copy (no wait for
        the device) and one launch."""
        n = len(pages)
        idx = device_int64(rows + cols + pages, self.page_table.device)
        self.page_table[idx[:n], idx[n:2 * n]] = idx[2 * n:]

    def pages_needed(self, rows: list[int], lengths: list[int]) -> list[int]:
        """New pages each row needs to hold ``length`` tokens (pages it has count).

        Raises:
            ValueError: a length beyond the context the page table covers.
        """
        ps, have, cap = self.page_size, self.row_pages, self.max_pages_per_row * self.page_size
        if lengths and max(lengths) > cap:
            bad = next(((r, n) for r, n in zip(rows, lengths) if n > cap), None)
            if bad is not None:
                raise ValueError(f"row {bad[0]}: {bad[1]} tokens exceed the context limit")
        # called on every step for every row: one comprehension, most rows need nothing
        need = [-(-n // ps) - len(have.get(r, ())) for r, n in zip(rows, lengths)]
        return [k if k > 0 else 0 for k in need]

    def release(self, row: int) -> None:
        self.unhold(self.row_pages.pop(row, []))

    def hold(self, pages: list[int]) -> None:
        """One more holder (a snapshot) of ``pages``."""
        for p in pages:
            self.refs[p] += 1

    def unhold(self, pages: list[int]) -> None:
        """One holder fewer of ``pages``; those with none left are free."""
        refs, free = self.refs, self.free_pages
        for p in reversed(pages):
            refs[p] -= 1
            if refs[p] == 0:
                free.append(p)

    def share(self, rows: list[int], pages: list[list[int]], lengths: list[int]) -> None:
        """Give each of ``rows`` (holding no page) the first ``lengths[i]`` tokens of
        ``pages[i]`` (a snapshot's): the whole pages shared, a partial last page copied to a
        page of its own (the row writes the positions after its length there: copy on
        write). All rows at once: one page-table write, one copy of the partial pages of
        ``k`` (and of ``v``), whatever the rows and layers.

        Raises PoolExhaustedError (nothing taken) when the copies find too few free pages."""
        ps = self.page_size
        need = sum(1 for n in lengths if n % ps)
        if need > len(self.free_pages):
            raise PoolExhaustedError(f"KV pool: need {need} pages, {len(self.free_pages)} free")
        at_rows, at_cols, at_pages, src, dst = [], [], [], [], []
        for row, held, n in zip(rows, pages, lengths):
            full, part = divmod(n, ps)
            own = held[:full]
            self.hold(own)
            if part:
                p = self.free_pages.pop()
                self.refs[p] = 1
                src.append(held[full])
                dst.append(p)
                own = own + [p]
            self.row_pages[row] = own
            at_rows += [row] * len(own)
            at_cols += range(len(own))
            at_pages += own
        if src:
            idx = device_int64(src + dst, self.k.device)
            src_t, dst_t = idx[: len(src)], idx[len(src):]
            for t in (self.k, self.v) if self.v is not self.k else (self.k,):
                t[:, dst_t] = t[:, src_t]
        if at_pages:
            self._set_pages(at_rows, at_cols, at_pages)

    def slot_list(self, rows: list[int], positions: list[int]) -> list[int]:
        """Flat slot of each token on the host: ``rows`` has one entry per request, and
        ``positions`` ``len(positions) // len(rows)`` consecutive entries per request.
        Rows must hold pages for these positions (:meth:`ensure`)."""
        n, ps, pages = len(positions) // max(len(rows), 1), self.page_size, self.row_pages
        per_token = rows if n == 1 else [r for r in rows for _ in range(n)]
        return [pages[r][p // ps] * ps + p % ps for r, p in zip(per_token, positions)]

    def pad_slot(self, i: int) -> int:
        """The ``i``-th padding token's slot (in the padding page; tokens past a page wrap)."""
        return self.pad_page * self.page_size + i % self.page_size

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot of each token: ``[T]`` from per-token rows and positions."""
        return self.page_table[rows, positions // self.page_size] * self.page_size + positions % self.page_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]


COMMIT_DESIGNS = ("copy", "replay")


def alloc_state(spec: StateSpec, lead: tuple[int, ...], dtype: torch.dtype, device, zero: bool = True) -> torch.Tensor:
    """Zeros ``[*lead, *spec.shape]`` in ``spec.dtype`` (None: ``dtype``); ``zero=False``:
    uninitialised (on a CPU, pages never written are never touched). A column-major
    spec (conv windows) is stored with its last two dims swapped and seen through a
    transpose: each row's window is still one dense block, a step's column ``C``
    consecutive elements (``kernels/conv1d/triton_update.py`` loads them coalesced)."""
    shape = spec.shape if not spec.column_major else (*spec.shape[:-2], spec.shape[-1], spec.shape[-2])
    t = (torch.zeros if zero else torch.empty)(*lead, *shape, dtype=spec.dtype or dtype, device=device)
    return t.transpose(-1, -2) if spec.column_major else t


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class RowStatePool:
    """Per-row state of ``num_layers`` layers of one layer family, as its
    :class:`~stage_server.family.StateLayout` declares, and what a verify keeps.

    ``L = num_layers``, ``R = max_rows + 1`` rows (the last pads), ``D = num_verify_tokens``.
    For each declared :class:`~stage_server.family.StateSpec` ``name`` (seen as attributes:
    ``pool.conv``, ``pool.ssm`` for GDN):

    - ``pool.<name>``: ``[L, R, *shape]`` committed state.
    - ``pool.<name>_scratch``: ``[L, R, D, *shape]``, the state after each verify step,
      for every spec under ``commit_design="copy"`` and for ``SCRATCH`` specs (conv
      windows: small, their commit is a copy) under ``"replay"``; else None.
    - ``commit_design="replay"`` (docs/DESIGN.md, "Commit rule"): ``replay[l]`` is layer
      ``l``'s record (``family.record_type``: each ``RecordSpec`` ``[R, 2, D, *shape]`` fp32,
      then ``pending``/``slot``, rows of ``replay_pending``/``replay_slot`` ``[L, R]`` int32,
      so that one commit covers every layer).

    Scratch and replay buffers exist only when ``D > 1``; with ``D = 1`` there is no verify
    and nothing to commit.

    Raises:
        ValueError: ``commit_design`` not one of :data:`COMMIT_DESIGNS`, or ``"replay"``
            for a family that declares no replay record.
    """

    def __init__(self, layout: StateLayout, num_layers: int, max_rows: int, num_verify_tokens: int,
                 dtype: torch.dtype, device, *, commit_design: str = "copy"):
        if commit_design not in COMMIT_DESIGNS:
            raise ValueError(f"commit_design must be one of {', '.join(COMMIT_DESIGNS)}, got {commit_design!r}")
        fam = layout.family
        if commit_design == "replay" and not layout.record:
            raise ValueError(f"commit_design replay: layer family {fam.name!r} declares no replay record")
        self.layout, self.commit_design = layout, commit_design
        self.num_verify_tokens = d = num_verify_tokens
        L, n = num_layers, max_rows + 1
        self.state = {s.name: alloc_state(s, (L, n), dtype, device) for s in layout.state}
        self.scratch: dict[str, torch.Tensor | None] = {
            s.name: alloc_state(s, (L, n, d), dtype, device) if d > 1 and (commit_design == "copy" or s.verify == SCRATCH)
            else None
            for s in layout.state
        }
        self.replay: list | None = None
        self.replay_pending = self.replay_slot = None
        self.graphs = None  # CommitGraphs, when the stage captured them (use_graphs)
        self._record: dict[str, torch.Tensor] = {}
        if d > 1 and commit_design == "replay":
            self.replay_pending, self.replay_slot = alloc_replay_meta(L, n, device)
            self._record = {r.name: torch.zeros(L, n, 2, d, *r.shape, dtype=torch.float32, device=device)
                            for r in layout.record}
            self.replay = [fam.record_type(*(self._record[r.name][i] for r in layout.record),
                                           self.replay_pending[i], self.replay_slot[i]) for i in range(L)]

    def __getattr__(self, name: str) -> torch.Tensor | None:
        # pool.<name> and pool.<name>_scratch of the declared specs (see the class docstring)
        d = self.__dict__
        if "state" in d:
            if name in d["state"]:
                return d["state"][name]
            if name.endswith("_scratch") and name[: -len("_scratch")] in d["state"]:
                return d["scratch"][name[: -len("_scratch")]]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def verifies(self) -> bool:
        """Whether the pool keeps verify state (``D > 1``), hence has something to commit."""
        return self.num_verify_tokens > 1

    @property
    def nbytes(self) -> dict[str, int]:
        """``{"state": committed state, "verify_scratch": scratches, or scratches and the
        replay record}`` in bytes."""
        scratch = sum(map(_nbytes, self.scratch.values())) + sum(map(_nbytes, self._record.values()))
        scratch += _nbytes(self.replay_pending) + _nbytes(self.replay_slot)
        return {"state": sum(map(_nbytes, self.state.values())), "verify_scratch": scratch}

    @classmethod
    def nbytes_of(cls, layout: StateLayout, num_layers: int, max_rows: int, num_verify_tokens: int,
                  dtype: torch.dtype, commit_design: str = "copy") -> dict[str, int]:
        """Bytes a pool of these arguments allocates, before allocating anything (the
        stage's memory-budget check): the pool laid out on the meta device, which takes no
        memory, so the count cannot drift from the allocation. Keys as :attr:`nbytes`."""
        return cls(layout, num_layers, max_rows, num_verify_tokens, dtype, "meta", commit_design=commit_design).nbytes

    def layer(self, i: int) -> LayerState:
        """Layer ``i``'s views, handed to its forward."""
        return LayerState({k: t[i] for k, t in self.state.items()},
                          {k: None if t is None else t[i] for k, t in self.scratch.items()},
                          None if self.replay is None else self.replay[i])

    def flush(self, rows: torch.Tensor) -> None:
        """Replay design: apply ``rows``' pending accepted steps (``[B]`` int64 on the pool's
        device) to their committed state in every layer (``LayerFamily.flush``), before a
        prefill continues the rows or a snapshot reads them."""
        for i in range(len(self.replay)):
            self.layout.family.flush(self.layer(i), rows)

    def drop_pending(self, rows: torch.Tensor) -> None:
        """Replay design: forget ``rows``' pending steps (a new request on the row)."""
        replay_reset(self.replay_pending, rows)

    def commit(self, rows: list[int] | torch.Tensor, accept_lengths: list[int] | torch.Tensor) -> None:
        """The commit of one micro-batch's accepted verify steps, in every layer: the one
        commit every stage runs, on CPU and CUDA alike, for every family and both designs
        (docs/DESIGN.md, "Commit rule"); the rule itself is :meth:`launch_commit`'s.
        ``rows`` ``[B]`` and ``accept_lengths`` ``[B]`` in ``[1, D]``: host lists (the
        stage's), or integer tensors with their host-known bounds stated
        (:func:`~ppspec.kernels.checks.known`) where a check should not read the device.

        Validated first (rows in ``[0, R)`` and distinct, lengths in ``[1, D]``:
        ``kernels.checks.check_commit``). Then host lists of a batch that a captured graph
        holds replay it (``stage_server.graphs.CommitGraphs``, recorded from
        :meth:`launch_commit`; :meth:`use_graphs`); anything else is one host-to-device copy
        and :meth:`launch_commit`.

        Raises:
            RuntimeError: the pool has no verify scratch (started with D = 1).
            IndexError: a row outside ``[0, rows + 1)`` or repeated rows.
            ValueError: an accept length outside ``[1, D]`` or a length mismatch.
            Nothing is written when it raises.
        """
        if not self.verifies:
            raise RuntimeError("commit without a verify scratch (the stage was started with D = 1)")
        if not isinstance(rows, torch.Tensor):
            # host lists: what the check needs is computed here in Python and stated, so the
            # check reads no tensor, and the device copy carries the same facts
            rows_h, acc_h = host_int64(rows), host_int64(accept_lengths)
            facts = [dict(min=min(rows), max=max(rows), unique=len(set(rows)) == len(rows)),
                     dict(min=min(accept_lengths), max=max(accept_lengths))] if rows and accept_lengths else [{}, {}]
            if not check_commit(known(rows_h, **facts[0]), known(acc_h, **facts[1]), self.num_rows,
                                self.num_verify_tokens):
                return
            if self.graphs is not None and self.graphs.bucket(len(rows)) is not None:
                self.graphs.run(rows, accept_lengths)
                return
            both = torch.stack([rows_h, acc_h]).to(self.device)  # one host-to-device copy
            rows_t, acc_t = known(both[0], **facts[0]), known(both[1], **facts[1])
        else:
            if not check_commit(rows, accept_lengths, self.num_rows, self.num_verify_tokens):
                return
            rows_t, acc_t = (t.to(self.device, torch.long).contiguous() for t in (rows, accept_lengths))
        self.launch_commit(rows_t, acc_t)

    def use_graphs(self, graphs) -> None:
        """Replay ``graphs`` (``stage_server.graphs.CommitGraphs`` of :meth:`launch_commit`)
        for the commits of host lists they hold."""
        self.graphs = graphs

    def launch_commit(self, rows: torch.Tensor, accept_lengths: torch.Tensor) -> None:
        """The commit rule (docs/DESIGN.md, "Commit rule"), for every layer of the pool at once:

            for each tensor with a scratch (copy design: every one; replay design: the
            SCRATCH specs, conv windows):  state[:, row] = scratch[:, row, accept_length - 1]
            replay design, the REPLAY specs: pending[:, row] = accept_length, slot[:, row] flips;
            the row's next verify, decode or continuing prefill replays the steps (the
            family's kernels, LayerFamily.flush)

        The writes alone: no checks and, on CUDA, no host sync, so a CUDA graph can record
        it. ``rows`` / ``accept_lengths`` ``[B]`` int64, contiguous on the pool's device and
        validated by the caller (:meth:`commit`), except that an entry with accept length 0
        writes nothing (a graph's padding, whose row may repeat). On CUDA one launch per
        tensor (``kernels/commit/triton_commit.py``; the replay design's first scratch
        tensor and the counters in one); elsewhere the plain-torch references
        (``kernels/commit/naive.py``)."""
        if self.device.type == "cuda":  # the kernels skip the padding entries themselves
            from ppspec.kernels.commit.triton_commit import launch_commit as copy
            from ppspec.kernels.commit.triton_commit import launch_commit_conv_replay as copy_and_mark
        else:  # the references, on the entries that are not padding
            real = accept_lengths > 0
            rows, accept_lengths = rows[real], accept_lengths[real]
            copy, copy_and_mark = commit_accept_ref, commit_accept_conv_replay_ref
        names = [k for k, t in self.scratch.items() if t is not None]
        if self.commit_design == "replay":
            copy_and_mark(self.state[names[0]], self.scratch[names[0]], self.replay_pending, self.replay_slot,
                          rows, accept_lengths)
            names = names[1:]
        for k in names:
            copy(self.state[k], self.scratch[k], rows, accept_lengths)

    @property
    def num_rows(self) -> int:
        """``R``: rows of the pool, the padding row included."""
        return next(iter(self.state.values())).shape[1]

    @property
    def device(self) -> torch.device:
        return next(iter(self.state.values())).device


class StatePool(RowStatePool):
    """A GDN pool by its sizes: the signature of the callers from before layer families
    (tests, benches). ``hv, dk, dv``: value heads and head dims; ``num_k_heads``: key heads
    (default ``hv``); ``conv_dim``, ``conv_width``: the conv window's channels and width;
    ``per_channel_gate``: KDA's replay record (``layers/gdn.gdn_layout``)."""

    def __init__(self, num_layers, max_rows, hv, dk, dv, conv_dim, conv_width, num_verify_tokens, dtype, device,
                 *, num_k_heads: int | None = None, commit_design: str = "copy", per_channel_gate: bool = False):
        from .layers.gdn import gdn_layout

        hk = hv if num_k_heads is None else num_k_heads
        super().__init__(gdn_layout(hk, hv, dk, dv, conv_dim, conv_width, per_channel_gate=per_channel_gate),
                         num_layers, max_rows, num_verify_tokens, dtype, device, commit_design=commit_design)


def state_pool_nbytes(
    num_layers, max_rows, hk, hv, dk, dv, conv_dim, conv_width, num_verify_tokens, dtype, commit_design="copy",
    per_channel_gate=False,
) -> dict[str, int]:
    """Bytes :class:`StatePool` allocates for these GDN sizes (:meth:`RowStatePool.nbytes_of`)."""
    return StatePool(num_layers, max_rows, hv, dk, dv, conv_dim, conv_width, num_verify_tokens, dtype, "meta",
                     num_k_heads=hk, commit_design=commit_design, per_channel_gate=per_channel_gate).nbytes
