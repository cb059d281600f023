"""Per-stage memory pools, every one addressed by ``req_pool_index`` (a stable row).

Row ``max_rows`` of each pool is the padding row. Rows are allocated by the router's
scheduler; a stage only checks them and tracks which are in use (for ``Info``).
"""
from __future__ import annotations

import torch

from ppspec.kernels.commit import commit_accept, commit_accept_conv_replay
from ppspec.kernels.commit.naive import commit_accept_conv_replay_ref, commit_accept_ref
from ppspec.kernels.gdn import ReplayBuffers, alloc_replay_buffers, alloc_replay_meta

from .model import LinearLayerState


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
        # stage_server/families/kimi_linear/model.py), held once
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
        r, c, p = torch.tensor([at_rows, at_cols, pages], dtype=torch.long).to(self.page_table.device)
        self.page_table[r, c] = p

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

    def share(self, row: int, pages: list[int], length: int) -> None:
        """Give ``row`` (holding no page) the first ``length`` tokens of ``pages`` (a
        snapshot's): the whole pages shared, a partial last page copied to a page of its own
        (the row writes the positions after ``length`` there: copy on write).

        Raises PoolExhaustedError (nothing taken) when the copy finds no free page."""
        full, part = divmod(length, self.page_size)
        if part and not self.free_pages:
            raise PoolExhaustedError(f"KV pool: need 1 page, 0 free")
        own = pages[:full]
        self.hold(own)
        if part:
            p = self.free_pages.pop()
            self.refs[p] = 1
            self.k[:, p] = self.k[:, pages[full]]
            self.v[:, p] = self.v[:, pages[full]]
            own = own + [p]
        self.row_pages[row] = own
        if own:
            self.page_table[row, : len(own)] = torch.tensor(own, dtype=torch.long).to(self.page_table.device)

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


def _replay_data(b: ReplayBuffers) -> list[torch.Tensor]:
    """The per-step data tensors of a layer's buffers (not the shared pending/slot views)."""
    return [t for name, t in zip(b._fields, b) if name not in ("pending", "slot")]


def _column_major(windows: torch.Tensor) -> torch.Tensor:
    """``[..., W - 1, C]`` storage seen as the ``[..., C, W - 1]`` windows the kernels take."""
    return windows.transpose(-1, -2)


