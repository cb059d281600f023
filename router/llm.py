"""Single-process Python API: generate with or without speculation, no gRPC.

    from ppspec import LLM, SamplingParams
    llm = LLM("models/qwen35-demo", speculative_algorithm="mtp")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

``LLM`` is the router's engine (``router.engine.Engine``, the one that serves HTTP) over
an in-process pipeline of stage runners: the same lanes form micro-batches, send them,
apply results and send the commits, so what runs here is what serves. Each call runs the
engine's event loop until it is done; the stages compute on that loop's thread. With
``num_micro_batches > 1`` lanes interleave micro-batches as a real pipeline does, so the
stable-row commit is exercised in one process too.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import logging
import numbers
import threading
import sys
from dataclasses import dataclass, field

from ppspec.argtypes import DEMO_MODEL, add_cuda_graph_args, cuda_graph_max_bs, device_list, positive_int

from .detokenize import TextStream
from .engine import Engine
from .pipeline import InProcessPipeline
from .scheduler import Scheduler
from .types import RequestOutput, SamplingParams, StageDownError, bad_words_token_ids

__all__ = ["DEMO_MODEL", "LLM", "Completion"]


@dataclass
class Completion:
    """A finished request: its token ids, finish reason and, with speculation, the
    accept length of every verify round it took part in. With stop strings, ``token_ids``
    end with the token that completed the stop string and ``text`` is cut before it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    accept_lengths: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    text: str | None = None
    stop_reason: str | None = None  # the stop string that ended it (finish_reason "stop")
    prompt_logprobs: list | None = None  # with SamplingParams.prompt_logprobs: one TokenLogprob per prompt token after the first


class _Inbox:
    """A request's stream for :meth:`Engine.submit`: its outputs (or the error that ended
    it) go to the LLM's one list, tagged with the request id, and wake the driver."""

    __slots__ = ("request_id", "items", "wake")

    def __init__(self, request_id: str, items: list, wake: asyncio.Event):
        self.request_id, self.items, self.wake = request_id, items, wake

    def put_nowait(self, item) -> None:
        self.items.append((self.request_id, item))
        self.wake.set()


