"""Random tiny checkpoints written by Hugging Face transformers itself (the independent
reference), plus a random ``mtp.*`` head in the published tensor layout."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

VOCAB = 320
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BASE = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    max_position_embeddings=2048, initializer_range=0.1, rms_norm_eps=1e-6,
)

# name -> (model class path, config overrides)
KINDS = {
    # qwen3_next: fused in_proj_qkvz / in_proj_ba, dense MLP every layer (mlp_only_layers)
    "qwen3_next_dense": ("qwen3_next", dict(num_hidden_layers=4, linear_num_value_heads=4, intermediate_size=96,
                                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=48, mlp_only_layers=[0, 1, 2, 3])),
    "qwen3_next_moe": ("qwen3_next", dict(num_hidden_layers=4, linear_num_value_heads=4, intermediate_size=96,
                                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48)),
    # qwen3_5_text with value/key head ratio 1, and ratio 2 with 7 layers (not a multiple of 4)
    "qwen3_5_ratio1": ("qwen3_5_text", dict(num_hidden_layers=4, linear_num_value_heads=2, intermediate_size=96)),
    "qwen3_5_ratio2_7l": ("qwen3_5_text", dict(num_hidden_layers=7, linear_num_value_heads=4, intermediate_size=96)),
    # q/k/v/o biases (attention_bias): the fused q|k|v GEMM carries a bias
    "qwen3_5_bias": ("qwen3_5_text", dict(num_hidden_layers=4, linear_num_value_heads=4, intermediate_size=96,
                                          attention_bias=True)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(num_hidden_layers=4, linear_num_value_heads=4, num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=48)),
}

# Kimi Linear (KDA + MLA + DeepSeek-V3 MoE): 5 layers (PP 2 and 4 split them unevenly) with
# grouped routing; 7 layers with a low-rank query, attention biases and two shared experts
KIMI_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96, moe_intermediate_size=32,
    linear_conv_kernel_dim=4, max_position_embeddings=2048, initializer_range=0.1, rms_norm_eps=1e-6,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
_L, _F = "linear_attention", "full_attention"
KINDS.update({
    "kimi_moe_5l": ("kimi_linear", dict(num_hidden_layers=5, layer_types=[_L, _L, _F, _L, _F], linear_num_heads=2,
                                        linear_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_group=2,
                                        topk_group=1, n_shared_experts=1,
                                        mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"])),
    "kimi_qlora_7l": ("kimi_linear", dict(num_hidden_layers=7, layer_types=[_L, _F, _L, _L, _L, _F, _L], linear_num_heads=4,
                                          linear_head_dim=8, q_lora_rank=24, attention_bias=True, num_local_experts=6,
                                          num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=2,
                                          mlp_layer_types=["dense"] * 2 + ["sparse"] * 5)),
    # dense MLPs only: a stage that CUDA graphs can record (MoE groups tokens on the host)
    "kimi_dense_4l": ("kimi_linear", dict(num_hidden_layers=4, layer_types=[_L, _F, _L, _L], linear_num_heads=2,
                                          linear_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_group=1,
                                          topk_group=1, n_shared_experts=1, mlp_layer_types=["dense"] * 4)),
})


# NemotronH (Mamba2 hybrid): name -> config overrides of NEMOTRON_BASE. "a": 6 blocks (PP 4
# splits them 2/2/1/1), GQA 4:2, 2 groups of B/C; "b": 7 blocks, GQA 6:2, 3 groups, conv width
# 3, projection biases, tied embeddings, 8 experts in 2 routing groups, dt clamped to [0.02, 10]
# in prefill
NEMOTRON_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, head_dim=16, max_position_embeddings=2048, initializer_range=0.1,
    intermediate_size=96, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, chunk_size=16,
)
NEMOTRON_KINDS = {
    "nemotron_h_a": dict(hybrid_override_pattern="M*M-ME", num_attention_heads=4, num_key_value_heads=2,
                         mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4,
                         n_routed_experts=4, num_experts_per_tok=2),
    "nemotron_h_b": dict(hybrid_override_pattern="M-ME*MM", num_attention_heads=6, num_key_value_heads=2,
                         mamba_num_heads=6, mamba_head_dim=12, n_groups=3, ssm_state_size=8, conv_kernel=3,
                         use_bias=True, tie_word_embeddings=True, n_routed_experts=8, num_experts_per_tok=2,
                         n_group=2, topk_group=1, routed_scaling_factor=1.5, time_step_limit=(0.02, 10.0)),
    # MoE blocks with a latent projection (the experts in 40 dims), MLP biases
    "nemotron_h_latent": dict(hybrid_override_pattern="M*E-E", num_attention_heads=4, num_key_value_heads=2,
                              mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4,
                              n_routed_experts=6, num_experts_per_tok=2, moe_latent_size=40, mlp_bias=True),
    # no MoE block
    "nemotron_h_c": dict(hybrid_override_pattern="M*-MM-", num_attention_heads=4, num_key_value_heads=2,
                         mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4),
}

# NemotronH with the MTP head of Nemotron 3 checkpoints: name -> (the NEMOTRON_KINDS
# checkpoint it extends, mtp_hybrid_override_pattern). "*E": attention then MoE, the
# published head's; "E*-" on "b" (tied embeddings, grouped routing, scaled experts): a MoE
# block carrying the input projections, then attention, then an MLP carrying the final norm
NEMOTRON_MTP_KINDS = {
    "nemotron_h_mtp": ("nemotron_h_a", "*E"),
    "nemotron_h_b_mtp": ("nemotron_h_b", "E*-"),
}


# Granite 4.0 hybrid: "a": 4 layers (Mamba2, attention with RoPE, Mamba2, Mamba2), GQA 4:2,
# 4 experts, dt clamped to [0.02, 10] in prefill; "b": 5 layers (PP 2 and 4 split them
# unevenly), no RoPE, no experts, biases, conv width 3, one group, tied embeddings
GRANITE_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, max_position_embeddings=2048, initializer_range=0.1,
    embedding_multiplier=2.0, residual_multiplier=0.6, attention_multiplier=0.3, logits_scaling=1.7,
    mamba_d_state=16, mamba_expand=2, mamba_chunk_size=16, shared_intermediate_size=48,
)
GRANITE_KINDS = {
    "granite_a": dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
                      num_attention_heads=4, num_key_value_heads=2, position_embedding_type="rope",
                      num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, mamba_n_heads=8,
                      mamba_n_groups=2, mamba_d_conv=4, time_step_limit=(0.02, 10.0)),
    "granite_b": dict(num_hidden_layers=5, layer_types=["mamba", "mamba", "attention", "mamba", "attention"],
                      num_attention_heads=4, num_key_value_heads=4, position_embedding_type=None,
                      num_local_experts=0, mamba_n_heads=4, mamba_n_groups=1, mamba_d_conv=3,
                      attention_bias=True, mamba_proj_bias=True, tie_word_embeddings=True),
}


# Bamba: "a": 5 layers (PP 2 to 4 split them unevenly), attention at 1 and 3 with partial
# RoPE, GQA 4:2, 2 groups, dt clamped to [0.05, 5] in prefill; "b": 7 layers, attention at
# 0, 4 and 6, GQA 6:2 with head_dim 16 (not hidden / heads), biases everywhere, conv width
# 3, one group, an explicit mamba_d_head, tied embeddings, its own rope_theta
BAMBA_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, max_position_embeddings=2048, initializer_range=0.1, intermediate_size=96,
    mamba_d_state=16, mamba_expand=2, mamba_chunk_size=16,
)
BAMBA_KINDS = {
    "bamba_a": dict(num_hidden_layers=5, attn_layer_indices=[1, 3], num_attention_heads=4, num_key_value_heads=2,
                    mamba_n_heads=8, mamba_n_groups=2, mamba_d_conv=4, time_step_limit=(0.05, 5.0)),
    "bamba_b": dict(num_hidden_layers=7, attn_layer_indices=[0, 4, 6], num_attention_heads=6, num_key_value_heads=2,
                    head_dim=16, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_conv=3,
                    attention_bias=True, mlp_bias=True, mamba_proj_bias=True, tie_word_embeddings=True,
                    rope_parameters=dict(rope_type="default", rope_theta=5000.0, partial_rotary_factor=0.5)),
}

# Falcon-H1 (attention and Mamba2 side by side in every layer), every multiplier away from 1:
# "a": 5 layers, GQA 4:2, Mamba2 width mamba_d_ssm 64 (not 2 x hidden), 2 groups, the gated
# norm before the gate; "b": 6 layers, GQA 6:2 with head_dim 16, no Mamba2 norm (the gate
# alone), width 2 x hidden, biases everywhere, conv width 3, tied embeddings
FALCON_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, max_position_embeddings=2048, initializer_range=0.1, intermediate_size=96,
    mamba_d_state=16, mamba_expand=2, mamba_chunk_size=16, embedding_multiplier=1.5, lm_head_multiplier=0.7,
    mlp_multipliers=[0.8, 1.3], key_multiplier=0.9, attention_in_multiplier=1.2, attention_out_multiplier=0.8,
    ssm_multipliers=[0.9, 1.1, 0.7, 1.2, 0.6], ssm_in_multiplier=1.1, ssm_out_multiplier=0.9,
)
FALCON_KINDS = {
    "falcon_h1_a": dict(num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
                        mamba_d_ssm=64, mamba_n_groups=2, mamba_d_conv=4, mamba_rms_norm=True,
                        mamba_norm_before_gate=True, time_step_limit=(0.05, 5.0)),
    "falcon_h1_b": dict(num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                        mamba_n_heads=8, mamba_d_ssm=None, mamba_n_groups=1, mamba_d_conv=3, mamba_rms_norm=False,
                        attention_bias=True, mlp_bias=True, mamba_proj_bias=True, projectors_bias=True,
                        tie_word_embeddings=True),
}


def _make_nemotron(kind: str, path: str, seed: int) -> None:
    """A random NemotronH, Granite 4.0 hybrid, Bamba or Falcon-H1 checkpoint. transformers
    initialises biases to zero, D and norm weights to ones and the router's correction bias
    to zero: random ones, so that a misplaced one shows."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind in GRANITE_KINDS:
        model = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(**{**GRANITE_BASE, **GRANITE_KINDS[kind]}))
    elif kind in BAMBA_KINDS:
        model = tf.BambaForCausalLM(tf.BambaConfig(**{**BAMBA_BASE, **BAMBA_KINDS[kind]}))
    elif kind in FALCON_KINDS:
        model = tf.FalconH1ForCausalLM(tf.FalconH1Config(**{**FALCON_BASE, **FALCON_KINDS[kind]}))
    else:
        model = tf.NemotronHForCausalLM(tf.NemotronHConfig(**{**NEMOTRON_BASE, **NEMOTRON_KINDS[kind]}))
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", ".D")):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.normal_(1.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(path)


