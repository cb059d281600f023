"""The prefill attention backend choice (``PPSPEC_ATTENTION_BACKEND``) and the FlashInfer
plan's plumbing, on the CPU.

FlashInfer itself needs CUDA (``make test-gpu-flashinfer`` checks its numbers); here a
fake ``flashinfer`` module stands in for it: its wrapper rebuilds each request's pages
from the planned ``indptr`` / ``indices`` / ``last_page_len`` and runs the torch
reference on them, so a wrong plan shows as a wrong output, and it counts plans and runs.
"""
from __future__ import annotations

import os
import random
import sys
import types

import pytest
import torch

from ppspec.kernels.attention import flashinfer as fa
from ppspec.kernels.attention import paged_attention
from ppspec.kernels.attention.naive import paged_attention_ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models", "qwen35-demo")


@pytest.fixture
def no_flashinfer(monkeypatch):
    """``import flashinfer`` fails, whatever is installed."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    fa._flashinfer.cache_clear()
    yield
    fa._flashinfer.cache_clear()


def test_forced_flashinfer_without_it_fails_at_stage_start(monkeypatch, no_flashinfer):
    from ppspec.stage_server.runner import StageRunner

    monkeypatch.setenv(fa.ENV, "flashinfer")
    with pytest.raises(ValueError, match=r"PPSPEC_ATTENTION_BACKEND=flashinfer, but flashinfer does not import "
                                         r"\(ModuleNotFoundError.*\); unset it or set PPSPEC_ATTENTION_BACKEND=triton"):
        fa.stage_uses_flashinfer("cuda:0", torch.bfloat16, 128, 16, 2)
    with pytest.raises(ValueError, match=r"PPSPEC_ATTENTION_BACKEND=flashinfer, but the stage runs on cpu "
                                         r"\(FlashInfer runs on CUDA\); unset it or set PPSPEC_ATTENTION_BACKEND=triton"):
        StageRunner(DEMO, device="cpu")
    monkeypatch.setenv(fa.ENV, "flash")
    with pytest.raises(ValueError, match=r"PPSPEC_ATTENTION_BACKEND='flash': must be one of auto, triton, flashinfer"):
        StageRunner(DEMO, device="cpu")


@pytest.mark.parametrize("env", [None, "auto", "AUTO", "triton"])
def test_auto_and_triton_fall_back_without_flashinfer(monkeypatch, no_flashinfer, env):
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    if env is None:
        monkeypatch.delenv(fa.ENV, raising=False)
    else:
        monkeypatch.setenv(fa.ENV, env)
    assert not fa.stage_uses_flashinfer("cuda:0", torch.bfloat16, 128, 16, 2)
    r = StageRunner(DEMO, device="cpu", dtype=torch.bfloat16, max_rows=4)
    assert not r.flashinfer_prefill and r.memory_report()["attention_workspace"] == 0
    meta, _ = r.forward_hidden(StepInput(0, 0, "prefill", [2], [0], [5], [1, 2, 3, 4, 5]))
    assert meta.attn_plan is None


def test_stage_rules_with_flashinfer_importable(monkeypatch):
    """Where flashinfer imports: auto (the default, the variable unset) takes it only for
    a CUDA bf16/fp16 stage with a supported head dim; forced, the other cases refuse to
    start; triton never takes it."""
    monkeypatch.setattr(fa, "_flashinfer", lambda: (types.SimpleNamespace(), None))
    monkeypatch.setenv(fa.ENV, "auto")
    assert fa.stage_uses_flashinfer("cuda:0", torch.bfloat16, 256, 16, 2)
    assert fa.stage_uses_flashinfer("cuda:1", torch.float16, 64, 4, 4)
    for args in (("cpu", torch.bfloat16, 128, 8, 8), ("cuda:0", torch.float32, 128, 8, 8),
                 ("cuda:0", torch.bfloat16, 96, 8, 8)):
        monkeypatch.setenv(fa.ENV, "auto")
        assert not fa.stage_uses_flashinfer(*args)
        monkeypatch.setenv(fa.ENV, "flashinfer")
        with pytest.raises(ValueError, match="PPSPEC_ATTENTION_BACKEND=flashinfer, but the stage|head dim 96"):
            fa.stage_uses_flashinfer(*args)
    monkeypatch.setenv(fa.ENV, "triton")
    assert not fa.stage_uses_flashinfer("cuda:0", torch.bfloat16, 256, 16, 2)
    monkeypatch.delenv(fa.ENV)  # unset is auto
    assert fa.stage_uses_flashinfer("cuda:0", torch.bfloat16, 256, 16, 2)
    assert not fa.stage_uses_flashinfer("cuda:0", torch.float32, 256, 16, 2)


# ---------------------------------------------------------------- the plan, with a fake FlashInfer


class FakeWrapper:
    """``BatchPrefillWithPagedKVCacheWrapper`` with the reference's numbers: pages per
    request from the plan's ``indptr`` / ``indices``, lengths from ``last_page_len``."""

    log: list[str] = []

    def __init__(self, workspace, kv_layout):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8

    def plan(self, qo_indptr, kv_indptr, indices, last_page_len, Hq, Hkv, hd, page_size, *, causal, sm_scale,
             q_data_type, kv_data_type, o_data_type):
        # indptrs on the host (FlashInfer reads them there: no device read), int32 indices
        assert qo_indptr.device.type == kv_indptr.device.type == last_page_len.device.type == "cpu"
        assert qo_indptr.dtype == kv_indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert causal and q_data_type == kv_data_type == o_data_type
        assert bool((last_page_len >= 1).all()) and bool((last_page_len <= page_size).all())
        assert indices.numel() == int(kv_indptr[-1])
        self.p = (qo_indptr, kv_indptr, indices, last_page_len, Hq, Hkv, hd, page_size, sm_scale)
        self.log.append("plan")

    def run(self, q, kv, out):
        qo_indptr, kv_indptr, indices, last, Hq, Hkv, hd, page_size, scale = self.p
        k_cache, v_cache = kv
        assert q.shape[1:] == (Hq, hd) and k_cache.shape[1:] == (page_size, Hkv, hd) and q.shape[0] == int(qo_indptr[-1])
        B = qo_indptr.numel() - 1
        n = (kv_indptr[1:] - kv_indptr[:-1]).long()
        pt = torch.zeros(B, max(int(n.max()), 1), dtype=torch.long)
        for b in range(B):
            pt[b, : n[b]] = indices[kv_indptr[b]: kv_indptr[b + 1]].long()
        kv_lens = (n - 1) * page_size + last.long()
        out.copy_(paged_attention_ref(q, k_cache, v_cache, pt.to(q.device), torch.arange(B), kv_lens,
                                      qo_indptr.long(), scale))
        self.log.append("run")


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        FakeWrapper.log.append("wait")


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashInfer 'runs' on the CPU: the fake module, no CUDA checks, no Triton validation."""
    FakeWrapper.log = []
    monkeypatch.setattr(fa, "_flashinfer", lambda: (types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=FakeWrapper), None))
    monkeypatch.setattr(fa, "unsupported", lambda *a: None)
    monkeypatch.setattr(fa, "_shared", {})
    monkeypatch.setattr(fa, "FLOAT_WORKSPACE", 16)
    monkeypatch.setattr(fa.PrefillPlan, "supports", lambda self, q, k: q.dtype in fa.DTYPES)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setitem(sys.modules, "ppspec.kernels.attention.gpu", types.SimpleNamespace(_validate=lambda *a: None))
    return FakeWrapper.log


def _case(seed, Hq, Hkv, hd, page=16, B=4):
    """Later chunks (kv_lens > L) of B requests on scattered rows and pages."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    Ls = [rng.randint(1, 40) for _ in range(B)]
    kv_lens = [L + rng.choice([0, rng.randint(1, 90)]) for L in Ls]
    max_pages = max(-(-n // page) for n in kv_lens) + 2
    rows_n = B + 5
    num_pages = (rows_n + 1) * max_pages
    page_table = torch.randperm(num_pages, generator=gen)[: (rows_n + 1) * max_pages].view(rows_n + 1, max_pages)
    rows = torch.randperm(rows_n, generator=gen)[:B].tolist()
    k = torch.randn(num_pages, page, Hkv, hd, generator=gen).bfloat16()
    v = torch.randn(num_pages, page, Hkv, hd, generator=gen).bfloat16()
    q = torch.randn(sum(Ls), Hq, hd, generator=gen).bfloat16()
    gate = torch.randn(sum(Ls), Hq, 2 * hd, generator=gen).bfloat16()[..., hd:]  # a strided view, as the model's
    cu = torch.tensor([0] + Ls).cumsum(0)
    args = (q, k, v, page_table, torch.tensor(rows), torch.tensor(kv_lens), cu, hd ** -0.5)
    return args, gate, (rows, kv_lens, Ls, page)


@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 4, 128), (16, 2, 256)])
def test_plan_matches_reference(fake_flashinfer, heads):
    args, gate, lists = _case(sum(heads), *heads)
    plan = fa.prefill_plan(*lists)
    for g in (None, gate):  # the second call reuses the plan (same batch, pool and scale)
        o = paged_attention(*args, gate=g, plan=plan)
        assert torch.equal(o, paged_attention_ref(*args, gate=g))
    assert fake_flashinfer == ["plan", "run", "run"]


