"""The MTP head of NemotronH checkpoints that carry one (NVIDIA's Nemotron 3: ``mtp.layers.{i}.*``,
``num_nextn_predict_layers``, ``mtp_hybrid_override_pattern``), on random checkpoints in
that layout (``tests/checkpoints.py``, ``NEMOTRON_MTP_KINDS``; fp32, CPU).

transformers has no NemotronH MTP head: the reference of its drafts is the head written
here in plain torch from the checkpoint's tensors (embedding, the two norms, concat, the
projection, the blocks, the final norm, ``lm_head``), fed the target's hidden states as
transformers computes them. Greedy tokens with MTP drafting equal PP1 without speculation.
"""
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from ppspec.proto.messages import StepInput
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.config import CheckpointError
from ppspec.stage_server.loader import load_stage_model
from ppspec.stage_server.runner import StageRunner
from test_nemotron_h import N_REQ, small_workload
from test_spec_invariance import check_design, drive, record_rounds

MTP_KINDS = ["nemotron_h_mtp", "nemotron_h_b_mtp"]


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


# ---------------------------------------------------------------- the plain-torch head
class PlainHead:
    """The checkpoint's MTP head, from its tensors and config.json alone."""

    def __init__(self, path):
        self.cfg = cfg = json.load(open(os.path.join(path, "config.json")))
        self.w = load_file(os.path.join(path, "model.safetensors"))
        self.eps = cfg.get("layer_norm_epsilon", 1e-5)
        self.kinds = {"*": "attention", "E": "moe", "-": "mlp"}
        self.pattern = [self.kinds[c] for c in cfg["mtp_hybrid_override_pattern"]]
        emb = self.w.get("backbone.embeddings.weight")
        self.embedding = emb
        self.lm_head = self.w.get("lm_head.weight", emb)

    def norm(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def linear(self, x, name):
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def attention(self, x, p):
        c = self.cfg
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        T = x.shape[0]
        q = self.linear(x, p + "q_proj").view(T, nh, hd).transpose(0, 1)
        k = self.linear(x, p + "k_proj").view(T, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
        v = self.linear(x, p + "v_proj").view(T, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
        scores = q @ k.transpose(1, 2) * hd ** -0.5
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, nh * hd)
        return self.linear(o, p + "o_proj")

    def mlp(self, x, p):
        return self.linear(torch.relu(self.linear(x, p + "up_proj")) ** 2, p + "down_proj")

    def moe(self, x, p):
        """Sigmoid router, top-k among the best groups by score + correction bias, weights
        the plain scores renormalised and scaled; relu2 experts; a shared expert."""
        c = self.cfg
        E, k = c["n_routed_experts"], c["num_experts_per_tok"]
        n_group, topk_group = c.get("n_group", 1), c.get("topk_group", 1)
        out = self.mlp(x, p + "shared_experts.")
        for t in range(x.shape[0]):
            s = torch.sigmoid(self.w[p + "gate.weight"] @ x[t])
            choice = s + self.w[p + "gate.e_score_correction_bias"]
            per = E // n_group
            group_score = [sorted(choice[g * per:(g + 1) * per].tolist())[-2:] for g in range(n_group)]
            groups = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
            allowed = [e for e in range(E) if e // per in groups]
            chosen = sorted(allowed, key=lambda e: -choice[e].item())[:k]
            weights = s[chosen]
            if c.get("norm_topk_prob", True):
                weights = weights / weights.sum()
            weights = weights * c.get("routed_scaling_factor", 1.0)
            for e, wt in zip(chosen, weights):
                out[t] = out[t] + wt * self.mlp(x[t:t + 1], f"{p}experts.{e}.")[0]
        return out

    def __call__(self, tokens, hidden):
        """The head over positions 0..T-1, position p fed ``tokens[p]`` (the next token) and
        ``hidden[p]`` (the target's last block output at p); its normed output ``[T, hidden]``."""
        x = torch.cat([self.norm(self.embedding[tokens], "mtp.layers.0.enorm.weight"),
                       self.norm(hidden, "mtp.layers.0.hnorm.weight")], -1)
        x = F.linear(x, self.w["mtp.layers.0.eh_proj.weight"])
        for i, kind in enumerate(self.pattern):
            p = f"mtp.layers.{i}."
            h = self.norm(x, p + "norm.weight")
            x = x + getattr(self, kind)(h, p + "mixer.")
        return self.norm(x, f"mtp.layers.{len(self.pattern) - 1}.final_layernorm.weight")

    def drafts(self, tokens, hidden, n):
        """``n`` greedy drafts: the head at the last position, then chained on its own
        draft and output (the head's KV holding every earlier position)."""
        tokens, hidden, out = list(tokens), hidden.clone(), []
        for _ in range(n):
            u = self(torch.tensor(tokens), hidden)[-1]
            out.append(int((self.lm_head @ u).argmax()))
            tokens.append(out[-1])
            hidden = torch.cat([hidden, u[None]])
        return out


@torch.no_grad()
def hf_hidden(path, ids, n_prompt):
    """The target's last block output (the input of ``norm_f``) at each position of ``ids``,
    as transformers computes it: ``n_prompt`` tokens in one forward, then one at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seen = []
    hook = model.model.norm_f.register_forward_hook(lambda m, args, out: seen.append(args[0][0]))
    out = model(torch.tensor([ids[:n_prompt]]), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    for i in range(n_prompt, len(ids)):
        out = model(torch.tensor([ids[i:i + 1]]), position_ids=torch.tensor([[i]]), cache=cache, use_cache=True)
    hook.remove()
    return torch.cat(seen)


@pytest.mark.parametrize("kind", MTP_KINDS)
def test_drafts_equal_the_plain_torch_head(make_ckpt, kind):
    """A prefill of two prompts, then a verify of its drafts: each step's drafts (the first
    and the two chained from it) equal the plain-torch head's over the committed tokens,
    fed transformers' hidden states."""
    path = make_ckpt(kind)
    head = PlainHead(path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 22)]
    r = StageRunner(path, max_rows=4, num_speculative_steps=3, use_mtp=True)
    assert [type(b.mixer).__name__ for b in r.model.mtp.layers] == [
        {"attention": "Attention", "moe": "MoE", "mlp": "MLP"}[k] for k in head.pattern]
    rows = [3, 1]
    pre = r.step(StepInput(0, 0, "prefill", rows, [0, 0], [len(p) for p in prompts], sum(prompts, [])))
    emitted = [p + o for p, o in zip(prompts, pre.output_ids)]
    for seq, drafts in zip(emitted, pre.drafts):
        h = hf_hidden(path, seq[:-1], len(seq) - 1)
        assert drafts == head.drafts(seq[1:], h, 3)
    ids = sum(([o[0]] + d for o, d in zip(pre.output_ids, pre.drafts)), [])
    ver = r.step(StepInput(0, 1, "verify", rows, [len(p) for p in prompts], [4, 4], ids, num_drafts=[3, 3]))
    for p, seq, out, drafts in zip(prompts, emitted, ver.output_ids, ver.drafts):
        full = seq + out
        h = hf_hidden(path, full[:-1], len(p))
        assert drafts == head.drafts(full[1:], h, 3)


# ---------------------------------------------------------------- greedy identity
@pytest.fixture(scope="module")
def mtp_refs(make_ckpt):
    refs = {}

    def get(kind):
        if kind not in refs:
            torch.set_num_threads(1)
            path, reqs = make_ckpt(kind), small_workload(seed=4)
            refs[kind] = path, reqs, drive(LLM(path, max_rows=N_REQ), reqs)
        return refs[kind]
    return get


@pytest.mark.parametrize("kind,pp,lanes,design", [("nemotron_h_mtp", 1, 1, "copy"), ("nemotron_h_mtp", 2, 2, "replay"),
                                                  ("nemotron_h_b_mtp", 1, 1, "replay"),
                                                  ("nemotron_h_b_mtp", 2, 2, "copy")])
def test_mtp_speculation_matches_pp1_without_speculation(mtp_refs, kind, pp, lanes, design):
    """MTP drafts at PP1 and PP2 (the head on the last stage, which at PP2 keeps its own copy
    of the embedding), requests joining and leaving: tokens equal PP1 without speculation,
    drafts were verified, every row free afterwards."""
    path, reqs, ref = mtp_refs(kind)
    llm = LLM(path, pp_size=pp, num_micro_batches=lanes, max_rows=N_REQ, speculative_algorithm="mtp",
              num_speculative_steps=3, commit_design=design)
    check_design(llm, design)
    rounds = record_rounds(llm)
    assert drive(llm, reqs) == ref
    assert any(m == "verify" and any(n > 0 for n in nd) for m, _, nd, _ in rounds), "no MTP draft was verified"
    assert all(u == 0 for u in llm.rows_in_use())


# ---------------------------------------------------------------- settings not served
def _edit(src, dst, fn):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit,field", [
    (lambda c: c.update(mtp_hybrid_override_pattern="M*"), "mtp_hybrid_override_pattern has MTP block kinds "
                                                            "['linear_attention'] that are not served"),
    (lambda c: c.update(mtp_hybrid_override_pattern="*E*"), "mtp_hybrid_override_pattern has 2 attention blocks"),
    (lambda c: c.update(mtp_hybrid_override_pattern="*X"), "mtp_hybrid_override_pattern '*X' is not served"),
    (lambda c: (c.pop("mtp_hybrid_override_pattern"), c.update(mtp_layers_block_type=["full_attention", "mamba"])),
     "mtp_layers_block_type has MTP block kinds ['linear_attention'] that are not served"),
    (lambda c: c.update(num_nextn_predict_layers=2), "num_nextn_predict_layers 2 is not served"),
])
def test_an_mtp_setting_not_served_is_refused_naming_file_and_field(make_ckpt, tmp_path, edit, field):
    """Loading the head refuses it with one CheckpointError naming config.json and the field;
    the checkpoint still serves without MTP."""
    path = _edit(Path(make_ckpt("nemotron_h_mtp")), tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        load_stage_model(str(path), with_mtp=True)
    assert str(e.value).startswith(f"{path / 'config.json'}: {field}"), str(e.value)
    with pytest.raises(CheckpointError, match=re.escape(field)):
        LLM(str(path), max_rows=2, speculative_algorithm="mtp")
    _, model = load_stage_model(str(path), with_mtp=False)
    assert not hasattr(model, "mtp")
    assert LLM(str(path), max_rows=2).generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))[0].token_ids


