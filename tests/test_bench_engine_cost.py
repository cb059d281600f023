"""``bench/engine_cost.py``: the served path with a stand-in for the stages' compute. The
stand-in must keep every request served (the router's checks of a step's result, the
stage's row bookkeeping and commits hold), with speculation and without, and the report
must carry the served figures."""
from __future__ import annotations

import pytest

from ppspec.bench.engine_cost import main


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_stand_in_compute_serves_every_request(spec, capsys):
    assert main(["--spec", spec, "--concurrency", "4", "--num-prompts", "12", "--max-tokens", "9"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| this checkout |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    tok_s, mbs, per_mb, accept, failed = float(cells[1]), float(cells[2]), float(cells[3]), cells[6], int(cells[7])
    assert failed == 0 and tok_s > 0 and mbs > 0 and per_mb >= 1.0
    if spec == "none":  # at most 4 running, a token each
        assert per_mb <= 4.0 and accept == "-"
    else:  # the stand-in drafts 7s and emits 7s: every verify accepts all its drafts (3,
        # fewer only where the router gives fewer near a request's end)
        assert 3.0 < float(accept) <= 4.0