class StatePool:
    """Recurrent state, conv window and verify scratch of ``num_layers`` GDN layers.

    ``L = num_layers``, ``R = max_rows + 1`` rows (the last pads), ``D = num_verify_tokens``:

    - ssm: ``[L, R, HV, K, V]`` fp32 committed state; conv: ``[L, R, C, W - 1]`` in ``dtype``.
    - conv_scratch: ``[L, R, D, C, W - 1]``, the conv window after each verify step (both
      designs; the conv window is small, its commit is a copy).
    - A window is stored column-major (strides ``(1, C)`` on its ``[C, W - 1]``): a step's
      column is ``C`` consecutive elements, which the GPU conv kernels load and store
      coalesced (``kernels/conv1d/triton_update.py``). Each row's window is one dense block
      in both tensors, so the commit still copies it as one span.
    - ``commit_design="copy"``: ssm_scratch ``[L, R, D, HV, K, V]`` fp32, the state after
      each verify step; the commit copies ``ssm_scratch[row, accept_length - 1]`` to ``ssm[row]``.
    - ``commit_design="replay"`` (docs/DESIGN.md, "Commit rule"): no ssm_scratch; ``replay[l]`` is the
      layer's :class:`~ppspec.kernels.gdn.ReplayBuffers` (per verify step, two slots, fp32
      whatever ``dtype``, so a bf16 stage replays exactly what it verified: normalised key
      ``k [R, 2, D, H, K]``, ``delta [R, 2, D, HV, V]``, log decay ``g [R, 2, D, HV]``), whose
      ``pending``/``slot`` are rows of ``replay_pending``/``replay_slot`` ``[L, R]`` int32, so
      one commit covers every layer. ``per_channel_gate`` (KDA): the log decay is kept per key
      channel, ``g [R, 2, D, HV, K]``.

    Scratch and replay buffers exist only when ``D > 1``; with ``D = 1`` there is no verify
    and nothing to commit.

    Raises:
        ValueError: ``commit_design`` not one of :data:`COMMIT_DESIGNS`.
    """

    def __init__(self, num_layers, max_rows, hv, dk, dv, conv_dim, conv_width, num_verify_tokens, dtype, device,
                 *, num_k_heads: int | None = None, commit_design: str = "copy", per_channel_gate: bool = False):
        if commit_design not in COMMIT_DESIGNS:
            raise ValueError(f"commit_design must be one of {', '.join(COMMIT_DESIGNS)}, got {commit_design!r}")
        self.commit_design = commit_design
        self.num_verify_tokens = d = num_verify_tokens
        hk = hv if num_k_heads is None else num_k_heads
        n = max_rows + 1
        self.ssm = torch.zeros(num_layers, n, hv, dk, dv, dtype=torch.float32, device=device)
        self.conv = _column_major(torch.zeros(num_layers, n, conv_width - 1, conv_dim, dtype=dtype, device=device))
        self.ssm_scratch = self.conv_scratch = None
        self.replay: list[ReplayBuffers] | None = None
        self.replay_pending = self.replay_slot = None
        if d > 1:
            self.conv_scratch = _column_major(
                torch.zeros(num_layers, n, d, conv_width - 1, conv_dim, dtype=dtype, device=device))
            if commit_design == "copy":
                self.ssm_scratch = torch.zeros(num_layers, n, d, hv, dk, dv, dtype=torch.float32, device=device)
            else:
                self.replay_pending, self.replay_slot = alloc_replay_meta(num_layers, n, device)
                self.replay = [
                    alloc_replay_buffers(n, d, hk, hv, dk, dv, device=device, meta=(self.replay_pending[i], self.replay_slot[i]),
                                         per_channel_gate=per_channel_gate)
                    for i in range(num_layers)
                ]

    @property
    def nbytes(self) -> dict[str, int]:
        """``{"state": ssm + conv, "verify_scratch": conv_scratch + ssm_scratch or replay buffers}`` in bytes."""
        size = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        scratch = size(self.ssm_scratch) + size(self.conv_scratch)
        if self.replay is not None:
            scratch += sum(size(t) for b in self.replay for t in _replay_data(b))
            scratch += size(self.replay_pending) + size(self.replay_slot)
        return {"state": size(self.ssm) + size(self.conv), "verify_scratch": scratch}

    def launch_commit(self, rows: torch.Tensor, accept_lengths: torch.Tensor) -> None:
        """:meth:`commit`'s writes alone: no checks and, on CUDA, no host sync, so a CUDA
        graph can record it (``stage_server.graphs.CommitGraphs``). ``rows`` /
        ``accept_lengths`` ``[B]`` int64, contiguous on the pool's device and validated by
        the caller, except that an entry with accept length 0 writes nothing (a graph's
        padding, whose row may repeat)."""
        if self.conv.is_cuda:  # the kernels skip the padding entries themselves
            from ppspec.kernels.commit.triton_commit import launch_commit as copy
            from ppspec.kernels.commit.triton_commit import launch_commit_conv_replay as conv_replay
        else:  # the references, on the entries that are not padding
            real = accept_lengths > 0
            rows, accept_lengths = rows[real], accept_lengths[real]
            copy, conv_replay = commit_accept_ref, commit_accept_conv_replay_ref
        if self.commit_design == "copy":
            copy(self.conv, self.conv_scratch, rows, accept_lengths)
            copy(self.ssm, self.ssm_scratch, rows, accept_lengths)
        else:
            conv_replay(self.conv, self.conv_scratch, self.replay_pending, self.replay_slot, rows, accept_lengths)

    def layer(self, i: int) -> LinearLayerState:
        pick = lambda t: None if t is None else t[i]  # noqa: E731
        return LinearLayerState(
            self.conv[i], self.ssm[i], pick(self.conv_scratch), pick(self.ssm_scratch), pick(self.replay)
        )

    def commit(self, rows: torch.Tensor, accept_lengths: torch.Tensor) -> None:
        """Commit the accepted verify steps of ``rows`` (``[B]`` int64) in every layer, with
        ``accept_lengths`` ``[B]`` int64 in ``[1, D]`` (docs/DESIGN.md, "Commit rule").

        Conv window (both designs): ``conv[row] = conv_scratch[row, accept_length - 1]``.
        Copy design: ``ssm[row] = ssm_scratch[row, accept_length - 1]``. Replay design:
        ``pending[:, row] = accept_length`` and ``slot[:, row]`` flips, for all layers in one
        call; the next verify, decode or continuing prefill of the row applies the steps.
        The replay design's whole commit (conv windows included) is
        :func:`~ppspec.kernels.commit.commit_accept_conv_replay`: one validation, and on CUDA
        one launch. Pass ``rows`` and ``accept_lengths`` on the pool's device, with their
        host-known bounds stated (:func:`~ppspec.kernels.checks.known`) so the check does not
        read the device.

        Raises:
            RuntimeError: the pool has no verify scratch (started with D = 1).
            IndexError: a row outside ``[0, rows + 1)`` or repeated rows.
            ValueError: an accept length outside ``[1, D]`` or a length mismatch.
            Nothing is written when it raises.
        """
        if self.conv_scratch is None:
            raise RuntimeError("commit without a verify scratch (the stage was started with D = 1)")
        if self.commit_design == "copy":
            commit_accept(self.conv, self.conv_scratch, rows, accept_lengths)  # validates first
            commit_accept(self.ssm, self.ssm_scratch, rows, accept_lengths)
        else:
            # validated once; on CUDA one launch for conv windows, pending and slot of every layer
            commit_accept_conv_replay(self.conv, self.conv_scratch, self.replay_pending, self.replay_slot,
                                      rows, accept_lengths)


def state_pool_nbytes(
    num_layers, max_rows, hk, hv, dk, dv, conv_dim, conv_width, num_verify_tokens, dtype, commit_design="copy",
    per_channel_gate=False,
) -> dict[str, int]:
    """Bytes :class:`StatePool` allocates for these arguments, before allocating anything
    (the stage's memory-budget check): the pool laid out on the meta device, which takes no
    memory, so the count cannot drift from the allocation. Keys as :attr:`StatePool.nbytes`."""
    return StatePool(num_layers, max_rows, hv, dk, dv, conv_dim, conv_width, num_verify_tokens, dtype, "meta",
                     num_k_heads=hk, commit_design=commit_design, per_channel_gate=per_channel_gate).nbytes
