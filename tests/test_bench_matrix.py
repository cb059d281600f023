"""The multi-configuration driver (``python -m ppspec.bench.matrix``) over real ``ppspec serve``
processes, and the random checkpoint the GPU benchmarks build.

The driver's greedy agreement is checked against an independent fact: on the CPU in fp32,
every PP size and speculation gives tokens identical to PP1 without speculation
(tests/test_pipeline.py proves it request by request), so each configuration must report
1.0; a configuration given different tokens must report less.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from ppspec.bench.matrix import main as matrix_main, prefix_agreement
from ppspec.router.llm import DEMO_MODEL


def test_prefix_agreement_counts_tokens_before_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert prefix_agreement(ref, ref) == 1.0
    # first request diverges at position 1 (1 token counted), the second never (4)
    assert prefix_agreement([[1, 9, 3, 4], [5, 6, 7, 8]], ref) == 5 / 8
    # a shorter output counts only what it has
    assert prefix_agreement([[1, 2], [5, 6, 7, 8]], ref) == 6 / 8
    with pytest.raises(ValueError):
        prefix_agreement([[1]], ref)


def test_matrix_reports_agreement_hops_and_busy_fractions(tmp_path):
    out = tmp_path / "m"
    rc = matrix_main(["--model", DEMO_MODEL, "--pp", "1,2", "--spec", "none,mtp", "--concurrency", "2",
                      "--prompts-per-concurrency", "2", "--max-output-len", "8", "--max-input-len", "64",
                      "--agreement-prompts", "4", "--agreement-tokens", "12", "--serve-args", "--num-threads 1",
                      "--out", str(out)])
    assert rc == 0
    results = {p.name: json.loads(p.read_text()) for p in out.glob("pp*-c2.json")}
    assert sorted(results) == ["pp1-mtp-c2.json", "pp1-none-c2.json", "pp2-mtp-c2.json", "pp2-none-c2.json"]
    for name, r in results.items():
        assert r["greedy_agreement"] == 1.0, name
        pipe = r["pipeline"]
        pp = 2 if name.startswith("pp2") else 1
        assert len(pipe["stage_busy_fraction"]) == pp
        assert all(0.0 < b <= 1.0 for b in pipe["stage_busy_fraction"]), (name, pipe)
        assert pipe["micro_batch_steps"] > 0 and pipe["per_hop_ms"] > 0, (name, pipe)
        assert r["completed"] == 8
    ref = json.loads((out / "agreement-reference.json").read_text())
    assert ref["pp"] == 1 and ref["spec"] == "none"
    assert len(ref["token_ids"]) == 4 and all(len(t) == 12 for t in ref["token_ids"])
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["rows"]) == 4 and summary["reference"] == "PP1 none"
    assert [a["greedy_agreement"] for a in summary["agreement"]] == [1.0] * 4
    table = (out / "summary.md").read_text().splitlines()
    assert len(table) == 2 + 4 + 5 + 4 and table[0].endswith("greedy agreement |")
    assert table[-4:] == [f"| {pp} | {s} | 1.0000 |" for pp in (1, 2) for s in ("none", "mtp")]


def test_random_checkpoint_carries_an_mtp_head_the_stage_loads(tmp_path):
    from safetensors import safe_open

    from ppspec.bench.gpu_bench import make_random_checkpoint
    from ppspec.stage_server.runner import StageRunner

    path = str(tmp_path / "rand")
    shape = dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512)
    n = make_random_checkpoint(torch, path, "cpu", **shape)
    assert n > 0 and os.path.isfile(os.path.join(path, "tokenizer.json"))
    r = StageRunner(path, max_rows=2, kv_tokens=256, num_speculative_steps=3, use_mtp=True)
    params = dict(r.model.named_parameters())
    with safe_open(os.path.join(path, "mtp.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert "mtp.fc.weight" in keys and any(k.startswith("mtp.layers.0.self_attn.") for k in keys)
        for k in keys:
            assert torch.equal(params[k].float(), f.get_tensor(k).float()), k
    # random, not zero: the head's projections carry the init's spread
    assert params["mtp.fc.weight"].float().std() > 0.01
