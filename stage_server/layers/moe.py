"""Mixture-of-experts blocks that model families share: experts stacked in two tensors,
and their run over routed tokens.

An expert is ``down_proj(act(gate_up_proj x))``; :class:`ExpertAct` says what ``act`` does
with the first projection's rows: :data:`SWIGLU` (``silu(gate) * up`` of its two halves:
Qwen3-Next, Kimi Linear, Granite 4.0 hybrid) or :data:`RELU2` (``relu(up)^2``, no gate:
NemotronH). The experts carry it as ``act`` (:func:`expert_act`; SwiGLU where they do not),
and every run below applies it the same way.

Three runs of the same sum, one per place (:func:`routed_experts` picks):

- :func:`run_experts` (CPU): the tokens grouped by expert, one GEMM pair per expert that
  has tokens; it reads the group sizes on the host, once per layer.
- :func:`experts_grouped` (CUDA, bf16, Hopper / Blackwell): the same grouping on the
  device and one grouped GEMM per projection (``torch._grouped_mm``, CUTLASS; its group
  bounds are a device tensor), so no host read: CUDA-graph capturable, and only the chosen
  experts' weights are read.
- :func:`experts_dense` (CUDA otherwise, e.g. fp32, and only while a CUDA graph is being
  captured): every expert on every token, the unchosen ones weighted 0. Also capturable;
  it reads every expert's weights and does ``E / k`` times the FLOPs, the price of a graph
  where the grouped GEMM does not run. Eager CUDA steps there (long prefill chunks) keep
  :func:`run_experts`: at 2048 tokens and 512 experts the dense run's buffers alone would
  be GiBs.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ppspec.kernels.activation import silu_mul


class ExpertAct(NamedTuple):
    """An expert's activation between its two projections: ``fn`` maps the first
    projection's output ``[N, gates * I]`` to the down projection's input ``[N, I]``;
    ``gates``: the first projection's rows per intermediate unit (2: gate and up halves, 1:
    up alone)."""

    gates: int
    fn: Callable[[torch.Tensor], torch.Tensor]


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return silu_mul(gate, up)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)^2`` (transformers' ``ReLUSquaredActivation``)."""
    return torch.square(F.relu(x))


SWIGLU = ExpertAct(2, _swiglu)  # silu(gate) * up, [gate | up] = gate_up_proj x
RELU2 = ExpertAct(1, relu2)  # relu(up)^2, up = gate_up_proj x (NemotronH's non-gated experts)


def expert_act(experts) -> ExpertAct:
    """The experts' activation: their ``act``, SwiGLU where they carry none."""
    return getattr(experts, "act", SWIGLU)


class Experts(nn.Module):
    """SwiGLU expert weights stacked: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
    from the config's ``num_experts`` (E), ``moe_intermediate_size`` (I), ``hidden_size`` (H)."""

    act = SWIGLU

    def __init__(self, cfg):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))


def run_experts(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, experts: Experts) -> torch.Tensor:
    """``sum_j top_w[t, j] * expert_{top_i[t, j]}(x_t)``, each expert ``down_proj(act(gate_up_proj
    x))`` (``act``: :func:`expert_act`): x ``[T, hidden]``, top_i ``[T, k]`` int64, top_w
    ``[T, k]`` (the product in torch's promotion of top_w and the experts' output). Returns
    ``[T, hidden]`` in x's dtype."""
    k = top_i.shape[-1]
    act = expert_act(experts).fn
    # group the (token, slot) pairs by expert on the device; one host read of the group
    # sizes per layer (not one per expert) decides which expert GEMMs run
    flat = top_i.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.down_proj.shape[0]).tolist()
    tok = order // k
    xs, ws = x[tok], top_w.flatten()[order, None]
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n:
            ys.append(F.linear(act(F.linear(xs[start:start + n], experts.gate_up_proj[e])), experts.down_proj[e]))
            start += n
    if not ys:
        return torch.zeros_like(x)
    return torch.zeros_like(x).index_add_(0, tok, (torch.cat(ys) * ws).to(x.dtype))


