"""MTP drafting on the last stage: the checkpoint's multi-token-prediction head extended
over a step's committed positions, then ``num_steps`` greedy drafts chained from the last
one (docs/DESIGN.md, "State layout": the head keeps its own KV at the row)."""
from __future__ import annotations

import itertools
from typing import Callable, NamedTuple

import torch

from ppspec.kernels.checks import known
from ppspec.proto.messages import DECODE, PREFILL, StepInput

from .batch import BatchMeta
from .pools import KVPool, device_int64


class ChainIndex(NamedTuple):
    """Index constants of :meth:`MTPDrafter.chain`, made once before the graphs are
    captured: inside a graph every ``torch.arange`` / ``torch.ones`` is a kernel launched
    at each replay. ``iota`` ``[n]`` = 0..n-1 and ``ones`` ``[n]`` int64, with ``n`` above
    any batch size and chain length; ``last_before[D]`` ``[n]`` = ``b * D - 1``, so request
    b's token ``a`` (1-based) of D sits at row ``last_before[D][b] + a``."""

    iota: torch.Tensor
    ones: torch.Tensor
    last_before: dict[int, torch.Tensor]


class MTPDrafter:
    """The MTP head's drafting for one stage.

    Args:
        model: the stage model (``mtp``, ``mtp_logits``, ``embed``).
        mtp_kv: the head's KV pool (one layer, room for its draft chain).
        num_steps: drafts per round.
        device: the stage's device.
        layout: ``layout(mode, rows, seq_lens, extend_lens, kv) -> BatchMeta`` (the stage's
            ``_meta``), the layout of a step over ``kv``.
        graphs: mode -> the captured graphs of :meth:`chain` (``StageRunner``; filled as
            they are captured). ``index``: the :class:`ChainIndex` of the captured chain.
        grammars: the stage's grammar matchers (``stage_server.grammar.GrammarRows``), whose
            constrained rows' drafts follow their grammar.
    """

    def __init__(self, model, mtp_kv: KVPool, num_steps: int, device: torch.device,
                 layout: Callable[..., BatchMeta], graphs: dict, grammars):
        self.model, self.mtp_kv, self.num_steps, self.device = model, mtp_kv, num_steps, device
        self.layout, self.graphs, self.grammars = layout, graphs, grammars
        self.index: ChainIndex | None = None

    def draft(self, inp: StepInput, meta: BatchMeta, hidden: torch.Tensor, emitted: list[list[int]]) -> list[list[int]]:
        """Extend the MTP head over this step's committed positions, then chain drafts.

        For position p the head takes ``(x[p+1], h_p)``. Prefill: every chunk position, the
        last one conditioned on the sampled token (or the next chunk's first token).
        Verify / decode: the ``a`` accepted positions, conditioned on the emitted tokens.
        The head's KV at positions past the accepted ones is overwritten next round.
        Constrained requests' drafts follow their grammar (``GrammarRows.draft_mask``).
        """
        B = meta.batch_size
        cu = [0, *itertools.accumulate(inp.extend_lens)]
        ids = inp.input_ids
        wants = [bool(emitted[b]) for b in range(B)]
        rows, seq_lens = list(inp.req_pool_indices), list(inp.seq_lens)
        grammar = self.grammars.draft_mask(rows, wants) if self.grammars is not None and self.num_steps else None
        chain = self.graphs.get(DECODE)
        if (inp.mode == PREFILL and self.num_steps and chain is not None and chain.bucket(B) is not None
                and grammar is None):
            # the head over all but each chunk's last position fills the head's KV here;
            # the last position and the draft chain from it are the decode chain's graph
            # (the head at one position per request, then its steps): one replay instead of
            # num_steps eager forwards
            ext = [e - 1 for e in inp.extend_lens]
            if any(ext):
                sub = [b for b in range(B) if ext[b] > 0]
                tok = [t for b in sub for t in ids[cu[b] + 1: cu[b + 1]]]
                sel = [i for b in sub for i in range(cu[b], cu[b + 1] - 1)]
                mmeta = self.layout(PREFILL, [rows[b] for b in sub], [seq_lens[b] for b in sub], [ext[b] for b in sub],
                                   self.mtp_kv)
                self.model.mtp(self.model.embed(device_int64(tok, self.device)),
                               hidden[device_int64(sel, self.device)], mmeta, self.mtp_kv.layer(0))
            nxt = [emitted[b][0] if emitted[b] else inp.next_token_ids[b] for b in range(B)]
            last = hidden[device_int64([c - 1 for c in cu[1:]], self.device)]
            # the chain writes the head's KV at each chunk's last position; its drafts are read
            # only where a request sampled (a chunk inside its prompt reads nothing)
            drafts = chain.run(rows, [s + e for s, e in zip(seq_lens, ext)], nxt, last, [1] * B)[1]
            if not any(wants):
                return [[] for _ in range(B)]
            return [dr if w else [] for dr, w in zip(drafts.tolist(), wants)]
        tok, sel, ext = [], [], []
        for b in range(B):
            if inp.mode == PREFILL:
                nxt = emitted[b][0] if emitted[b] else inp.next_token_ids[b]
                chunk = ids[cu[b] + 1 : cu[b + 1]] + [nxt]
                idx = list(range(cu[b], cu[b + 1]))
            else:
                a = len(emitted[b])
                chunk = emitted[b]
                idx = list(range(cu[b], cu[b] + a))
            tok += chunk
            sel += idx
            ext.append(len(chunk))
        mmeta = self.layout(PREFILL, rows, seq_lens, ext, self.mtp_kv)
        mtp = self.model.mtp
        kv = self.mtp_kv.layer(0)
        u = mtp(self.model.embed(device_int64(tok, self.device)), hidden[device_int64(sel, self.device)], mmeta, kv)
        if not any(wants) or self.num_steps == 0:
            return [[] for _ in range(B)]
        ends = mmeta.cu_seqlens[1:] - 1
        u = u[ends]  # [B, hidden]: the head's output at each request's last position
        pos = [s + e for s, e in zip(seq_lens, ext)]
        chain = []
        try:
            for step in range(self.num_steps):
                logits = self.model.mtp_logits(u, upcast=False)
                d = (logits if grammar is None else grammar.apply(logits)).argmax(-1)  # [B]
                chain.append(d)
                if step == self.num_steps - 1:
                    break
                if grammar is not None:  # a host read per step, for constrained micro-batches only
                    grammar.accept(d.tolist())
                cmeta = self.layout(DECODE, rows, [p + step for p in pos], [1] * B, self.mtp_kv)
                u = mtp(self.model.embed(d), u, cmeta, kv)
        finally:
            if grammar is not None:
                grammar.rollback()
        drafts = torch.stack(chain, 1).tolist()  # one device read for the whole chain
        return [dr if w else [] for dr, w in zip(drafts, wants)]

    def chain(self, meta: BatchMeta, ids: torch.Tensor, hidden: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """MTP drafting after a decode or verify, on the device alone (CUDA-graph capturable).

        The head runs over all ``D`` positions of each request, position ``seq + j``
        conditioned on emitted token ``ids[b * D + j]`` and the target's ``hidden``;
        ``accepted`` ``[B]`` says how many are real (1..D). Positions past them write MTP
        KV that the chain below and the next round overwrite before anything reads it
        (attention is causal). Then ``num_steps`` greedy drafts chain from the last real
        position. Returns ``[B, num_steps]`` int64 drafts. Same tokens as :meth:`draft`.

        The index work of every chain step is done up front, in a fixed number of ops
        (``self.index`` holds the constants, made by ``StageRunner._capture_graphs``).
        """
        mtp, kv, pool, c = self.model.mtp, self.mtp_kv.layer(0), self.mtp_kv, self.index
        B, D, S = meta.batch_size, meta.tokens_per_request, self.num_steps - 1
        u = mtp(self.model.embed(ids), hidden, meta, kv)
        u = u[c.last_before[D][:B] + accepted]  # each request's last emitted token
        drafts = [self.model.mtp_logits(u, upcast=False).argmax(-1)]
        if S:
            # chain step s writes position seq + accepted + s: [S, B], so that each step's
            # positions and kv_lens are a contiguous row, as the kernels read them
            pos = (meta.seq_lens + accepted) + c.iota[:S, None]
            slots = pool.slots(meta.rows, pos)  # the rows broadcast over the steps
            kv_lens = pos + 1
            ones = c.ones[:B]
            cu = known(c.iota[: B + 1], total=B, max_len=1, queries_fit=True)
            # bounds hold for every admitted step: pages for these positions were reserved
            max_slot, max_len = pool.k.shape[1] * pool.page_size - 1, pool.max_pages_per_row * pool.page_size
            for s in range(S):
                cmeta = BatchMeta(DECODE, meta.rows, pos[s], ones, cu, pos[s], known(slots[s], min=0, max=max_slot),
                                  pool.page_table, known(kv_lens[s], min=1, max=max_len), 1)
                u = mtp(self.model.embed(drafts[-1]), u, cmeta, kv)
                drafts.append(self.model.mtp_logits(u, upcast=False).argmax(-1))
        return torch.stack(drafts, 1)
