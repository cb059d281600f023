"""NemotronH hybrid decoder, one pipeline stage's slice of it.

Layers follow Hugging Face transformers 5.25's ``modeling_nemotron_h``: each block is
``x + mixer(rmsnorm(x))`` with one mixer per block, chosen by the checkpoint's pattern: a
Mamba2 mixer (``stage_server.layers.mamba2``: SSD scan with grouped B/C, D skip, a gated
group RMSNorm), attention without
positional encoding, a relu2 MLP, or a MoE of relu2 experts (sigmoid router with a score
correction bias and group-limited top-k, as DeepSeek-V3's) with a shared expert. Module and
parameter names equal the checkpoint's (without its ``backbone.`` prefix), so loading is a
name lookup (``weights.py``).

Tokens of a micro-batch are packed without padding (``[T, hidden]``) as in
the other families; conv windows, SSM states and KV live in pools addressed by
``req_pool_index`` (``stage_server.pools``), never by batch position.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...layers.attention import Attention
from ...layers.common import RMSNorm
from ...graphs import family_graphs
from ...layers.mamba2 import MAMBA2, Mamba2Mixer
from ...layers.moe import RELU2, relu2, routed_experts
from .config import NemotronHConfig


class MLP(nn.Module):
    """``down_proj(relu(up_proj(x))^2)`` (``NemotronHMLP``; no gate)."""

    def __init__(self, hidden: int, inter: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class TopkRouter(nn.Module):
    """Sigmoid scores; experts chosen by score plus ``e_score_correction_bias`` among the
    ``topk_group`` best of ``n_group`` groups (a group's worth: its two best scores), weighted
    by the plain scores, renormalised (``norm_topk_prob``) and scaled by
    ``routed_scaling_factor`` (``NemotronHTopkRouter``; DeepSeek-V3's routing). fp32."""

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(e, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e))
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, hidden]``. Returns ``(weights [T, k] fp32, experts [T, k] int64)``."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            E = choice.shape[-1]
            grouped = choice.view(-1, self.n_group, E // self.n_group)
            best = grouped.topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, idx


class Experts(nn.Module):
    """Expert weights stacked: ``up_proj [E, I, in]``, ``down_proj [E, in, I]`` (``in``: the
    hidden size, or ``moe_latent_size`` with a latent projection); relu2 experts without a
    gate for ``layers.moe``'s runs (``act``; ``gate_up_proj``, their name for the first
    projection, is ``up_proj``)."""

    act = RELU2

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        d = cfg.moe_latent_size or cfg.hidden_size
        self.up_proj = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.moe_intermediate_size, d))
        self.down_proj = nn.Parameter(torch.zeros(cfg.n_routed_experts, d, cfg.moe_intermediate_size))

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self.up_proj


class MoE(nn.Module):
    """Routed relu2 experts plus a shared relu2 expert on the block input (``NemotronHMoE``);
    the routed ones run by ``layers.moe.routed_experts`` (no host read on CUDA)."""

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias)
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(cfg.moe_latent_size, cfg.hidden_size, bias=cfg.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = routed_experts(h, idx, w, self.experts)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)


class Block(nn.Module):
    """``x + mixer(norm(x))`` (``NemotronHBlock``). The residual stream travels as a pair
    ``(h, residual)`` whose sum it is, as in ``stage_server.model.DecoderLayer``."""

    def __init__(self, cfg: NemotronHConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(cfg)
        elif kind == "full_attention":
            self.mixer = Attention(cfg)  # no positional encoding, no biases (NemotronHAttention)
        elif kind == "moe":
            self.mixer = MoE(cfg)
        else:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, meta, state, residual: torch.Tensor | None = None):
        if residual is None:
            h, residual = self.norm(x), x
        else:
            h, residual = self.norm(x, residual=residual)
        if self.kind in ("linear_attention", "full_attention"):
            return self.mixer(h, meta, state), residual
        return self.mixer(h), residual


