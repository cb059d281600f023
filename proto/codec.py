"""Map the stage messages (``messages.py`` dataclasses) to and from protobuf.

Tensors travel as raw bytes with dtype and shape: no per-element protobuf encoding.
"""
from __future__ import annotations

import array
import itertools
import sys

from .messages import Commit, Release, SamplingSpec, StageInfo, StepInput, StepOutput
from .stubs import pb

MAX_MESSAGE_BYTES = 1 << 30
"""gRPC send/receive limit (bytes) for stages and the router: hidden states of a large
micro-batch exceed gRPC's 4 MiB default."""

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Channels to stages: after a stage restarts, reconnect within a second. gRPC's default
# backoff grows to 120 s, and a call made while the channel waits out its backoff fails at
# once (UNAVAILABLE), although the stage is back.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def tensor_to_pb(t) -> "pb.Tensor":
    """A torch tensor (any device / dtype) as ``pb.Tensor`` (raw bytes, C order)."""
    import torch

    c = t.detach().contiguous().cpu()
    raw = c.view(torch.uint8) if c.element_size() != 1 and c.numel() else c
    return pb.Tensor(data=raw.numpy().tobytes(), dtype=str(c.dtype).removeprefix("torch."), shape=list(c.shape))


def tensor_from_pb(m: "pb.Tensor"):
    """``pb.Tensor`` back to a CPU torch tensor.

    Raises:
        ValueError: an unknown or undecodable dtype, a negative dimension, or a byte count
        that does not match dtype and shape.
    """
    import torch

    dtype = getattr(torch, m.dtype, None) if m.dtype else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {m.dtype!r}")
    shape = tuple(m.shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"tensor shape {list(shape)} has a negative dimension")
    n = 1
    for s in shape:
        n *= s
    itemsize = dtype.itemsize
    if len(m.data) != n * itemsize:
        raise ValueError(f"tensor of shape {list(shape)} {m.dtype} needs {n * itemsize} bytes, got {len(m.data)}")
    try:
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(m.data), dtype=torch.uint8).view(dtype).reshape(shape)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        raise ValueError(f"tensor of dtype {m.dtype!r} cannot be decoded ({e})") from None


def _pack_ids(ids: list[int]) -> bytes:
    """Token ids as little-endian int32 bytes (``SamplingSpec``'s ``*_le32`` fields)."""
    a = array.array("i", ids)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def _unpack_ids(data: bytes, name: str) -> list[int]:
    """:func:`_pack_ids`' inverse. Raises ValueError naming ``name`` when ``data`` is not whole ids."""
    if len(data) % 4:
        raise ValueError(f"sampling: {name} holds {len(data)} bytes, not a whole number of 4-byte ids")
    a = array.array("i")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def _spec_to_pb(x: SamplingSpec) -> "pb.SamplingSpec":
    return pb.SamplingSpec(
        temperature=x.temperature, top_p=x.top_p, top_k=x.top_k, min_p=x.min_p, seed=x.seed,
        logprobs=-1 if x.logprobs is None else x.logprobs, min_tokens=x.min_tokens,
        banned_until_min=x.banned_until_min, presence_penalty=x.presence_penalty,
        frequency_penalty=x.frequency_penalty,
        **({} if x.repetition_penalty == 1.0 else {"repetition_penalty": x.repetition_penalty}),
        output_token_ids=x.output_token_ids, output_token_counts=x.output_token_counts,
        prompt_token_ids_le32=_pack_ids(x.prompt_token_ids), logit_bias_ids=x.logit_bias_ids,
        logit_bias_values=x.logit_bias_values, grammar=x.grammar,
        grammar_accepted_ids=x.grammar_accepted_ids,
        **({} if x.prompt_logprobs is None else {"prompt_logprobs": x.prompt_logprobs}),
        allowed_token_ids_le32=_pack_ids(x.allowed_token_ids), bad_word_ids=x.bad_word_ids,
        bad_word_lens=x.bad_word_lens,
        recent_output_ids=x.recent_output_ids,
    )


def _spec_from_pb(x: "pb.SamplingSpec") -> SamplingSpec:
    return SamplingSpec(
        # an unset field is the default, not proto3's zero (top_p 0 would be refused,
        # logprobs 0 would ask for the sampled token's logprob)
        x.temperature, x.top_p if x.HasField("top_p") else 1.0, x.top_k, x.min_p, x.seed,
        x.logprobs if x.HasField("logprobs") and x.logprobs >= 0 else None,
        x.min_tokens, list(x.banned_until_min), x.presence_penalty, x.frequency_penalty,
        x.repetition_penalty if x.HasField("repetition_penalty") else 1.0,
        list(x.output_token_ids), list(x.output_token_counts),
        _unpack_ids(x.prompt_token_ids_le32, "prompt_token_ids"),
        list(x.logit_bias_ids), list(x.logit_bias_values), x.grammar, list(x.grammar_accepted_ids),
        x.prompt_logprobs if x.HasField("prompt_logprobs") else None,
        _unpack_ids(x.allowed_token_ids_le32, "allowed_token_ids"), list(x.bad_word_ids), list(x.bad_word_lens),
        list(x.recent_output_ids),
    )


