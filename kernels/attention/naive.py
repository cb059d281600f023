"""Plain-torch paged attention: KV store by slot and causal attention over paged KV.

A row's tokens live in pages of ``page_size`` tokens; ``page_table[row, i]`` is the page
holding positions ``i * page_size .. (i + 1) * page_size - 1``. A token's flat slot is
``page * page_size + position % page_size``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k, v`` (``[T, Hkv, hd]``) at flat ``slots`` (``[T]`` int64) of the
    ``[num_pages, page_size, Hkv, hd]`` caches."""
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


def check_gate(q: torch.Tensor, gate: torch.Tensor | None) -> None:
    """Raise ValueError unless ``gate`` is None or has q's shape, dtype and device (a
    broadcast or a promoted dtype would pass the reference silently)."""
    if gate is not None and (gate.shape != q.shape or gate.dtype != q.dtype or gate.device != q.device):
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} on {gate.device} must match q "
                         f"{tuple(q.shape)} {q.dtype} on {q.device}")


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over each request's paged KV, optionally with
    an output gate.

    Args:
        q: ``[T, Hq, hd]``; the ``L_b`` queries of request b sit at the last ``L_b``
            positions of its ``kv_lens[b]`` cached tokens (their KV already stored).
        k_cache, v_cache: ``[num_pages, page_size, Hkv, hd]``; Hq a multiple of Hkv.
        page_table: ``[rows + 1, max_pages]`` int64. req_pool_indices: ``[B]``.
        kv_lens: ``[B]`` tokens in the cache per request, new ones included.
        cu_seqlens_q: ``[B + 1]``. scale: softmax scale (``hd ** -0.5``).
        gate: None, or ``[T, Hq, hd]`` in q's dtype (a strided view is fine): the output
            becomes ``attn * sigmoid(gate)`` (Qwen3-Next's gated attention), the attention
            output, the sigmoid and the product each rounded to q's dtype (torch's ops).

    Returns:
        ``[T, Hq, hd]`` in q's dtype; softmax in fp32.

    Raises:
        ValueError: a gate that does not match q.
    """
    check_gate(q, gate)
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    kflat = k_cache.view(-1, *k_cache.shape[2:])
    vflat = v_cache.view(-1, *v_cache.shape[2:])
    bounds = cu_seqlens_q.tolist()
    for b, (row, n) in enumerate(zip(req_pool_indices.tolist(), kv_lens.tolist())):
        pos = torch.arange(n, device=q.device)
        slots = page_table[row, pos // page_size] * page_size + pos % page_size
        kk, vv = kflat[slots].float(), vflat[slots].float()  # [n, Hkv, hd]
        qq = q[bounds[b] : bounds[b + 1]].float()  # [L, Hq, hd]
        L = qq.shape[0]
        rep = qq.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        qpos = torch.arange(n - L, n, device=q.device)
        mask = pos.unsqueeze(0) <= qpos.unsqueeze(1)  # [L, n]
        o = F.scaled_dot_product_attention(
            qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask, scale=scale
        )
        out[bounds[b] : bounds[b + 1]] = o.transpose(0, 1).to(q.dtype)
    # the model's ops before the gate moved in here: CPU results stay bit for bit
    return out if gate is None else out * torch.sigmoid(gate)


def check_mla(q: torch.Tensor, cache: torch.Tensor, rank: int) -> None:
    """Raise ValueError unless q ``[T, Hq, W]`` and the latent cache ``[num_pages, page_size,
    1, W]`` agree on W and ``0 < rank <= W``."""
    if q.dim() != 3 or cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != q.shape[-1] \
            or not 0 < rank <= q.shape[-1]:
        raise ValueError(f"MLA shapes disagree: q {tuple(q.shape)} (T, heads, rank + rope), latent cache "
                         f"{tuple(cache.shape)} (pages, page size, 1, rank + rope), rank {rank}")


def mla_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    rank: int,
) -> torch.Tensor:
    """Multi-head latent attention (MLA, DeepSeek-V2) on the compressed latents, the key
    up-projection absorbed into the query: every query head of a request attends over the
    request's one latent head, whose whole row ``[c, k_rope]`` is the key and whose first
    ``rank`` columns ``c`` are the value. Causal as :func:`paged_attention_ref` (the ``L_b``
    queries of request b are the last ``L_b`` of its ``kv_lens[b]`` positions).

    Args:
        q: ``[T, Hq, W]`` with ``W = rank + rope``: per head ``[q_nope W_uk, q_rope]``.
        cache: ``[num_pages, page_size, 1, W]``, the latents ``[c, k_rope]`` (one "KV head").
        page_table, req_pool_indices, kv_lens, cu_seqlens_q: as :func:`paged_attention_ref`.
        scale: softmax scale (MLA's: ``(nope + rope) ** -0.5`` of the unabsorbed head).
        rank: ``kv_lora_rank``, the value width.

    Returns:
        ``[T, Hq, rank]`` in q's dtype: ``softmax(q . latent * scale) c``; softmax in fp32.

    Raises:
        ValueError: shapes that do not fit (:func:`check_mla`).
    """
    check_mla(q, cache, rank)
    page_size = cache.shape[1]
    flat = cache.view(-1, cache.shape[-1])
    out = q.new_empty(q.shape[0], q.shape[1], rank)
    bounds = cu_seqlens_q.tolist()
    for b, (row, n) in enumerate(zip(req_pool_indices.tolist(), kv_lens.tolist())):
        L = bounds[b + 1] - bounds[b]
        if L == 0:
            continue
        pos = torch.arange(n, device=q.device)
        lat = flat[page_table[row, pos // page_size] * page_size + pos % page_size].float()  # [n, W]
        s = torch.einsum("lhw,nw->lhn", q[bounds[b]: bounds[b + 1]].float(), lat) * scale
        visible = pos[None, :] <= torch.arange(n - L, n, device=q.device)[:, None]  # [L, n]
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        out[bounds[b]: bounds[b + 1]] = torch.einsum("lhn,nr->lhr", s.softmax(-1), lat[:, :rank]).to(q.dtype)
    return out