def test_plans_share_the_wrapper_and_replan_when_interleaved(fake_flashinfer):
    a_args, _, a_lists = _case(1, 8, 2, 128)
    b_args, _, b_lists = _case(2, 8, 2, 128, page=32, B=3)
    a, b = fa.prefill_plan(*a_lists), fa.prefill_plan(*b_lists)
    for args, plan in ((a_args, a), (b_args, b), (a_args, a), (a_args, a)):
        assert torch.equal(paged_attention(*args, plan=plan), paged_attention_ref(*args))
    # one wrapper; each plan after the first waits for the previous plan's copy
    assert fake_flashinfer == ["plan", "run", "wait", "plan", "run", "wait", "plan", "run", "run"]
    assert len(fa._shared) == 1


def test_plan_refuses_batches_it_cannot_take():
    assert fa.prefill_plan([], [], [], 16) is None
    assert fa.prefill_plan([0, 1], [5, 3], [2, 0], 16) is None  # a request without queries: Triton
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        fa.PrefillPlan([0], [3], [4], 16)
    with pytest.raises(ValueError, match="disagree"):
        fa.PrefillPlan([0, 1], [3], [2], 16)


def test_stage_prefill_plans_once_per_step_and_pool(monkeypatch, fake_flashinfer):
    """A bf16 stage with the (fake) FlashInfer backend: one plan per prefill step for the
    two attention layers, decode on the other path, the same hidden states as the
    reference path, the workspace in the memory report."""
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    monkeypatch.setenv(fa.ENV, "flashinfer")
    fi = StageRunner(DEMO, device="cpu", dtype=torch.bfloat16, max_rows=8)
    assert fi.flashinfer_prefill and fi.memory_report()["attention_workspace"] == fa.WORKSPACE_NBYTES
    assert fake_flashinfer == ["plan", "run"]  # the kernel built and ran once at start
    assert fi.info()["prefill_attention"] == "flashinfer"
    monkeypatch.setenv(fa.ENV, "triton")
    ref = StageRunner(DEMO, device="cpu", dtype=torch.bfloat16, max_rows=8)
    assert not ref.flashinfer_prefill and ref.memory_report()["attention_workspace"] == 0 and ref.info()["prefill_attention"] == "torch"
    gen = torch.Generator().manual_seed(0)
    ids = {r: torch.randint(0, 8000, (60,), generator=gen).tolist() for r in (6, 1, 3)}
    steps = [("prefill", [6, 1, 3], [0, 0, 0], [20, 7, 33]), ("prefill", [6, 1], [20, 7], [25, 30]),
             ("decode", [6, 1], [45, 37], [1, 1])]
    n_att = len(fi.model.attention_layers)
    for i, (mode, rows, seq, ext) in enumerate(steps):
        toks = [t for r, s, e in zip(rows, seq, ext) for t in ids[r][s: s + e]]
        before = len(fake_flashinfer)
        outs = [r.forward_hidden(StepInput(0, i, mode, rows, seq, ext, toks)) for r in (fi, ref)]
        new = [x for x in fake_flashinfer[before:] if x != "wait"]
        assert new == (["plan"] + ["run"] * n_att if mode == "prefill" else []), (mode, new)
        assert (outs[0][0].attn_plan is not None) == (mode == "prefill")
        assert torch.equal(outs[0][1], outs[1][1]), mode


