"""Host-known facts (kernels/checks.py): the checks use them instead of reading the device,
drop them when the tensor changes, and the stage states only true facts."""
from __future__ import annotations

import pytest
import torch

from ppspec.kernels.checks import check_rows, fact, known, min_max


def test_facts_are_used_and_dropped_on_in_place_change():
    t = torch.tensor([0, 1, 2])
    known(t, min=0, max=7)  # bounds, not exact values
    with pytest.raises(IndexError):
        check_rows(t, 5)  # the stated bound 7 is outside the pool
    assert min_max(t) == (0, 7)
    t[0] = -1  # version moves: the facts no longer hold
    assert min_max(t) == (-1, 2)
    with pytest.raises(IndexError):
        check_rows(t, 5)
    assert fact(t, "max_len", lambda: "computed") == "computed"


def test_stage_states_true_facts(tmp_path):
    from ppspec.stage_server.runner import StageRunner
    from checkpoints import make_checkpoint

    path = make_checkpoint("qwen3_5_ratio1", str(tmp_path))
    r = StageRunner(path, max_rows=8, kv_tokens=512, page_size=4)
    rows, seq, ext = [5, 2, 7], [0, 3, 9], [4, 1, 6]
    with torch.inference_mode():
        meta = r._meta("prefill", rows, seq, ext, r.kv)
    for t in (meta.rows, meta.kv_lens, meta.slots):
        lo, hi = min_max(t)
        assert lo <= int(t.min()) and int(t.max()) <= hi
    assert min_max(meta.rows) == (2, 7) and min_max(meta.kv_lens) == (4, 15)
    assert min_max(meta.slots)[1] < r.kv.num_pages * r.kv.page_size
    cu = meta.cu_seqlens
    assert fact(cu, "total", lambda: None) == int(cu[-1]) == sum(ext)
    assert fact(cu, "max_len", lambda: None) == int((cu[1:] - cu[:-1]).max()) == 6
    assert meta.tokens_per_request == 4


def test_commit_checks_read_facts_not_the_device(tmp_path, monkeypatch):
    """A valid commit is checked from the host lists the stage validated (rows in range and
    distinct, accept lengths in [1, D]); a repeated row is still refused, nothing written."""
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner
    from checkpoints import make_checkpoint

    path = make_checkpoint("qwen3_5_ratio1", str(tmp_path))
    for design in ("copy", "replay"):
        r = StageRunner(path, max_rows=8, kv_tokens=512, page_size=4, num_speculative_steps=2, commit_design=design)
        r.step(StepInput(0, 0, "prefill", [5, 2], [0, 0], [3, 3], [1, 2, 3, 4, 5, 6]))
        r.step(StepInput(0, 1, "verify", [5, 2], [3, 3], [3, 3], [1, 2, 3, 4, 5, 6], num_drafts=[2, 2]))
        reads = []
        for name in ("unique", "aminmax"):
            orig = getattr(torch, name)
            monkeypatch.setattr(torch, name, lambda *a, _o=orig, _n=name, **k: reads.append(_n) or _o(*a, **k))
        before = r.state.conv.clone()
        with pytest.raises(IndexError):
            r.commit_accept(0, 1, [5, 5], [1, 2])
        assert torch.equal(r.state.conv, before)
        reads.clear()
        r.commit_accept(0, 1, [5, 2], [3, 1])
        assert reads == [], f"{design}: the commit read the device: {reads}"
        assert not torch.equal(r.state.conv[:, 5], before[:, 5])  # the commit did write
        monkeypatch.undo()