class SpecMemo:
    """Each row's last sampling spec beside its protobuf form, so that a step encodes (the
    router) or decodes (a stage) only the specs that changed since the row's last step.

    A request's ``SamplingSpec`` is the same from one round to the next (its sampling
    parameters; the per-round parts, with penalties, bad words, a grammar or prompt
    logprobs, make a new one), while converting one costs ~5 us each way: per request
    and round the largest part of a step's encode and decode at batch 32
    (docs/PERFORMANCE.md, "CPU: served against in process", "The host's CPU per round
    at concurrency 64"). Encoding reuses a row's message while the spec is the same object
    (the scheduler's ``Request.spec`` is never changed once built); decoding reuses a row's
    spec while its message's bytes are the same, and the stage treats specs as read-only.
    At most ``max_rows`` rows are kept (a malformed step's rows cannot grow it without bound).
    """

    def __init__(self, max_rows: int = 1 << 16):
        self.max_rows = max_rows
        self._encoded: dict[int, tuple[SamplingSpec, "pb.SamplingSpec"]] = {}
        self._decoded: dict[int, tuple[bytes, SamplingSpec]] = {}

    def encode(self, rows: list[int], specs: list[SamplingSpec]) -> list["pb.SamplingSpec"]:
        if len(rows) != len(specs):
            return [_spec_to_pb(x) for x in specs]
        out, memo = [], self._encoded
        for row, x in zip(rows, specs):
            hit = memo.get(row)
            if hit is None or hit[0] is not x:
                hit = memo[row] = (x, _spec_to_pb(x))
            out.append(hit[1])
        if len(memo) > self.max_rows:
            memo.clear()
        return out

    def decode(self, rows, msgs) -> list[SamplingSpec]:
        if len(rows) != len(msgs):
            return [_spec_from_pb(x) for x in msgs]
        out, memo = [], self._decoded
        for row, x in zip(rows, msgs):
            key = x.SerializeToString()
            hit = memo.get(row)
            if hit is None or hit[0] != key:
                hit = memo[row] = (key, _spec_from_pb(x))
            out.append(hit[1])
        if len(memo) > self.max_rows:
            memo.clear()
        return out


def step_to_pb(s: StepInput, specs: SpecMemo | None = None) -> "pb.StepRequest":
    """``specs``: the sender's memo of encoded sampling specs (None: encode every one)."""
    m = pb.StepRequest(
        micro_batch_id=s.micro_batch_id, round=s.round, mode=s.mode, num_prefill=s.num_prefill,
        follows_round=s.follows_round, req_pool_indices=s.req_pool_indices, seq_lens=s.seq_lens,
        extend_lens=s.extend_lens,
        input_ids=s.input_ids, num_drafts=s.num_drafts, sample=s.sample, next_token_ids=s.next_token_ids,
        output_lens=s.output_lens, restore_slots=s.restore_slots, snapshot_slots=s.snapshot_slots,
        sampling=(specs.encode(s.req_pool_indices, s.sampling) if specs is not None
                  else [_spec_to_pb(x) for x in s.sampling]),
    )
    if s.hidden_states is not None:
        m.hidden_states.CopyFrom(tensor_to_pb(s.hidden_states))
    return m


def step_from_pb(m: "pb.StepRequest", specs: SpecMemo | None = None) -> StepInput:
    """Raises ValueError (naming hidden_states) when the hidden states cannot be decoded.
    ``specs``: the receiver's memo of decoded sampling specs (None: decode every one)."""
    rows = list(m.req_pool_indices)
    return StepInput(
        micro_batch_id=m.micro_batch_id, round=m.round, mode=m.mode, num_prefill=m.num_prefill,
        follows_round=m.follows_round, req_pool_indices=rows, seq_lens=list(m.seq_lens),
        extend_lens=list(m.extend_lens),
        input_ids=list(m.input_ids), num_drafts=list(m.num_drafts), sample=list(m.sample),
        next_token_ids=list(m.next_token_ids), output_lens=list(m.output_lens),
        sampling=specs.decode(rows, m.sampling) if specs is not None else [_spec_from_pb(x) for x in m.sampling],
        hidden_states=_hidden_from_pb(m),
        restore_slots=list(m.restore_slots), snapshot_slots=list(m.snapshot_slots),
    )


def _hidden_from_pb(m: "pb.StepRequest"):
    if not m.HasField("hidden_states"):
        return None
    try:
        return tensor_from_pb(m.hidden_states)
    except ValueError as e:
        raise ValueError(f"hidden_states: {e}") from None


