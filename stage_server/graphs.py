"""CUDA graphs for a stage's decode and verify forward.

A decode or verify step of a 1B model launches some 500 small kernels; issued one by one
from Python the step takes tens of milliseconds while the device needs about one
(docs/PERFORMANCE.md). A CUDA graph records the launches once and replays them with one
call. Graphs need fixed shapes and fixed addresses, so each padded batch size ``b`` (see
:func:`capture_sizes`) gets its own graph over static buffers: ``req_pool_indices``,
``seq_lens``, KV lengths, positions and KV slots (int64), and the input token ids (first
stage) or hidden states (later stages). A step of ``B <= b`` requests fills the first
``B`` entries; the other ``b - B`` are padding: the pool's padding row (``max_rows``),
zero cached tokens, KV slots in the KV pool's padding page. Every layer works per row or
per token, so padding computes garbage only in rows and pages no request owns.

The kernels' own checks run while a graph is captured, not when it replays. Replays are
safe because the stage has validated the step on the host first (``StageRunner.check_input``,
the rows' state, KV pages reserved) and fills the buffers itself.

Where CUDA is absent (``capture=False``) the same static, padded path runs eagerly: that is
how the CPU tests check the padding against the unpadded path.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ppspec.kernels.checks import known

from .model import BatchMeta

log = logging.getLogger("ppspec.stage")


def capture_sizes(max_bs: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, then every multiple of 8 up to
    ``max_bs`` (and ``max_bs`` itself), as vLLM and SGLang pad. A batch runs in the
    smallest size that holds it, wasting at most 7 rows."""
    sizes = {s for s in (1, 2, 4) if s < max_bs} | set(range(8, max_bs, 8)) | {max_bs}
    return sorted(sizes)


