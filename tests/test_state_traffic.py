"""bench/state_traffic.py's per-layer sizes against what a stage allocates: the committed
state and the copy design's verify scratch of the demo checkpoint's recurrent layers."""
import torch

from ppspec.bench.state_traffic import traffic
from ppspec.router.llm import DEMO_MODEL
from ppspec.stage_server.runner import StageRunner


def test_state_sizes_are_what_the_stage_allocates():
    torch.set_num_threads(1)
    D, R = 4, 3
    r = traffic(DEMO_MODEL, D, dtype=torch.float32)
    st = StageRunner(DEMO_MODEL, 0, 1, max_rows=R, num_speculative_steps=D - 1, commit_design="copy")
    per_row = r["layers"] * (r["state"] + r["window"])
    assert st.state.nbytes["state"] == (R + 1) * per_row  # the padding row too
    assert st.state.nbytes["verify_scratch"] == (R + 1) * D * per_row
    assert r["copy"] == (D + 3) * per_row and r["minimum"] == 2 * r["layers"] * r["state"]
    assert r["minimum"] < r["replay"] < r["copy"]
