"""The chaos soak's short form (``tests/chaos.py``): a keyed PP3 + MTP pipeline under mixed
and hostile traffic while a stage is paused, a stage is killed and restarted and the router
is replaced (each once, with traffic flowing between them); afterwards greedy answers are
unchanged, no stage holds a row, KV page or pending commit, and no process is left."""
from chaos import Soak


def test_chaos_soak_short(make_ckpt, tmp_path):
    summary = Soak(make_ckpt("qwen3_5_ratio2_7l"), duration=0.0, log_dir=str(tmp_path), workers=4).run()
    assert summary["ok"], summary
