"""FlashInfer paged attention for eager prefill chunks on CUDA.

Same semantics as ``naive.paged_attention_ref``; used only where it is the better kernel:
an eager (not CUDA-graph) prefill chunk, bf16 or fp16, head dim 64, 128 or 256, on CUDA
with ``flashinfer`` importable. Decode and verify stay on the Triton kernel (``gpu.py``):
they run inside CUDA graphs, and FlashInfer's ``plan()`` reads host data and cannot be
captured. fp32 is not a FlashInfer dtype: fp32 stages keep Triton too.

``PPSPEC_ATTENTION_BACKEND`` picks: ``auto`` (default: FlashInfer where it can run, else
Triton), ``triton`` or ``flashinfer`` (a stage that cannot use it refuses to start:
:func:`stage_uses_flashinfer` raises). On the H200 its kernel matched the reference in
every case of ``tests/gpu/test_flashinfer_gpu.py`` and a bf16 stage's hidden states after
a chunked prefill are within 1e-2 of the Triton run's; greedy tokens part from Triton's
only at near-ties (top-2 gaps of 0 and one bf16 ulp); its prefill attention is 2-4.4x
faster at head dim 256 (docs/PERFORMANCE.md, "Prefill attention").

FlashInfer builds its kernels on first use (JIT, ~2 min a head dim on the H200, cached
under ``~/.cache/flashinfer`` after): a stage builds and runs its head dim once at start
(:func:`warm_up`) so that no request waits for the build; under ``auto`` a build that
fails leaves the stage on Triton with a warning.

Planning. FlashInfer splits a batch into work tiles once (``plan``), then runs any number
of layers on that split (``run``). One :class:`PrefillPlan` is made per step and KV pool
(the stage keeps it on its ``BatchMeta``) from the host lists the stage already has, so
planning reads nothing back from the device; the first attention layer plans, the others
reuse it. All plans of a device share one wrapper and its workspace (:data:`WORKSPACE_NBYTES`
of device memory, allocated at the first plan): a plan that finds the wrapper planned for
another one (the MTP head's pool after the main pool, another stage on the same GPU)
plans again. The stage runs steps from one thread; so must any other caller.
"""
from __future__ import annotations

import functools
import logging
import os
import time

import torch

log = logging.getLogger("ppspec.kernels")

ENV = "PPSPEC_ATTENTION_BACKEND"
BACKENDS = ("auto", "triton", "flashinfer")
HEAD_DIMS = (64, 128, 256)  # FlashInfer's prefill head dims on both its SM90 and SM80 paths
DTYPES = (torch.bfloat16, torch.float16)
FLOAT_WORKSPACE = 128 << 20  # FlashInfer's recommended split-KV scratch
# the wrapper's own device buffers: 8 MiB int workspace, 32768 int32 KV lengths
WORKSPACE_NBYTES = FLOAT_WORKSPACE + (8 << 20) + 32768 * 4


def requested() -> str:
    """The backend ``PPSPEC_ATTENTION_BACKEND`` asks for (``auto`` when unset).

    Raises:
        ValueError: a value other than auto, triton or flashinfer.
    """
    v = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if v not in BACKENDS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: must be one of {', '.join(BACKENDS)}")
    return v


@functools.cache
def _flashinfer():
    """``(module, None)`` when ``flashinfer`` imports, else ``(None, why)``. Any exception
    counts as absent (a broken install must not crash an ``auto`` stage); the reason is
    kept for the forced case's message."""
    try:
        import flashinfer

        return flashinfer, None
    except Exception as e:  # noqa: BLE001 -- ImportError, or a CUDA/ABI error of the wheel
        return None, f"{type(e).__name__}: {e}"


def unsupported(device, dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int) -> str | None:
    """Why FlashInfer cannot run a stage's prefill attention, or None when it can. The
    stage's own facts come first: a stage they rule out does not import flashinfer."""
    if torch.device(device).type != "cuda":
        return f"the stage runs on {device} (FlashInfer runs on CUDA)"
    if dtype not in DTYPES:
        return f"the stage's dtype is {dtype} (FlashInfer takes bfloat16 or float16)"
    if head_dim not in HEAD_DIMS or num_q_heads % num_kv_heads:
        return f"head dim {head_dim}, {num_q_heads}/{num_kv_heads} heads (FlashInfer takes head dims {HEAD_DIMS})"
    _, why = _flashinfer()
    if why is not None:
        return f"flashinfer does not import ({why})"
    return None


