"""The shipped demo checkpoint (models/qwen35-demo) and its training script's data path.

CPU only, no training: loads the committed checkpoint with transformers and checks that it
generates, that its tokenizer and chat template behave, that its MTP tensors have the published
Qwen3.5 layout, and that the training command refuses a bad dataset without touching a checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "models" / "qwen35-demo"
sys.path.insert(0, str(ROOT / "models"))

import train_demo  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(CKPT))


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(CKPT), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def config():
    return json.loads((CKPT / "config.json").read_text())


def sharegpt_prompt() -> str:
    """The first user turn of the first ShareGPT V3 record (read from the start of the file)."""
    path = train_demo.default_dataset_path()
    with open(path, encoding="utf-8") as f:
        head = f.read(1 << 16)
    record, _ = json.JSONDecoder().raw_decode(head, head.index("{"))
    return next(t["value"] for t in record["conversations"] if t["from"] == "human")


# --------------------------------------------------------------------------------------------
# Checkpoint files and architecture
# --------------------------------------------------------------------------------------------


def test_checkpoint_files_and_size():
    names = {p.name for p in CKPT.iterdir()}
    for required in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "README.md"):
        assert required in names
    total = sum(p.stat().st_size for p in CKPT.rglob("*") if p.is_file())
    assert total <= 24 * 2**20, f"checkpoint is {total / 2**20:.1f} MiB"


def test_config_keeps_the_real_architecture(config):
    assert config["model_type"] == "qwen3_5_text"
    types = config["layer_types"]
    assert len(types) == config["num_hidden_layers"]
    assert types == (["linear_attention"] * 3 + ["full_attention"]) * (len(types) // 4)
    assert config["linear_num_value_heads"] > config["linear_num_key_heads"]
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert config["mtp_num_hidden_layers"] == 1
    gen = json.loads((CKPT / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == [0, 2]  # <|endoftext|>, <|im_end|>


def test_weights_are_bfloat16_and_match_the_config(config):
    with safe_open(str(CKPT / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in keys)
        q = f.get_slice("model.layers.3.self_attn.q_proj.weight").get_shape()
        qkv = f.get_slice("model.layers.0.linear_attn.in_proj_qkv.weight").get_shape()
    h, hd = config["hidden_size"], config["head_dim"]
    assert q == [2 * config["num_attention_heads"] * hd, h]  # gated attention: query + gate
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    val_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    assert qkv == [2 * key_dim + val_dim, h]


def test_every_mtp_tensor_has_the_shape_the_config_implies(config):
    h, hd, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    lay = "mtp.layers.0."
    expected = {
        "mtp.fc.weight": [h, 2 * h],
        "mtp.pre_fc_norm_embedding.weight": [h],
        "mtp.pre_fc_norm_hidden.weight": [h],
        "mtp.norm.weight": [h],
        lay + "input_layernorm.weight": [h],
        lay + "post_attention_layernorm.weight": [h],
        lay + "self_attn.q_proj.weight": [2 * nq * hd, h],
        lay + "self_attn.k_proj.weight": [nkv * hd, h],
        lay + "self_attn.v_proj.weight": [nkv * hd, h],
        lay + "self_attn.o_proj.weight": [h, nq * hd],
        lay + "self_attn.q_norm.weight": [hd],
        lay + "self_attn.k_norm.weight": [hd],
        lay + "mlp.gate_proj.weight": [inter, h],
        lay + "mlp.up_proj.weight": [inter, h],
        lay + "mlp.down_proj.weight": [h, inter],
    }
    with safe_open(str(CKPT / "model.safetensors"), "pt") as f:
        got = {k: f.get_slice(k).get_shape() for k in f.keys() if k.startswith("mtp.")}
    assert got == expected
    # the training script's own table agrees with this independent one
    assert {k: list(v) for k, v in train_demo.expected_mtp_shapes(_cfg_obj()).items()} == expected


def _cfg_obj():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(CKPT))


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


def test_greedy_continuation_of_a_sharegpt_prompt_is_readable(tok, model):
    prompt = sharegpt_prompt()
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
        cont = out[:, ids.shape[1]:]
        assert cont.shape[1] >= 8
        # perplexity of the model's own continuation, scored by a separate full forward pass
        logits = model(out).logits[0, ids.shape[1] - 1: -1]
        nll = torch.nn.functional.cross_entropy(logits.float(), cont[0])
    ppl = math.exp(float(nll))
    reply = tok.decode(cont[0], skip_special_tokens=True)
    assert ppl < 5.0, (ppl, reply)  # measured 2.4; an untrained model gives thousands
    assert len(reply) >= 20, reply
    letters = sum(c.isascii() and (c.isalpha() or c == " ") for c in reply)
    assert letters / len(reply) >= 0.6, reply  # measured 0.78 (the rest: digits, quotes, newlines)
    assert sum(c.isascii() for c in reply) / len(reply) >= 0.95, reply


def test_mtp_head_agrees_with_the_base_greedy_token_two_ahead(tok, model):
    """The reference MTPHead, loaded from the checkpoint, predicts the base's own next-next token."""
    head, base = train_demo.load_mtp_head(CKPT, base_model=model)
    text = train_demo.render_chatml([
        {"role": "user", "content": "Can you explain what a hash table is and when to use one?"},
        {"role": "assistant", "content": "A hash table is a data structure that stores key-value "
         "pairs. It uses a hash function to compute an index into an array of buckets, from which "
         "the desired value can be found. Hash tables are useful when you need fast lookups, "
         "insertions and deletions, for example to count words in a document or to cache results."},
    ])
    ids = tok(text, return_tensors="pt").input_ids
    t = ids.shape[1]
    with torch.no_grad():
        logits, hidden = train_demo.base_forward_with_pre_norm_hidden(base, ids)
        greedy = logits.argmax(-1)  # greedy[p]: base's choice for token p+1
        pos = torch.arange(t - 1)[None]
        mtp = head(ids[:, 1:], hidden[:, :-1], pos).argmax(-1)  # for token p+2
        agree = (mtp == greedy[:, 1:]).float().mean().item()
        # causal: position p must not see later tokens
        mtp_prefix = head(ids[:, 1:20], hidden[:, :19], pos[:, :19]).argmax(-1)
    assert torch.equal(mtp_prefix, mtp[:, :19])
    assert agree > 0.3, agree