class LLM:
    """In-process engine over ``pp_size`` stage runners: the router's ``Engine`` (the one
    that serves HTTP) over an in-process pipeline, driven from an event loop of its own,
    one ``run_until_complete`` per call.

    Args:
        model: checkpoint folder (default: the bundled demo model).
        pp_size: stages (layer slices) chained in this process.
        speculative_algorithm: ``none``, ``ngram`` or ``mtp``; num_speculative_steps drafts per round.
        num_micro_batches: lanes in flight (default pp_size).
        max_rows, kv_tokens, max_batch_size: pool rows, KV budget (tokens), requests per
            micro-batch.
        max_num_batched_tokens: tokens per micro-batch, decodes first and prefill chunks in
            the rest of the same forward (``Scheduler``); None: 8192 on CUDA, 512 on CPU.
        mixed_prefill_tokens: prefill tokens of a micro-batch that also decodes; None: 512
            on CUDA, 128 on CPU (``scheduler.DEFAULT_MIXED_PREFILL_TOKENS``).
        chunk_size: prompt tokens of one request per micro-batch at most (None: the budget).
        commit_design: ``"copy"``, ``"replay"`` or None (replay on CUDA, copy on CPU): how
            every stage commits accepted GDN state (``StageRunner``).
        fault: fault injection for tests (``stage_server.runner.FAULTS``).
        drafter: ``f(request, k) -> drafts`` replacing the n-gram lookup (tests, custom drafters).
        cuda_graph_max_bs: decode / verify batches up to this size replay CUDA graphs; 0
            runs eagerly; None: ``min(max_rows, 256)`` on CUDA, off on CPU (``StageRunner``).
        device: one device for every stage (``"cuda"``: the current GPU), or a
            comma-separated device per stage (``"cuda:0,cuda:1"``).
        enable_prefix_caching: reuse the state of cached prefixes (``router.prefix_cache``),
            with snapshots of the recurrent state in ``prefix_cache_gb`` GiB per stage.
    """

    def __init__(
        self,
        model: str = DEMO_MODEL,
        *,
        pp_size: int = 1,
        speculative_algorithm: str = "none",
        num_speculative_steps: int = 3,
        num_micro_batches: int | None = None,
        max_rows: int = 64,
        kv_tokens: int = 65536,
        chunk_size: int | None = None,
        max_batch_size: int = 64,
        max_num_batched_tokens: int | None = None,
        mixed_prefill_tokens: int | None = None,
        max_context: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        fault: str | None = None,
        commit_design: str | None = None,
        pipeline: InProcessPipeline | None = None,
        drafter=None,
        cuda_graph_max_bs: int | None = None,
        enable_prefix_caching: bool = False,
        prefix_cache_gb: float = 0.25,
    ):
        import torch

        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        try:
            device_list(str(device))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"device: {e}") from None
        if speculative_algorithm != "none" and num_speculative_steps < 1:
            raise ValueError(f"speculative_algorithm {speculative_algorithm} needs num_speculative_steps >= 1")
        for name, v in (("max_rows", max_rows), ("max_batch_size", max_batch_size),
                        ("chunk_size", 1 if chunk_size is None else chunk_size),
                        ("max_num_batched_tokens", 1 if max_num_batched_tokens is None else max_num_batched_tokens),
                        ("mixed_prefill_tokens", 1 if mixed_prefill_tokens is None else mixed_prefill_tokens),
                        ("pp_size", pp_size), ("num_micro_batches", 1 if num_micro_batches is None else num_micro_batches)):
            if v < 1:  # before any stage is built
                raise ValueError(f"{name} must be >= 1, got {v}")
        steps = num_speculative_steps if speculative_algorithm != "none" else 0
        self.pipeline = pipeline or InProcessPipeline.build(
            model, pp_size, max_rows=max_rows, kv_tokens=kv_tokens, num_speculative_steps=steps,
            use_mtp=speculative_algorithm == "mtp", max_context=max_context,
            dtype=getattr(torch, dtype), device=device, fault=fault, commit_design=commit_design,
            cuda_graph_max_bs=cuda_graph_max_bs, prefix_cache_gb=prefix_cache_gb if enable_prefix_caching else 0.0,
            mixed_graph_tokens=mixed_prefill_tokens,  # the chunks beside decodes: their graphs
        )
        self.pipeline.inline = True  # this loop serves nothing else: compute on its thread
        self.model_dir = model
        self._inbox: list[tuple[str, object]] = []  # (request id, output or error) from the engine
        self._wake = asyncio.Event()
        self.engine = Engine(
            self.pipeline, model_name=model, tokenizer=None, speculative_algorithm=speculative_algorithm,
            num_micro_batches=num_micro_batches or len(self.pipeline.runners), max_batch_size=max_batch_size,
            max_num_batched_tokens=max_num_batched_tokens, mixed_prefill_tokens=mixed_prefill_tokens,
            chunk_size=chunk_size, max_waiting=sys.maxsize, enable_prefix_caching=enable_prefix_caching,
            drafter=drafter, on_round=self._wake.set,
            # each lane's next round after its last one's result: step() is one round of
            # every lane, and on the loop's thread nothing could overlap a round anyway
            async_scheduling=False,
        )
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self.engine.start())
        except BaseException:
            self._loop.close()
            raise
        last = self.engine.stage_infos[-1]
        self.vocab_size, self.eos_token_ids = last["vocab_size"], last["eos_token_ids"]
        self.max_context = self.engine.max_model_len  # the KV pool may hold less than the stages' context
        self._ids = itertools.count()
        self.completions: dict[str, Completion] = {}
        self._streams: dict[str, TextStream] = {}  # requests of generate() with stop strings: their text
        self._lock = threading.RLock()  # calls from several threads run one after another

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    # ---- the event loop: one run per call
    def _run(self, coro):
        """Run ``coro`` on this LLM's loop, the engine's tasks with it. Whatever cuts the
        loop from outside the call (Ctrl-C, a KeyboardInterrupt out of a stage) ends every
        request in flight and releases every row on every stage before it propagates; a
        second one during that clean-up leaves the rest to the next call."""
        with self._lock:
            task = self._loop.create_task(coro)
            try:
                return self._loop.run_until_complete(task)
            except BaseException as e:
                if isinstance(e, Exception) and task.done():
                    raise  # the call's own error: the engine is consistent
                task.cancel()
                # before the loop runs again: a task woken by the interrupt must not go on
                self.engine.interrupted(f"interrupted: {type(e).__name__}")
                self._loop.run_until_complete(self._after_interrupt(task))
                raise

    async def _after_interrupt(self, task: asyncio.Task) -> None:
        try:
            await task  # its clean-up (generate: its requests end)
        except (asyncio.CancelledError, Exception):
            pass
        self._take()  # the ended requests' completions: finish reason abort
        await self._ready()

    async def _ready(self) -> None:
        """Recovered from a failure (every row released on every stage) before going on."""
        if self.engine.failure is not None:
            self.engine.interrupted(self.engine.failure)  # restarts tasks an interrupt ended
            await self.engine.recover()
            if self.engine.failure is not None:
                raise StageDownError(self.engine.failure)

    # ---- step-level API: requests join and leave between steps
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request. Raises ValueError / TypeError (nothing queued) for token ids that
        are not ints in ``[0, vocab_size)`` and for parameters the scheduler refuses."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.scheduler.max_logprobs, self.vocab_size)  # before its lists are read below
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        for name, ids in (("prompt", prompt_ids), ("stop_token_ids", params.stop_token_ids),
                          ("bad_words", [t for w in params.bad_words_token_ids or () for t in w]),
                          ("logit_bias", list(params.logit_bias or {}))):
            # any integer type (numpy's and torch's included), never a bool or a float
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name}: token ids must be ints in [0, {self.vocab_size}), got {bad[:4]}")
        prompt_ids = [int(t) for t in prompt_ids]
        rid = request_id or f"req-{next(self._ids)}"
        with self._lock:
            self.engine.submit(rid, prompt_ids, params, _Inbox(rid, self._inbox, self._wake))
            self.completions[rid] = Completion(rid, list(prompt_ids))
        return rid

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request (``reason``: its finish reason, ``abort`` or ``stop``) and release its
        rows on every stage."""
        self._run(self._abort(request_id, reason))

    async def _abort(self, request_id: str, reason: str) -> None:
        await self.engine.abort(request_id, reason)
        await self.engine.settle()
        self._take()
        c = self.completions.get(request_id)
        if c is not None and c.finish_reason is None and request_id not in self.scheduler.requests:
            c.finish_reason = reason

    def has_unfinished(self) -> bool:
        """Requests queued or running, or rows of finished ones not yet released (also
        after an interrupt, until the recovery has released every row)."""
        return self.scheduler.has_work() or not self.engine.settled() or self.engine.failure is not None

    def step(self) -> list[RequestOutput]:
        """One round of every lane: each lane with work sends one micro-batch (all of them
        before any commit, as the lanes of a served pipeline interleave), until they are
        back and committed; with no request left, until every row is released. Returns the
        outputs the round brought.

        A stage refusing a micro-batch ends that micro-batch's requests (finish reason
        ``abort``) and raises a ValueError here; the engine stays usable."""
        return self._run(self._step())

    async def _step(self) -> list[RequestOutput]:
        await self._ready()
        if self.scheduler.has_work():
            self._wake.clear()
            await self.pipeline.allow_steps(self.scheduler.num_lanes)
            try:
                while not self._inbox and not self._wake.is_set():
                    await self._wake.wait()  # the first micro-batch came back
            finally:
                await self.pipeline.allow_steps(0)
            while self.pipeline.stepping:  # the others sent meanwhile
                await asyncio.sleep(0)
        await self.engine.settle()
        outputs, error, _ = self._take()
        if error is not None:
            raise error
        return outputs

    def _take(self) -> tuple[list[RequestOutput], BaseException | None, list[str]]:
        """Apply what the engine handed this LLM's requests since the last call to their
        completions: the outputs, the first error, and the requests a stop string ended
        (to abort). At a stop string keep the tokens up to the one that completed it (a
        verify round may have emitted more); the finish reason becomes ``stop``."""
        items, self._inbox[:] = list(self._inbox), []
        outputs, error, stopped = [], None, []
        for rid, o in items:
            c = self.completions.get(rid)
            if isinstance(o, BaseException):
                error = error or o
                if c is not None and c.finish_reason is None:
                    c.finish_reason = "abort"
                continue
            outputs.append(o)
            if c is None or c.stop_reason is not None:
                continue
            first = len(c.token_ids)
            c.token_ids += o.new_token_ids
            c.accept_lengths += o.accept_lengths
            c.logprobs += o.logprobs or []
            if o.prompt_logprobs is not None:
                c.prompt_logprobs = o.prompt_logprobs
            c.finish_reason = o.finish_reason
            st = self._streams.get(rid)
            if st is None:
                continue
            for j, t in enumerate(o.new_token_ids):
                if st.add(t):
                    keep = first + j + 1
                    c.token_ids, c.logprobs = c.token_ids[:keep], c.logprobs[:keep]
                    c.stop_reason = st.stop_str
                    if c.finish_reason is None:
                        stopped.append(rid)
                    c.finish_reason = "stop"
                    break
        return outputs, error, stopped

    def flush_cache(self) -> None:
        """Evict every cached prefix not in use now, on every stage."""
        self._run(self.engine.flush_cache())

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None, *, n: int = 1,
             chat_template_kwargs: dict | None = None) -> list[Completion]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages)
        or a list of conversations, each rendered by the checkpoint's chat template
        (``tokenizer.apply_chat_template`` with ``add_generation_prompt``; more of its
        arguments in ``chat_template_kwargs``). Returns completions as :meth:`generate`, each
        with its ``text`` (the reply decoded without special tokens)."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c) for c in messages):
            raise TypeError("messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) "
                            "or a list of conversations")
        kwargs = {"add_generation_prompt": True, **(chat_template_kwargs or {}), "tokenize": True, "return_dict": False}
        ids = []
        for conv in messages:
            out = self.tokenizer.apply_chat_template(list(conv), **kwargs)
            ids.append([int(t) for t in (out["input_ids"] if isinstance(out, dict) else out)])
        out = self.generate(ids, params, n=n)
        for c in out:  # prompts of ids: generate decodes only where stop strings need the text
            if c.text is None:
                c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return out

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 n: int = 1) -> list[Completion]:
        """Generate for a list of prompts (token id lists or integer arrays, or strings with a
        tokenizer next to the checkpoint); returns completions in prompt order, ``n`` per
        prompt (its samples one after another; sample i of a seeded request uses seed
        ``seed + i``, as the HTTP API's choices). Calls from several threads are served one
        after another.

        Raises ValueError / TypeError (nothing queued) for bad ids or parameters; whatever
        interrupts the call (an error from a stage, KeyboardInterrupt) ends its requests and
        gives their rows back on every stage before it propagates."""
        if isinstance(prompts, str):  # one prompt, as vLLM takes it
            prompts = [prompts]
        if hasattr(prompts, "tolist"):  # a 2-D array / tensor of ids: its rows
            prompts = prompts.tolist()
        if not isinstance(prompts, (list, tuple)) or any(isinstance(p, numbers.Integral) for p in prompts):
            raise TypeError("prompts must be a list of prompts, each a string or a list of token ids "
                            f"(one prompt of ids: [[1, 2, 3]]), got {type(prompts).__name__}"
                            + (" of ints" if isinstance(prompts, (list, tuple)) else ""))
        params = SamplingParams(temperature=0.0) if params is None else params
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        bad = [type(sp).__name__ for sp in plist if not isinstance(sp, SamplingParams)]
        if bad:
            raise TypeError(f"params must be SamplingParams (one, or one per prompt), got {bad[0]}")
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if n > 1:  # each prompt n times, a seeded request's samples on consecutive seeds
            prompts = [p for p in prompts for _ in range(n)]
            plist = [sp if sp.seed is None else dataclasses.replace(sp, seed=sp.seed + i)
                     for sp in plist for i in range(n)]
        tok = None
        ids = []
        for p in prompts:
            if isinstance(p, str):
                tok = tok or self.tokenizer
                ids.append(tok.encode(p))
            elif isinstance(p, (bytes, bytearray)) or not hasattr(p, "__iter__"):
                raise TypeError(f"a prompt is a string or a list of token ids, got {type(p).__name__}")
            else:  # a list, or a numpy array / tensor row of ids
                seq = p.tolist() if hasattr(p, "tolist") else list(p)
                if not isinstance(seq, list):  # a 0-d array or tensor
                    raise TypeError(f"a prompt is a string or a list of token ids, got a scalar {type(p).__name__}")
                ids.append(seq)
        if any(sp.stop for sp in plist):
            tok = tok or self.tokenizer
        return self._run(self._generate(ids, plist, tok))

    async def _generate(self, ids: list, plist: list[SamplingParams], tok) -> list[Completion]:
        await self._ready()
        rids = []
        sched = self.scheduler
        try:
            for i, sp in zip(ids, plist):
                rids.append(self.add_request(i, sp))
                if sp.stop:
                    self._streams[rids[-1]] = TextStream(tok, list(i), sp.stop, min_tokens=sp.min_tokens,
                                                         include_stop=sp.include_stop_str_in_output)
            await self.pipeline.allow_steps(None)
            while True:
                self._wake.clear()
                _, error, stopped = self._take()
                for rid in stopped:
                    await self.engine.abort(rid, "stop")
                if error is not None:
                    raise error
                # done once every request has left the scheduler (a stopped one's round in flight came back)
                if all(self.completions[r].finish_reason is not None and r not in sched.requests for r in rids):
                    break
                await self._wake.wait()
            await self.engine.settle()
        except BaseException:
            # this call's requests end with it (the object stays usable for the next call)
            for r in rids:
                await self.engine.abort(r)
            await self.engine.settle()
            self._take()
            for r in rids:
                self.completions.pop(r, None)
                self._streams.pop(r, None)
            raise
        out = [self.completions.pop(r) for r in rids]
        for c in out:
            st = self._streams.pop(c.request_id, None)
            if st is not None:
                st.finish()
                c.text = st.text
            elif tok is not None:
                c.text = tok.decode(c.token_ids, skip_special_tokens=True)
        return out

    @property
    def tokenizer(self):
        from transformers import AutoTokenizer

        if not hasattr(self, "_tokenizer"):
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    def rows_in_use(self) -> list[int]:
        return [i["rows_in_use"] for i in self.pipeline.info_sync()]

    def close(self) -> None:
        """Stop the engine (its rows back on every stage) and close the event loop; also
        when the object is dropped."""
        loop = getattr(self, "_loop", None)
        if loop is None or loop.is_closed() or loop.is_running() or sys.is_finalizing():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._close_on(loop)
            return
        # dropped while another event loop runs on this thread (a collection inside it):
        # ours cannot run here, and closed with its tasks pending they would be destroyed
        # mid-await; it runs them to their end on a thread of its own
        t = threading.Thread(target=self._close_on, args=(loop,), name="llm-close")
        t.start()
        t.join()

    def _close_on(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            with self._lock:
                closing = self.engine.close()
                try:
                    loop.run_until_complete(closing)
                finally:
                    closing.close()  # never started (the loop refused it): no 'never awaited' warning
        finally:
            # the engine's callbacks on the pipeline would keep both alive past this object
            self.pipeline.on_restart = self.pipeline.on_displaced = None
            loop.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (at interpreter exit modules may be gone)
            pass


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ppspec generate", description="generate in one process (no gRPC)")
    ap.add_argument("prompt", nargs="+", help="prompts (raw text, no chat template), generated together")
    ap.add_argument("--model", default=DEMO_MODEL, help="checkpoint folder (default: the demo model)")
    ap.add_argument("--pp-size", type=positive_int, default=1, help="pipeline stages (default: 1)")
    ap.add_argument("--speculative-algorithm", default="none", choices=["none", "ngram", "mtp"],
                    help="draft source (default: none)")
    ap.add_argument("--speculative-num-steps", type=positive_int, default=3, help="drafts per round (default: 3)")
    ap.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per prompt at most (default: 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    ap.add_argument("--commit-design", default=None, choices=["copy", "replay"],
                    help="GDN verify commit (default: replay on CUDA, copy on CPU)")
    ap.add_argument("--device", type=device_list, default="cpu", help="cpu, cuda, or a comma-separated device per stage")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="weights and activations (default: float32)")
    add_cuda_graph_args(ap)
    a = ap.parse_args(argv)
    # warnings on stderr, and the kernels' start-up notes (a FlashInfer build takes minutes)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("ppspec.kernels").setLevel(logging.INFO)
    from ppspec.stage_server.config import CheckpointError

    from .types import EngineError

    try:
        llm = LLM(a.model, pp_size=a.pp_size, speculative_algorithm=a.speculative_algorithm,
                  num_speculative_steps=a.speculative_num_steps, commit_design=a.commit_design,
                  device=a.device, dtype=a.dtype, cuda_graph_max_bs=cuda_graph_max_bs(a))
        outs = llm.generate(a.prompt, SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens,
                                                        stop=a.stop))
    except (CheckpointError, EngineError, ValueError, OSError) as e:
        print(f"ppspec generate: {e}", file=sys.stderr)
        return 2
    for p, c in zip(a.prompt, outs):
        acc = f", mean accept length {sum(c.accept_lengths) / len(c.accept_lengths):.2f}" if c.accept_lengths else ""
        print(f"{p}{c.text}\n  [{len(c.token_ids)} tokens, finish {c.finish_reason}{acc}]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
