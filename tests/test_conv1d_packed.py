"""The conv1d prefill's GPU path (``kernels/conv1d/packed.py``, plain torch, so it runs on
the CPU too) against the per-sequence reference: outputs and new windows, sequences
shorter than the window, new and continuing requests, rows out of order."""
import pytest
import torch

from ppspec.kernels.conv1d.naive import causal_conv1d_prefill_ref
from ppspec.kernels.conv1d.packed import causal_conv1d_prefill_packed


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_prefill_matches_reference(dtype, tol, W, bias):
    g = torch.Generator().manual_seed(W)
    C, R = 24, 9
    lens = [1, 2, 7, 1, 30, 3]
    rows = torch.tensor([4, 0, 8, 2, 6, 1])
    init = torch.tensor([True, False, True, True, False, True])
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    x = torch.randn(T, C, generator=g).to(dtype)
    w = torch.randn(C, W, generator=g).to(dtype)
    b = torch.randn(C, generator=g).to(dtype) if bias else None
    state = torch.randn(R, C, W - 1, generator=g).to(dtype)
    s_ref, s_new = state.clone(), state.clone()
    y_ref = causal_conv1d_prefill_ref(x, w, b, s_ref, rows, cu, init)
    y_new = causal_conv1d_prefill_packed(x, w, b, s_new, rows, cu, init)
    assert y_new.dtype == y_ref.dtype
    assert (y_new.float() - y_ref.float()).abs().max() <= tol * (1 + y_ref.float().abs().max())
    assert torch.equal(s_new, s_ref)  # windows are copies of inputs: exact