# --------------------------------------------------------------------------------------------
# Tokenizer and chat template
# --------------------------------------------------------------------------------------------


UNICODE_SAMPLES = [
    "Hello, world!  Two  spaces, a\ttab and\nnew lines.\r\n",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇯🇵 keycap 1️⃣",
    "中文：你好，世界。日本語のテキスト、한국어 텍스트",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u0361\u0334",
    "precomposed vs decomposed: \u00e9 / e\u0301, Åström, Ǆ, ﬁ ligature",
    "RTL: مرحبا بالعالم — שלום עולם",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∀x∈ℝ: x² ≥ 0; zero-width\u200bspace, BOM\ufeff, NBSP\u00a0",
    " leading space and trailing space ",
]


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_tokenizer_round_trips_unicode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


def test_tokenizer_round_trips_random_codepoints(tok):
    rng = random.Random(1234)
    ranges = [(0x20, 0x7E), (0xA0, 0x2FF), (0x300, 0x36F), (0x400, 0x4FF), (0x4E00, 0x9FFF),
              (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x10000, 0x1FFFF)]
    for _ in range(50):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        text = "".join(chars)
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


def test_special_tokens(tok):
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert len(tok) == 8192
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)[0] == 1
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)[-1] == 2


def test_chat_template_renders_two_turns_in_chatml(tok):
    msgs = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n4.<|im_end|>\n"
                    "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                    "<|im_start|>assistant\n6.<|im_end|>\n")
    assert text == train_demo.render_chatml(msgs)  # what the model was trained on
    ids = tok(text, add_special_tokens=False).input_ids
    starts = [i for i, t in enumerate(ids) if t == 1]
    ends = [i for i, t in enumerate(ids) if t == 2]
    assert len(starts) == len(ends) == 4 and starts[0] == 0
    assert all(s < e for s, e in zip(starts, ends)) and all(e < s for e, s in zip(ends, starts[1:]))
    gen = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert gen == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------------------------
# Dataset loading and the bad-input path
# --------------------------------------------------------------------------------------------


def _rec(i):
    return {"id": f"abc{i}_0", "conversations": [{"from": "human", "value": f"question {i}"},
                                                 {"from": "gpt", "value": f"answer {i}"}]}


def test_truncated_tail_is_dropped(tmp_path):
    body = json.dumps([_rec(0), _rec(1), _rec(2)], indent=2)
    cut = body[: body.rindex("answer 2") + 3]  # cut inside the last record's string
    path = tmp_path / "cut.json"
    path.write_text(cut)
    recs = train_demo.load_sharegpt(path)
    assert [r["id"] for r in recs] == ["abc0_0", "abc1_0"]


@pytest.mark.parametrize("content", [None, "", "not json at all", '[{"id": "x", "conversations": [{"fr',
                                     b"\xff\xfe\x00garbage"])
def test_bad_dataset_gives_one_clear_message_naming_the_file(tmp_path, content):
    path = tmp_path / "ShareGPT_bad.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(train_demo.DatasetError) as e:
        train_demo.load_sharegpt(path)
    assert str(path) in str(e.value)


def test_bad_dataset_never_touches_an_existing_checkpoint(tmp_path, capsys):
    out = tmp_path / "qwen35-demo"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"good weights")
    (out / "config.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    work = tmp_path / "work"
    bad = tmp_path / "corrupt.json"
    bad.write_text('[{"id": "a_0", "conversations": [{"from": "human", "value": "cut off')
    rc = train_demo.main(["--out", str(out), "--work", str(work), "--dataset", str(bad)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and str(bad) in err and err.startswith("error:")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.json", "qwen35-demo"]
    rc = train_demo.main(["--out", str(out), "--work", str(work), "--dataset", str(tmp_path / "nope.json")])
    assert rc == 2 and "nope.json" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