class StepGraphs:
    """Graphs of one step kind (decode, ``D = 1``, or verify, ``D`` tokens per request) for
    every padded batch size up to ``max_bs``.

    Args:
        forward: ``forward(meta, x) -> [b * D, hidden]`` the stage's layers; ``x`` is
            ``[b * D]`` int64 token ids on the first stage, else ``[b * D, hidden]`` in
            ``dtype``. Called with static buffers while capturing.
        mode: ``"decode"`` or ``"verify"``; tokens_per_request: ``D``.
        pad_row: the pools' padding row (``max_rows``).
        kv: the stage's ``KVPool`` (None without attention layers); its padding page takes
            the padding tokens' KV and its page table's padding row points there.
        max_context: longest KV length (tokens) a step may reach, a bound the kernels'
            checks read while capturing.
        capture: record CUDA graphs (False: run the padded path eagerly).
        pool: CUDA graph memory pool shared with other ``StepGraphs`` (captures run from
            the largest batch down, so smaller graphs reuse the larger ones' memory).
    """

    def __init__(self, forward: Callable, *, mode: str, tokens_per_request: int, max_bs: int, pad_row: int,
                 kv, first: bool, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_context: int, capture: bool, pool=None):
        self.forward, self.mode, self.D = forward, mode, tokens_per_request
        self.sizes = capture_sizes(max_bs)
        self.max_bs, self.pad_row, self.kv, self.first = max_bs, pad_row, kv, first
        D, n = tokens_per_request, max_bs
        self.max_context, self.capture, self.pool = max_context, capture, pool
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        # inference tensors: no version counter, so the facts stated about them (below)
        # survive the copies that fill them
        with torch.inference_mode():
            # one int64 buffer, so a step's indices cross to the device in one copy; a bucket
            # of b requests uses [rows b | seq_lens b | kv_lens b | positions bD | slots bD | ids bD]
            self.ints = torch.zeros(3 * n + 3 * n * D, dtype=torch.long, device=device)
            self.hidden = None if first else torch.zeros(n * D, hidden_size, dtype=dtype, device=device)
            self.ext = torch.full((n,), D, dtype=torch.long, device=device)
            self.cu = torch.arange(n + 1, dtype=torch.long, device=device) * D
            self.views = {b: self._views(b) for b in self.sizes}
            self.metas = {b: self._meta(b) for b in self.sizes}
            for b in reversed(self.sizes):
                self._fill(b, [], [])
                if capture:
                    self._capture(b)
        if capture:
            log.info("captured %d CUDA graphs for %s (batch sizes %s) in %.1f s",
                     len(self.sizes), mode, self.sizes, time.perf_counter() - t0)

    # ------------------------------------------------------------------ buffers
    def _views(self, b: int):
        D, x = self.D, self.ints
        o = [0, b, 2 * b, 3 * b, 3 * b + b * D, 3 * b + 2 * b * D, 3 * b + 3 * b * D]
        return [x[o[i]:o[i + 1]] for i in range(6)]

    def _meta(self, b: int) -> BatchMeta:
        rows, seq, kv_lens, positions, slots, _ = self.views[b]
        D, kv = self.D, self.kv
        # bounds the kernels' checks read while capturing (kernels.checks); they hold for
        # every step the stage admits, which is what a replay runs
        known(rows, min=0, max=self.pad_row)
        cu = known(self.cu[: b + 1], total=b * D, max_len=D, queries_fit=True)
        known(kv_lens, min=D, max=self.max_context)
        if kv is not None:
            known(slots, min=0, max=kv.k.shape[1] * kv.page_size - 1)
        return BatchMeta(self.mode, rows, seq, self.ext[:b], cu, positions, slots,
                         None if kv is None else kv.page_table, kv_lens, D)

    def _fill(self, b: int, rows: list[int], seq_lens: list[int], ids: list[int] | None = None) -> None:
        """Write a step of ``len(rows) <= b`` requests and its padding into bucket ``b``."""
        D, B = self.D, len(rows)
        pad = b - B
        rows = list(rows) + [self.pad_row] * pad
        seq_lens = list(seq_lens) + [0] * pad
        positions = [s + j for s in seq_lens for j in range(D)]
        kv = self.kv
        if kv is None:
            slots = [0] * (b * D)
        else:
            slots = kv.slot_list(rows[:B], positions[: B * D]) + [kv.pad_slot(j) for _ in range(pad) for j in range(D)]
        ids = list(ids or ()) + [0] * (b * D - len(ids or ()))
        host = torch.tensor(rows + seq_lens + [s + D for s in seq_lens] + positions + slots + ids, dtype=torch.long)
        self.ints[: host.numel()].copy_(host)

    def _capture(self, b: int) -> None:
        meta = self.metas[b]
        if self.kv is not None:
            known(self.kv.page_table, pages_in_pool=True)  # the pool hands out its own pages only
        x = self.views[b][5] if self.first else self.hidden[: b * self.D]
        # warm up outside the graph: Triton compiles and cuBLAS picks its kernels here
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self.forward(meta, x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.outputs[b] = self.forward(meta, x)
        self.pool = g.pool()
        self.graphs[b] = g

    # ------------------------------------------------------------------ run
    def bucket(self, batch_size: int) -> int | None:
        """The padded size a batch runs in, or None when it is larger than every graph."""
        for b in self.sizes:
            if b >= batch_size:
                return b
        return None

    def run(self, rows: list[int], seq_lens: list[int], ids: list[int] | None,
            hidden: torch.Tensor | None) -> tuple[BatchMeta, torch.Tensor]:
        """Run one step of ``B = len(rows)`` requests (at most ``max_bs``).

        ids: ``B * D`` token ids (first stage); hidden: ``[B * D, hidden]`` (later stages).
        Returns the step's layout (views of the static buffers, valid until the next run)
        and ``[B * D, hidden]`` output hidden states (a fresh tensor)."""
        B, D = len(rows), self.D
        b = self.bucket(B)
        self._fill(b, rows, seq_lens, ids if self.first else None)
        if not self.first:
            self.hidden[: B * D].copy_(hidden)
        if self.capture:
            self.graphs[b].replay()
            out = self.outputs[b]
        else:
            x = self.views[b][5] if self.first else self.hidden[: b * D]
            out = self.forward(self.metas[b], x)
        rows_t, seq, kv_lens, positions, slots, _ = self.views[b]
        meta = BatchMeta(self.mode, rows_t[:B], seq[:B], self.ext[:B], self.cu[: B + 1], positions[: B * D],
                         slots[: B * D], self.metas[b].page_table, kv_lens[:B], D)
        return meta, out[: B * D].clone()