class BrokenWrapper(FakeWrapper):
    def plan(self, *a, **k):
        raise RuntimeError("ninja: build stopped: subcommand failed")


@pytest.mark.parametrize("env", ["auto", "flashinfer"])
def test_build_at_start(monkeypatch, fake_flashinfer, caplog, env):
    """The warm-up at stage start: a kernel that builds keeps FlashInfer (one tiny plan and
    run); one that fails leaves an auto stage on Triton with a warning, and stops a
    stage that forces FlashInfer with one message, before any request."""
    from ppspec.stage_server.runner import StageRunner

    monkeypatch.setenv(fa.ENV, env)
    for page in (16, 1):
        assert fa.build_at_start("cpu", torch.bfloat16, 64, 4, 2, page)
    assert fake_flashinfer == ["plan", "run", "wait", "plan", "run"]
    broken = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=BrokenWrapper)
    monkeypatch.setattr(fa, "_flashinfer", lambda: (broken, None))
    monkeypatch.setattr(fa, "_shared", {})
    if env == "auto":
        with caplog.at_level("WARNING", logger="ppspec.kernels"):
            assert not fa.build_at_start("cpu", torch.bfloat16, 64, 4, 2, 16)
        assert "prefill attention on Triton: FlashInfer's prefill kernel failed to build or run " \
               "(RuntimeError: ninja: build stopped" in caplog.text
        assert fa._shared == {}  # the failed build's workspace is not kept
        # a stage (on CUDA, here faked) that auto gave FlashInfer runs on Triton instead
        monkeypatch.setattr(fa, "stage_uses_flashinfer", lambda *a: True)
        r = StageRunner(DEMO, device="cpu", dtype=torch.bfloat16, max_rows=4)
        assert not r.flashinfer_prefill and r.memory_report()["attention_workspace"] == 0
        assert r.info()["prefill_attention"] == "torch"  # Triton's place on this CPU stage
        return
    msg = r"PPSPEC_ATTENTION_BACKEND=flashinfer, but FlashInfer's prefill kernel failed to build or run \(RuntimeError"
    with pytest.raises(ValueError, match=msg):
        fa.build_at_start("cpu", torch.bfloat16, 64, 4, 2, 16)
    with pytest.raises(ValueError, match=msg):
        StageRunner(DEMO, device="cpu", dtype=torch.bfloat16, max_rows=4)


def test_build_at_start_shows_its_own_check_errors(monkeypatch, fake_flashinfer):
    """A warm-up batch that ppspec's own checks refuse is a bug to show, not a build to
    fall back from, even under auto; a stage whose dtype or device rules FlashInfer out
    does not import it."""
    monkeypatch.setenv(fa.ENV, "auto")

    def bad_run(self, *a, **k):
        raise IndexError("kv_lens exceed the page table's capacity")

    monkeypatch.setattr(fa.PrefillPlan, "run", bad_run)
    with pytest.raises(IndexError, match="capacity"):
        fa.build_at_start("cpu", torch.bfloat16, 64, 4, 2, 16)
    imported = []
    monkeypatch.undo()  # the real unsupported(), which fake_flashinfer replaced
    monkeypatch.setattr(fa, "_flashinfer", lambda: imported.append(1) or (None, "absent"))
    assert fa.unsupported("cuda:0", torch.float32, 128, 8, 8) and fa.unsupported("cpu", torch.bfloat16, 128, 8, 8)
    assert fa.unsupported("cuda:0", torch.bfloat16, 96, 8, 8) and not imported
    assert fa.unsupported("cuda:0", torch.bfloat16, 128, 8, 8) == "flashinfer does not import (absent)" and imported
