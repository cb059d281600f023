"""Multi-head latent attention on the paged latent cache (``kernels/attention``): the
plain-torch reference against the generic paged attention run on the latent as keys and
values (its first ``rank`` columns kept), for decode, verify and a prefill continuing a
cached prefix, page sizes 16 and 64; the Triton kernel's tile rule fits shared memory
before any compile; bad shapes are refused. The Triton kernel itself is tested against the
reference on CUDA (tests/gpu/test_kimi_gpu.py)."""
import random

import pytest
import torch

from ppspec.kernels.attention import mla_attention
from ppspec.kernels.attention.blocks import SHARED_BUDGET, mla_shared_bytes, mla_tiles
from ppspec.kernels.attention.naive import mla_attention_ref, paged_attention_ref


def mla_case(mode, nh, rank, rope, page, dtype=torch.float32, seed=0):
    """Random inputs of one batch: decode (1 query a request), verify (4) or prefill (1 to
    40 queries after a cached prefix), rows and pages shuffled. Returns the argument tuple
    of :func:`mla_attention_ref`."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    B = {"decode": 5, "verify": 3, "prefill": 3}[mode]
    Ls = [{"decode": 1, "verify": 4}.get(mode) or rng.randint(1, 40) for _ in range(B)]
    kv_lens = [rng.randint(0, 150) + n for n in Ls]
    max_pages = max(-(-n // page) for n in kv_lens) + 1
    num_pages = (B + 1) * max_pages + 1
    page_table = torch.randperm(num_pages, generator=gen)[: (B + 1) * max_pages].view(B + 1, max_pages)
    cache = torch.randn(num_pages, page, 1, rank + rope, generator=gen).to(dtype)
    q = torch.randn(sum(Ls), nh, rank + rope, generator=gen).to(dtype)
    rows = torch.randperm(B + 1, generator=gen)[:B]
    return (q, cache, page_table, rows, torch.tensor(kv_lens), torch.tensor([0] + Ls).cumsum(0),
            (16 + rope) ** -0.5, rank)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("mode", ["decode", "verify", "prefill"])
@pytest.mark.parametrize("nh,rank,rope", [(4, 24, 8), (16, 64, 16), (3, 32, 0)])
def test_reference_equals_generic_attention_on_the_latent(mode, nh, rank, rope, page):
    args = mla_case(mode, nh, rank, rope, page, seed=nh + rank + page)
    q, cache, pt, rows, lens, cu, scale, _ = args
    want = paged_attention_ref(q, cache, cache, pt, rows, lens, cu, scale)[..., :rank]
    got = mla_attention_ref(*args)
    assert got.shape == (q.shape[0], nh, rank) and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    assert torch.equal(mla_attention(*args), got)  # the CPU dispatch takes the reference


def test_bad_shapes_are_refused():
    q, cache, pt, rows, lens, cu, scale, rank = mla_case("decode", 4, 24, 8, 16)
    with pytest.raises(ValueError, match="MLA shapes disagree"):
        mla_attention(q[..., :-1], cache, pt, rows, lens, cu, scale, rank)
    with pytest.raises(ValueError, match="MLA shapes disagree"):
        mla_attention(q, cache.expand(-1, -1, 2, -1), pt, rows, lens, cu, scale, rank)
    with pytest.raises(ValueError, match="MLA shapes disagree"):
        mla_attention(q, cache, pt, rows, lens, cu, scale, 33)


@pytest.mark.parametrize("elt", [2, 4])
@pytest.mark.parametrize("width", [32 + 16, 512 + 64, 1024 + 64, 2048 + 64])
def test_mla_tiles_fit_shared_memory(width, elt):
    """Kimi Linear's 512 + 64 latent: 16-bit 16 rows x 32 keys in a 2-stage pipeline on 8
    warps, fp32 16 x 16 unpipelined on 4; every tile within the budget, every dot dimension
    >= 16; a latent too wide even for 16 keys says so."""
    if mla_shared_bytes(16, 16, 1, width, elt) > SHARED_BUDGET:  # fp32 from 1024 + 64 on
        assert elt == 4 and width > 1024
        with pytest.raises(ValueError, match="too wide"):
            mla_tiles(width, elt)
        return
    bm, bn, stages, warps = mla_tiles(width, elt)
    assert mla_shared_bytes(bm, bn, stages, width, elt) <= SHARED_BUDGET
    assert bm == 16 and bn >= 16 and stages >= 1
    if width <= 512 + 64:
        assert (bn, stages, warps) == ((16, 1, 4) if elt == 4 else (32, 2, 8))