class MTPHead(nn.Module):
    """The multi-token-prediction head of Nemotron 3 checkpoints (``mtp.layers.{i}.*``; the
    layout vLLM's ``nemotron_h_mtp`` and TensorRT-LLM read): the decoder's own blocks in
    ``cfg.mtp_layer_types`` order (e.g. attention then MoE), the first also holding
    ``enorm`` / ``hnorm`` / ``eh_proj``, the last ``final_layernorm``.

    At position p: ``u = eh_proj(cat(enorm(embed(x[p+1])), hnorm(h_p)))`` runs through the
    blocks (one residual stream, as the decoder's); ``final_layernorm`` of the stream, through
    the shared ``lm_head``, predicts ``x[p+2]``. ``h_p`` is the target's last block output
    before ``norm_f``; a chain's next step takes the head's normed output, as vLLM chains it.
    The attention block (at most one) keeps its KV in the head's pool (``mtp_kv``).
    """

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layers = nn.ModuleList([Block(cfg, kind) for kind in cfg.mtp_layer_types])
        first, last = self.layers[0], self.layers[-1]
        first.enorm, first.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        first.eh_proj = nn.Linear(2 * h, h, bias=False)
        last.final_layernorm = RMSNorm(h, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, meta, kv) -> torch.Tensor:
        """embeds, hidden ``[T, hidden]``; kv: the head's ``(k_cache, v_cache)``. Returns the
        head's normed output ``[T, hidden]``."""
        first = self.layers[0]
        x = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(hidden)], dim=-1))
        residual = None
        for block in self.layers:
            x, residual = block(x, meta, kv if block.kind == "full_attention" else None, residual)
        return self.layers[-1].final_layernorm(x, residual=residual)[0]


class NemotronHStageModel(nn.Module):
    """Blocks ``[start, end)`` plus the embedding (first stage) and the final norm,
    ``lm_head`` and, with ``with_mtp``, the MTP head (last stage); the stage model of
    ``stage_server.family.ModelFamily``. Parameter names equal the checkpoint's without its
    prefix (``backbone.``); the head's are the checkpoint's ``mtp.*``."""

    def __init__(self, cfg: NemotronHConfig, start: int, end: int, with_mtp: bool = False):
        super().__init__()
        self.cfg, self.start, self.end = cfg, start, end
        self.is_first, self.is_last = start == 0, end == cfg.num_hidden_layers
        if self.is_first:
            self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(cfg, cfg.layer_types[i]) for i in range(start, end)})
        if self.is_last:
            self.norm_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if with_mtp:
                self.mtp = MTPHead(cfg)
                if not self.is_first:
                    # the head embeds the token it conditions on: a stage past the first
                    # keeps its own copy of the (shared) embedding for it
                    self.mtp_embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The token embedding (first stage only; the runner's name for it)."""
        if "embeddings" not in self._modules:
            raise AttributeError("embed_tokens: only the first stage holds the embedding")
        return self._modules["embeddings"]

    layer_family = MAMBA2  # the recurrent layers' family (stage_server.family.LayerFamily)
    shared_kv = False
    # the Mamba2 prefill's chunked scan (plain torch on CUDA) reads sequence bounds on the host
    prefill_capturable = False

    @property
    def capturable(self) -> bool:
        """Decode / verify in CUDA graphs: unless ``PPSPEC_FAMILY_GRAPHS=0``
        (``graphs.family_graphs``). The MoE blocks run their experts without a host read on
        CUDA (``layers.moe.routed_experts``)."""
        return family_graphs()

    @property
    def state_layers(self) -> list[int]:
        """The stage's Mamba2 blocks (global indices), in pool order."""
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] == "linear_attention"]

    @property
    def kv_layers(self) -> list[int]:
        """The stage's attention blocks, with paged KV."""
        return [i for i in range(self.start, self.end) if self.cfg.layer_types[i] == "full_attention"]

    def fuse_projections(self) -> None:
        """Attention q/k/v into one GEMM; Mamba2 conv weights tap-major. After loading."""
        for m in self.modules():
            if isinstance(m, (Mamba2Mixer, Attention)):
                m.fuse_projections()

    def finish_load(self, device) -> None:
        """After the weights are loaded (``loader.load_stage_model``): projections fused (no
        buffer to rebuild: the attention has no RoPE)."""
        self.fuse_projections()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if self.is_first else self.mtp_embed_tokens)(input_ids)

    def forward(self, meta, hidden: torch.Tensor, layer_states: dict) -> torch.Tensor:
        """Run this stage's blocks. layer_states: global layer index -> ``LayerState``
        (Mamba2) or ``(k_cache, v_cache)`` (attention); MLP / MoE blocks hold none.
        Returns ``[T, hidden]``, the residual stream after block ``end - 1``."""
        residual = None
        for i, layer in self.layers.items():
            hidden, residual = layer(hidden, meta, layer_states.get(int(i)), residual)
        return hidden + residual

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``lm_head(norm_f(hidden))``; ``upcast`` as ``StageModel.logits``."""
        logits = self.lm_head(self.norm_f(hidden))
        return logits.float() if upcast else logits

    def mtp_logits(self, mtp_hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """The MTP head's logits from its (normed) output ``[N, hidden]``: ``lm_head`` alone;
        ``upcast`` as in :meth:`logits`."""
        logits = self.lm_head(mtp_hidden)
        return logits.float() if upcast else logits