def experts_grouped(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, experts: Experts) -> torch.Tensor:
    """:func:`run_experts` without a host read: the ``T k`` (token, slot) pairs sorted by
    expert on the device, each expert's rows bounded by ``searchsorted`` (``bincount``
    would read its maximum on the host), both projections as one grouped GEMM each (an
    expert without rows costs nothing), the pairs put back in (token, slot) order and
    summed with their weights in fp32. Shapes as :func:`run_experts`."""
    T, k = top_i.shape
    E = experts.down_proj.shape[0]
    if T == 0:
        return torch.zeros_like(x)
    act = expert_act(experts).fn
    ids, order = torch.sort(top_i.flatten())
    ends = torch.searchsorted(ids, torch.arange(E, device=ids.device, dtype=ids.dtype), right=True, out_int32=True)
    xs = x.index_select(0, order // k)
    h = act(torch._grouped_mm(xs, experts.gate_up_proj.transpose(1, 2), offs=ends))
    ys = torch._grouped_mm(h, experts.down_proj.transpose(1, 2), offs=ends)
    pairs = torch.empty_like(ys).index_copy_(0, order, ys).view(T, k, -1)
    return (pairs * top_w.unsqueeze(-1)).sum(1).to(x.dtype)


def experts_dense(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, experts: Experts) -> torch.Tensor:
    """:func:`run_experts` as fixed-shape dense work: every expert on every token (one GEMM
    over the stacked ``[E gI, H]`` first projections, the activation, one batched GEMM for
    the down projections), then the per-expert outputs summed with weights ``[T, E]`` that
    are ``top_w`` at the chosen experts and 0 elsewhere. Shapes as :func:`run_experts`."""
    T, H = x.shape
    E, I2, _ = experts.gate_up_proj.shape
    act = expert_act(experts)
    w = torch.zeros(T, E, dtype=top_w.dtype, device=x.device).scatter_(1, top_i, top_w)
    h = act.fn(F.linear(x, experts.gate_up_proj.reshape(E * I2, H)).view(T * E, I2)).view(T, E, I2 // act.gates)
    ys = torch.bmm(h.transpose(0, 1), experts.down_proj.transpose(1, 2))  # [E, T, H]
    return (ys * w.t().unsqueeze(-1)).sum(0).to(x.dtype)


@functools.cache
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def grouped_gemm_runs(x: torch.Tensor, experts: Experts) -> bool:
    """Whether ``torch._grouped_mm`` takes its CUTLASS kernel for these experts: CUDA, bf16,
    compute capability 9 or 10, rows 16-byte aligned (hidden and intermediate sizes
    multiples of 8), and ``PPSPEC_MOE_GROUPED`` not ``0`` (without it, e.g. to compare: the
    dense run in a graph capture, the host's grouping in eager steps). Elsewhere it falls back to a loop that copies the group bounds to the
    host, which a CUDA graph cannot hold."""
    _, I2, H = experts.gate_up_proj.shape
    inter = I2 // expert_act(experts).gates
    if os.environ.get("PPSPEC_MOE_GROUPED", "1") == "0" or not x.is_cuda or not hasattr(torch, "_grouped_mm"):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return (x.dtype == experts.gate_up_proj.dtype == torch.bfloat16 and H % 8 == 0 and inter % 8 == 0
            and _sm_major(index) in (9, 10))


def pick_experts(x: torch.Tensor, experts: Experts):
    """The run of :func:`routed_experts` for ``x``'s device and dtype, and whether a CUDA
    graph is being captured (module docstring)."""
    if not x.is_cuda:
        return run_experts
    if grouped_gemm_runs(x, experts):
        return experts_grouped
    return experts_dense if torch.cuda.is_current_stream_capturing() else run_experts


def routed_experts(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, experts: Experts) -> torch.Tensor:
    """``sum_j top_w[t, j] * expert_{top_i[t, j]}(x_t)`` as :func:`run_experts` (shapes and
    dtypes), by the run :func:`pick_experts` chooses: on CUDA without a host read (CUDA-graph
    capturable). ``top_i`` holds distinct experts per token (a top-k)."""
    return pick_experts(x, experts)(x, top_i, top_w, experts)
