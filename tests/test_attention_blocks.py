"""The Triton paged attention's tile choice (``kernels/attention/blocks.py``): the shared
memory estimate and the shrink on a launch Triton refuses (Kimi Linear's 576-wide MLA
latent, padded to 1024, was refused on the H200 at tiles the estimate let through)."""
import pytest

from ppspec.kernels.attention import blocks


class OutOfResources(Exception):
    """Named as Triton's: launch_fitting matches the exception by its class name."""


def test_fit_shared_keeps_narrow_heads_and_shrinks_the_mla_latent():
    assert blocks.fit_shared(16, 64, 2, 128, 2) == (16, 64, 2)  # 2 x 128 x (16 + 256) = 68 KiB
    # 1024 wide in bf16: stages 2 -> 1, then 64 -> 32 keys: 2 x 1024 x (16 + 64) = 160 KiB
    assert blocks.fit_shared(16, 64, 2, 1024, 2) == (16, 32, 1)
    # fp32 (4 bytes): down to 16 keys, then 32 -> 16 query rows
    m, n, s = blocks.fit_shared(32, 32, 1, 1024, 4)
    assert (m, n, s) == (16, 16, 1) and 4 * 1024 * (m + 2 * n * s) <= blocks.SHARED_BUDGET
    with pytest.raises(ValueError, match="too wide"):
        blocks.fit_shared(16, 16, 1, 1 << 14, 4)


def test_launch_fitting_shrinks_until_triton_takes_the_tiles_and_remembers_them(monkeypatch):
    monkeypatch.setattr(blocks, "_FITTED", {})
    tried = []

    def launch(m, n, s):  # a device whose limit is tighter than the estimate: 16 x 16 keys at most
        tried.append((m, n, s))
        if n * s > 16:
            raise OutOfResources("shared memory")
        return "ran"

    assert blocks.launch_fitting(launch, 16, 32, 2, 1024, 2) == "ran"
    assert tried == [(16, 32, 2), (16, 32, 1), (16, 16, 1)]
    tried.clear()
    assert blocks.launch_fitting(launch, 16, 32, 2, 1024, 2) == "ran"
    assert tried == [(16, 16, 1)]  # the next call starts from the tiles that launched


def test_launch_fitting_passes_other_errors_and_gives_up_at_the_least_tiles(monkeypatch):
    monkeypatch.setattr(blocks, "_FITTED", {})

    def bad(m, n, s):
        raise RuntimeError("not a resource error")
    with pytest.raises(RuntimeError, match="not a resource"):
        blocks.launch_fitting(bad, 16, 32, 1, 128, 2)

    def never(m, n, s):
        raise OutOfResources("shared memory")
    with pytest.raises(ValueError, match="too wide"):
        blocks.launch_fitting(never, 32, 32, 2, 1024, 2)
