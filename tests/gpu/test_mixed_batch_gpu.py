"""Mixed micro-batches on CUDA (prefill chunks in the forward of verify and decode rows,
``StepInput.num_prefill``): the logits equal those of the same rows run as separate steps,
with the layers' CUDA kernels (FlashInfer's prefill attention where installed, fla's
chunked GDN from the row's state, the Triton decode / verify kernels). Eager with a long
chunk continuing a 32k-token prefix; through the graphs with short chunks (the verify and
the short-prefill graphs replayed one after the other, padded rows included); value/key
head ratios 1 and 2; fp32 and bf16."""
import json
import os
import shutil

import pytest
import torch

pytestmark = pytest.mark.gpu

D = 4


@pytest.fixture(scope="module")
def long_ckpt(make_ckpt, tmp_path_factory):
    """The reference checkpoints with a 40k-token context (random weights: RoPE reads it)."""
    def make(kind):
        src = make_ckpt(kind)
        dst = str(tmp_path_factory.mktemp(kind))
        shutil.copytree(src, dst, dirs_exist_ok=True)
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        cfg["max_position_embeddings"] = 40960
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
        return dst
    return make


def _logits(runner, inp):
    _, h = runner.forward_hidden(inp)
    return runner.model.logits(h)


@pytest.mark.parametrize("kind", ["qwen3_5_ratio1", "qwen3_5_ratio2_7l"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 8e-2)])
@pytest.mark.parametrize("prefix,chunk", [(32768, 1000), (100, 40)])
def test_mixed_step_equals_separate_steps(long_ckpt, kind, dtype, tol, prefix, chunk):
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    path = long_ckpt(kind)
    g = torch.Generator().manual_seed(0)
    long = torch.randint(0, 256, (prefix + chunk,), generator=g).tolist()
    a, b, e = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (50, 61, 30))
    runners = [StageRunner(path, max_rows=8, kv_tokens=prefix + 8192, num_speculative_steps=D - 1, dtype=dtype,
                           device="cuda", cuda_graph_max_bs=8) for _ in range(2)]
    for r in runners:
        for s in range(0, prefix, 8192):  # the prefix in chunks of 8192
            n = min(8192, prefix - s)
            r.step(StepInput(0, 0, "prefill", [5], [s], [n], long[s:s + n], sample=[False], next_token_ids=[long[s + n]]))
        r.step(StepInput(0, 0, "prefill", [2, 3], [0, 0], [46, 57], a[:46] + b[:57]))
    mixed, alone = runners
    ver = StepInput(0, 1, "verify", [2, 3], [46, 57], [D, D], a[46:50] + b[57:61], num_drafts=[3, 3])
    pre = StepInput(0, 1, "prefill", [5], [prefix], [chunk], long[prefix:], sample=[True])
    got = _logits(mixed, StepInput(0, 1, "verify", [2, 3, 5], [46, 57, prefix], [D, D, chunk],
                                   ver.input_ids + pre.input_ids, num_drafts=[3, 3, 0], num_prefill=1))
    want = torch.cat([_logits(alone, ver), _logits(alone, pre)])
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    for r in runners:
        r.commit_accept(0, 1, [2, 3], [2, 4])
    # decode of both (a continues from its 48th token) + a new request's whole prompt, row 0
    dec = StepInput(0, 2, "decode", [2, 3], [48, 61], [1, 1], [a[49], b[60]])
    new = StepInput(0, 2, "prefill", [0], [0], [30], e)
    got = _logits(mixed, StepInput(0, 2, "decode", [2, 3, 0], [48, 61, 0], [1, 1, 30], dec.input_ids + e,
                                   num_prefill=1))
    want = torch.cat([_logits(alone, dec), _logits(alone, new)])
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