def stage_uses_flashinfer(device, dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether a stage runs its eager prefill attention with FlashInfer, as
    ``PPSPEC_ATTENTION_BACKEND`` asks; checked once at stage start.

    Raises:
        ValueError: a bad ``PPSPEC_ATTENTION_BACKEND``, or ``flashinfer`` forced where it
            cannot run (not importable, not CUDA, fp32, an unsupported head dim).
    """
    want = requested()
    if want == "triton":
        return False
    why = unsupported(device, dtype, head_dim, num_q_heads, num_kv_heads)  # imports flashinfer last
    if why is not None and want == "flashinfer":
        raise ValueError(f"{ENV}=flashinfer, but {why}; unset it or set {ENV}=triton")
    if why is not None and torch.device(device).type == "cuda" and dtype in DTYPES:
        log.info("prefill attention on Triton: %s", why)
    return why is None


class _Shared:
    """One device's wrapper, its workspace, the plan it holds and the event after that
    plan's host->device copy."""

    def __init__(self, device: torch.device):
        fi, _ = _flashinfer()
        self.workspace = torch.empty(FLOAT_WORKSPACE, dtype=torch.uint8, device=device)
        self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.owner: PrefillPlan | None = None
        self.copied: torch.cuda.Event | None = None


_shared: dict[int, _Shared] = {}


def _on(device: torch.device) -> _Shared:
    sh = _shared.get(device.index)
    if sh is None:
        sh = _shared[device.index] = _Shared(device)
    return sh


class PrefillPlan:
    """The FlashInfer plan of one prefill step over one KV pool, made on first use.

    Args:
        rows: ``req_pool_indices`` of the step (host list, one per request).
        kv_lens: tokens each request has in the cache, the chunk's included (host list).
        q_lens: the chunk's tokens per request (host list); the queries of request b sit
            at the last ``q_lens[b]`` of its ``kv_lens[b]`` positions (bottom-right causal,
            as FlashInfer aligns a query block shorter than its KV).
        page_size: the pool's tokens per page.

    Raises:
        ValueError: lists of different lengths, a request without queries or with more
            queries than KV tokens (the stage never makes these; Triton takes
            zero-query requests).
    """

    def __init__(self, rows: list[int], kv_lens: list[int], q_lens: list[int], page_size: int):
        if not len(rows) == len(kv_lens) == len(q_lens):
            raise ValueError("rows, kv_lens and q_lens disagree on the batch")
        if any(not 0 < q <= n for q, n in zip(q_lens, kv_lens)):
            raise ValueError(f"each request needs 1 <= q_len <= kv_len: q_lens {q_lens}, kv_lens {kv_lens}")
        self.rows, self.page_size = list(rows), page_size
        self.q_total = sum(q_lens)
        # host int32 tensors: plan() then copies them to the device without a device read
        i32 = dict(dtype=torch.int32)
        kv = torch.tensor(kv_lens, **i32)
        self.pages = (kv + page_size - 1) // page_size
        self.qo_indptr = torch.zeros(len(rows) + 1, **i32)
        self.qo_indptr[1:] = torch.tensor(q_lens, **i32).cumsum(0)
        self.kv_indptr = torch.zeros(len(rows) + 1, **i32)
        self.kv_indptr[1:] = self.pages.cumsum(0)
        self.last_page_len = kv - (self.pages - 1) * page_size
        self.max_kv = max(kv_lens, default=0)
        self._key = None

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether this call can take FlashInfer: CUDA, not under graph capture (plan and
        the host-built indices cannot be recorded), bf16/fp16 q with KV of its dtype, a
        supported head dim, this plan's batch and page size."""
        return (q.is_cuda and q.dtype in DTYPES and k_cache.dtype == q.dtype and q.shape[-1] in HEAD_DIMS
                and q.shape[0] == self.q_total and k_cache.shape[1] == self.page_size
                and not torch.cuda.is_current_stream_capturing())

    def _plan(self, sh: _Shared, key, page_table: torch.Tensor, Hq: int, Hkv: int, hd: int, dtype, scale: float):
        rows_n, max_pages = page_table.shape
        if self.max_kv > max_pages * self.page_size:
            raise IndexError("kv_lens exceed the page table's capacity")
        if min(self.rows) < 0 or max(self.rows) >= rows_n:  # the gather below must stay in the table
            raise IndexError(f"plan rows out of range [0, {rows_n}): {self.rows}")
        # page ids of each request, in order: page_table[row, :pages], gathered on the
        # device from flat indices made on the host (no device read)
        n = int(self.kv_indptr[-1])
        rows = torch.tensor(self.rows, dtype=torch.int64)
        flat = torch.repeat_interleave(rows * max_pages - self.kv_indptr[:-1], self.pages, output_size=n)
        flat += torch.arange(n)
        indices = page_table.reshape(-1)[flat.to(page_table.device)].to(torch.int32)
        # plan() fills the wrapper's one pinned host buffer and copies it to the device
        # asynchronously: before filling it again, wait for the previous copy
        if sh.copied is not None:
            sh.copied.synchronize()
        sh.wrapper.plan(
            self.qo_indptr, self.kv_indptr, indices, self.last_page_len, Hq, Hkv, hd, self.page_size,
            causal=True, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype,
        )
        sh.copied = torch.cuda.Event()
        sh.copied.record(torch.cuda.current_stream(page_table.device))
        sh.owner, self._key = self, key

    def run(self, q, k_cache, v_cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, scale, gate=None):
        """Arguments as :func:`naive.paged_attention_ref`, describing the batch this plan
        was made for (checked: batch size, tokens, page size; and the bounds the Triton
        path checks, from the stage's stated facts). Call where :meth:`supports` holds.

        Returns ``[T, Hq, hd]`` in q's dtype: FlashInfer's attention (softmax in fp32),
        then ``* sigmoid(gate)`` in torch, each op rounded to q's dtype as in the reference.

        Raises:
            ValueError / IndexError: as the Triton path, or tensors of another batch.
        """
        from .gpu import _validate  # Triton is there wherever FlashInfer runs

        _validate(q, k_cache, v_cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, gate)
        if req_pool_indices.numel() != len(self.rows):
            raise ValueError(f"plan made for {len(self.rows)} requests, called with {req_pool_indices.numel()}")
        T, Hq, hd = q.shape
        Hkv = k_cache.shape[2]
        out = torch.empty((T, Hq, hd), dtype=q.dtype, device=q.device)
        if T == 0:
            return out
        sh = _on(q.device)
        key = (Hq, Hkv, hd, q.dtype, float(scale), page_table.data_ptr(), page_table.shape)
        if sh.owner is not self or self._key != key:
            self._plan(sh, key, page_table, Hq, Hkv, hd, q.dtype, float(scale))
        sh.wrapper.run(q.contiguous(), (k_cache, v_cache), out=out)
        return out if gate is None else out * torch.sigmoid(gate)


def warm_up(device, dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int, page_size: int) -> float:
    """Plan and run one tiny prefill (one request, one token on one page of a scratch KV
    cache, whatever the page size) on ``device``: FlashInfer JIT-builds the kernel of this head dim, dtype and
    head ratio now, at stage start, instead of at the first request. Allocates the
    device's shared workspace (:data:`WORKSPACE_NBYTES`). Returns the seconds it took.

    Raises:
        whatever FlashInfer raises when it cannot build or run (no compiler, an
        unsupported GPU); the caller decides between falling back and stopping.
    """
    t0 = time.perf_counter()
    dev = torch.device(device)
    kv = torch.zeros(2, page_size, num_kv_heads, head_dim, dtype=dtype, device=dev)
    q = torch.zeros(1, num_q_heads, head_dim, dtype=dtype, device=dev)
    ints = dict(dtype=torch.long, device=dev)
    plan = PrefillPlan([0], [1], [1], page_size)
    plan.run(q, kv, kv.clone(), torch.tensor([[1]], **ints), torch.tensor([0], **ints), torch.tensor([1], **ints),
             torch.tensor([0, 1], **ints), head_dim ** -0.5)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    _on(dev).owner = None  # the next real plan plans again
    return time.perf_counter() - t0


def build_at_start(device, dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int,
                   page_size: int) -> bool:
    """:func:`warm_up` for a stage that :func:`stage_uses_flashinfer`: whether it keeps
    FlashInfer. Under ``auto`` a failed build logs a warning and returns False (Triton);
    the workspace a failed first warm-up allocated is freed.

    Raises:
        ValueError: the build or its first run failed and ``PPSPEC_ATTENTION_BACKEND``
            forces ``flashinfer``; or the warm-up batch failed ppspec's own checks (a
            ValueError / IndexError from them passes through under ``auto`` too).
        RuntimeError: the CUDA context is broken after the failure.
    """
    log.info("FlashInfer prefill attention: building its kernel for head dim %d, %s (first use on this "
             "machine: minutes; cached in ~/.cache/flashinfer after)", head_dim, dtype)
    dev = torch.device(device)
    had_wrapper = dev.index in _shared
    try:
        secs = warm_up(device, dtype, head_dim, num_q_heads, num_kv_heads, page_size)
    except (ValueError, IndexError):
        raise  # ppspec's own checks of the warm-up batch: a bug to show, not a build to fall back from
    except Exception as e:  # noqa: BLE001 -- a JIT, compiler or driver error of any kind
        why = f"FlashInfer's prefill kernel failed to build or run ({type(e).__name__}: {e})"
        if not had_wrapper:
            _shared.pop(dev.index, None)  # its workspace goes with it: the stage reports none
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # a broken CUDA context raises here: no stage on it
            torch.cuda.empty_cache()
        if requested() == "flashinfer":
            raise ValueError(f"{ENV}=flashinfer, but {why}; unset it or set {ENV}=triton") from e
        log.warning("prefill attention on Triton: %s", why)
        return False
    log.info("FlashInfer prefill attention ready in %.1f s", secs)
    return True


def prefill_plan(rows: list[int], kv_lens: list[int], q_lens: list[int], page_size: int) -> PrefillPlan | None:
    """A :class:`PrefillPlan` for a stage that uses FlashInfer, or None (Triton) for a
    batch it does not take: an empty one, or a request without queries."""
    if not rows or any(q < 1 for q in q_lens):
        return None
    return PrefillPlan(rows, kv_lens, q_lens, page_size)