def result_to_pb(o: StepOutput) -> "pb.StepResult":
    m = pb.StepResult(micro_batch_id=o.micro_batch_id, round=o.round,
                      stage_seconds=o.stage_seconds or [o.compute_seconds], has_logprobs=o.logprobs is not None,
                      commit_seconds=o.commit_seconds)
    m.output_flat.extend(itertools.chain.from_iterable(o.output_ids))
    m.output_lens.extend(map(len, o.output_ids))
    if any(o.drafts):  # drafts all empty: none sent (an empty list means no drafts, StepOutput.drafts)
        m.draft_flat.extend(itertools.chain.from_iterable(o.drafts))
        m.draft_lens.extend(map(len, o.drafts))
    for lps, target in ((o.logprobs, m.logprobs), (o.prompt_logprobs, m.prompt_logprobs)):
        for lp in lps or []:
            item = pb.LogprobList(present=lp is not None)
            for tok, val, top, *rank in lp or []:  # prompt logprobs carry a rank
                item.items.append(pb.TokenLogprob(token=tok, logprob=val, top_ids=[i for i, _ in top],
                                                  top_logprobs=[v for _, v in top], rank=rank[0] if rank else 0))
            target.append(item)
    return m


def _logprob_lists(items) -> list:
    return [[(x.token, x.logprob, list(zip(x.top_ids, x.top_logprobs)), *((x.rank,) if x.rank else ()))
             for x in lp.items] if lp.present else None for lp in items]


def _split(flat, lens) -> list[list[int]]:
    """``flat`` cut into consecutive lists of ``lens`` ids each."""
    flat, out, i = list(flat), [], 0
    for n in lens:
        out.append(flat[i: i + n])
        i += n
    return out


def result_tokens(m: "pb.StepResult") -> tuple[list[list[int]], list[list[int]]]:
    """A result's per-request output ids and MTP drafts (``[]``: no request has drafts)."""
    return _split(m.output_flat, m.output_lens), _split(m.draft_flat, m.draft_lens)


def result_from_pb(m: "pb.StepResult") -> StepOutput:
    output_ids, drafts = result_tokens(m)
    return StepOutput(
        micro_batch_id=m.micro_batch_id, round=m.round, output_ids=output_ids, drafts=drafts,
        logprobs=_logprob_lists(m.logprobs) if m.has_logprobs else None,
        prompt_logprobs=_logprob_lists(m.prompt_logprobs) if m.prompt_logprobs else None,
        stage_seconds=list(m.stage_seconds), commit_seconds=list(m.commit_seconds),
    )


def commit_to_pb(c: Commit, router_id: str = "") -> "pb.CommitRequest":
    return pb.CommitRequest(micro_batch_id=c.micro_batch_id, round=c.round, req_pool_indices=c.req_pool_indices,
                            accept_lengths=c.accept_lengths, router_id=router_id)


def commit_from_pb(m: "pb.CommitRequest") -> Commit:
    return Commit(m.micro_batch_id, m.round, list(m.req_pool_indices), list(m.accept_lengths))


def release_to_pb(r: Release, router_id: str = "") -> "pb.ReleaseRequest":
    m = pb.ReleaseRequest(req_pool_indices=r.req_pool_indices, micro_batch_id=r.micro_batch_id, round=r.round,
                          abandon=r.abandon, router_id=router_id, snapshot_slots=r.snapshot_slots,
                          drop_slots=r.drop_slots)
    if r.commit is not None:
        m.commit.CopyFrom(commit_to_pb(r.commit, router_id))
    return m


def release_from_pb(m: "pb.ReleaseRequest") -> Release:
    return Release(list(m.req_pool_indices), m.micro_batch_id, m.round, m.abandon, list(m.snapshot_slots),
                   list(m.drop_slots), commit_from_pb(m.commit) if m.HasField("commit") else None)


_INFO_SCALARS = ("pp_rank", "pp_size", "layer_start", "layer_end", "num_layers", "max_rows", "rows_in_use",
                 "kv_tokens", "kv_pages_used", "kv_pages_total", "max_context", "num_speculative_steps", "has_mtp",
                 "vocab_size", "busy_seconds", "pending_commits", "commit_design", "prefill_attention",
                 "instance_id", "next_instance_id", "owner_router_id", "not_serving", "replaced", "warmup_seconds",
                 "transport", "transport_detail", "snapshot_slots", "snapshots_in_use", "device_type",
                 "device_uuid", "control_socket", "host_id", "control", "control_detail", "inline_jobs")


def info_to_pb(i: StageInfo) -> "pb.InfoReply":
    m = pb.InfoReply(**{k: i[k] for k in _INFO_SCALARS if k in i})
    m.eos_token_ids.extend(i.get("eos_token_ids", []))
    m.memory_bytes.update(i.get("memory_bytes", {}))
    m.forwards.update(i.get("forwards", {}))
    m.routers.extend(pb.RouterSeen(router_id=r, idle_seconds=t) for r, t in i.get("routers", {}).items())
    return m


def info_from_pb(m: "pb.InfoReply") -> StageInfo:
    i: StageInfo = {k: getattr(m, k) for k in _INFO_SCALARS}
    i["eos_token_ids"] = list(m.eos_token_ids)
    i["memory_bytes"] = dict(m.memory_bytes)
    i["forwards"] = dict(m.forwards)
    i["routers"] = {x.router_id: x.idle_seconds for x in m.routers}
    return i