def _model_class(model_type: str):
    import transformers as tf

    if model_type == "kimi_linear":
        return tf.KimiLinearConfig, tf.KimiLinearForCausalLM
    if model_type == "qwen3_next":
        return tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM
    if model_type == "qwen3_5_text":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        return Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM


def add_random_mtp(path: str, seed: int = 0) -> None:
    """Append a random one-layer MTP head (``mtp.*`` names of published Qwen3.5 /
    Qwen3-Next checkpoints) and set ``mtp_num_hidden_layers`` in config.json."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    weights = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    attn_layer = cfg["layer_types"].index("full_attention")
    mtp = {}
    for k, v in weights.items():
        prefix = f"model.layers.{attn_layer}."
        if k.startswith(prefix):
            mtp["mtp.layers.0." + k[len(prefix):]] = v.clone() + 0.05 * torch.randn(v.shape, generator=g)
    h = cfg["hidden_size"]
    mtp["mtp.fc.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{n}.weight"] = 0.1 * torch.randn(h, generator=g)
    weights.update(mtp)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg["mtp_num_hidden_layers"] = 1
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"), indent=2)


def add_random_nemotron_mtp(path: str, pattern: str, seed: int = 0) -> None:
    """Append a random NemotronH MTP head (``mtp.layers.{i}.*``, the names of NVIDIA's
    Nemotron 3 checkpoints: block i as the decoder's blocks of its kind, the first with
    ``enorm`` / ``hnorm`` / ``eh_proj``, the last with ``final_layernorm``, experts one tensor
    each) and set ``num_nextn_predict_layers`` 1 and ``mtp_hybrid_override_pattern`` in
    config.json, as those checkpoints do. Block i's tensors are those of the decoder's first
    block of its kind plus noise: its kind must be in the decoder's pattern."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    weights = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)
    decoder = cfg["layers_block_type"]
    kinds = {"*": "full_attention", "E": "moe", "-": "mlp", "M": "linear_attention"}
    h = cfg["hidden_size"]
    mtp = {}
    for i, c in enumerate(pattern):
        src = f"backbone.layers.{decoder.index(kinds[c])}."
        for k, v in weights.items():
            if k.startswith(src):
                mtp[f"mtp.layers.{i}." + k[len(src):]] = v.clone() + 0.05 * torch.randn(v.shape, generator=g)
    last = len(pattern) - 1
    for name in ("mtp.layers.0.enorm", "mtp.layers.0.hnorm", f"mtp.layers.{last}.final_layernorm"):
        mtp[name + ".weight"] = 1.0 + 0.2 * torch.randn(h, generator=g)
    mtp["mtp.layers.0.eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    weights.update(mtp)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg.pop("mtp_layers_block_type", None)
    cfg["num_nextn_predict_layers"] = 1
    cfg["mtp_hybrid_override_pattern"] = pattern
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"), indent=2)


def add_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer of VOCAB ids (bytes, a few merges, ChatML specials), with
    ``<|im_end|>`` as EOS in config.json: enough for the HTTP API to render and decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["The quick brown fox jumps over the lazy dog. Hello world, how are you today?"] * 50
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    assert len(fast) <= VOCAB
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["eos_token_id"] = fast.convert_tokens_to_ids("<|im_end|>")
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"), indent=2)


def make_checkpoint(kind: str, root: str, seed: int = 0, mtp: bool = True) -> str:
    """Write checkpoint ``kind`` (see KINDS) under ``root``; returns its folder."""
    path = os.path.join(root, kind)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if kind in {**NEMOTRON_KINDS, **GRANITE_KINDS, **BAMBA_KINDS, **FALCON_KINDS}:  # no MTP head in these
        _make_nemotron(kind, path, seed)
        add_tokenizer(path)
        return path
    if kind in NEMOTRON_MTP_KINDS:
        base, pattern = NEMOTRON_MTP_KINDS[kind]
        _make_nemotron(base, path, seed)
        add_random_nemotron_mtp(path, pattern, seed)
        add_tokenizer(path)
        return path
    model_type, over = KINDS[kind]
    cfg_cls, model_cls = _model_class(model_type)
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**(KIMI_BASE if model_type == "kimi_linear" else BASE), **over})
    model = model_cls(cfg).eval()
    if model_type == "kimi_linear":
        mtp = False  # no MTP head in Kimi Linear checkpoints
        with torch.no_grad():  # transformers zeroes the router's correction bias: a random one shows misuse
            for name, p in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    p.normal_(0.0, 0.2)
    if getattr(cfg, "attention_bias", False):
        # transformers initialises biases to zero: random ones, so that a misplaced one shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    if mtp:
        add_random_mtp(path, seed)
    add_tokenizer(path)
    return path