# ---------------------------------------------------------------- real processes
@pytest.mark.slow
@pytest.mark.parametrize("kind,design", [("nemotron_h_mtp", "replay"), ("nemotron_h_b_mtp", "copy")])
def test_stage_processes_with_mtp_match_pp1_without_speculation(mtp_refs, kind, design, tmp_path):
    """PP2 stage processes and a router (tests/cluster.py) drafting with the MTP head, the
    requests sent at once to stages of half as many rows (the later ones join on the rows the
    first leave): every completion equals PP1 without speculation in one process, and every
    row and decoder KV page is free afterwards."""
    import asyncio

    from cluster import Cluster
    from test_nemotron_h import _complete_all

    path, reqs, ref = mtp_refs(kind)
    with Cluster(path, 2, "mtp", log_dir=str(tmp_path), commit_design=design, max_rows=N_REQ // 2) as c:
        outs = asyncio.run(_complete_all(c.url, reqs))
        infos = c.wait_rows_free()
    assert outs == ref
    assert all(i.rows_in_use == 0 for i in infos) and all(i.kv_pages_used == 0 for i in infos)


def _spy_drafts(llm):
    """request id -> the MTP drafts the last stage returned for it, round by round."""
    seen = {}
    orig = llm.scheduler.process

    def process(batch, output_ids, drafts, *a, **kw):
        for r, d in zip(batch.requests, drafts or []):
            if d:
                seen.setdefault(r.request_id, []).append(list(d))
        return orig(batch, output_ids, drafts, *a, **kw)

    llm.scheduler.process = process
    return seen


def test_a_prefix_cache_hit_changes_no_draft(make_ckpt):
    """The prefix cache at PP2 with MTP drafts (snapshots hold the head's KV pages beside the
    Mamba2 state and the decoder's KV): multi-turn replies equal PP1 without speculation or
    cache, prompts hit the cache, every request's drafts of every round are those of the
    same run without the cache, and nothing is held afterwards."""
    from test_prefix_cache import CHUNK, assert_all_free, conversations, multi_turn

    path = make_ckpt("nemotron_h_mtp")
    ref = multi_turn(LLM(path, chunk_size=CHUNK), conversations())[0]
    runs = {}
    for cache in (False, True):
        llm = LLM(path, pp_size=2, speculative_algorithm="mtp", chunk_size=CHUNK, enable_prefix_caching=cache)
        drafts = _spy_drafts(llm)
        replies, cached = multi_turn(llm, conversations())
        assert replies == ref
        runs[cache] = drafts, cached, llm
    drafts, cached, llm = runs[True]
    assert all(c > 0 for c in cached[1]) and all(c > 0 for c in cached[2])
    assert drafts == runs[False][0] and sum(len(d) for d in drafts.values()) > 20
    assert_all_free(llm)
