"""Host time and device reads of a decode step and a verify round, per model family, on the
CPU: ``python -m ppspec.bench.family_host``.

For each family a tiny random checkpoint of the same depth (``--layers`` decoder layers of
a token mixer and an MLP: 3/4 recurrent, 1/4 attention; NemotronH's blocks hold one of
the two, so it gets twice as many) is written by transformers, loaded into a CPU
``StageRunner`` (fp32, replay commit design: the CUDA default) and prefilled with
``--batch`` requests; then decode steps and verify rounds (D = 4, with their commit) are
timed (median of ``--steps``) eagerly and through the CUDA graphs' padded path run eagerly
(``cuda_graph_max_bs``, ``capture=False``; where the family has graphs on).

A step is counted for its **device reads**: the calls that make a CUDA stream wait for the
host (``aten._local_scalar_dense``, behind ``.item()``, ``int(t)``, ``bool(t)``;
``Tensor.tolist``; ``nonzero``, ``masked_select``, boolean-mask indexing, ``unique``,
``bincount``, ``repeat_interleave`` without ``output_size``) made outside the plain-torch
reference kernels (``kernels/*/naive*.py``, ``kernels/conv1d/packed.py``: the CPU path of
ops that run Triton on CUDA), and for the ``kernels.checks.fact`` fallbacks (a check that
read the device because the stage stated no fact). On CUDA each is a synchronisation of
the step. ``ops``: the ATen ops outside those reference kernels that would launch a kernel
on CUDA (not views, not allocations; each reference kernel's call is one Triton launch
there, not counted). Wall times are the CPU's: the plain-torch kernels' own time is in them.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import tempfile
import time
import traceback

TINY = dict(vocab_size=512, hidden_size=64, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)

# checkpoints of ``layers`` decoder layers, 3/4 recurrent: family -> (maker, shape)
def shapes(layers: int) -> dict:
    attn = [i for i in range(layers) if i % 4 == 3]
    kinds = ["full_attention" if i in attn else "linear_attention" for i in range(layers)]
    nemo = "".join(("*" if i in attn else "M") + "-" for i in range(layers))
    return {
        "qwen3_5": dict(num_hidden_layers=layers, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, layer_types=kinds),
        "nemotron_h": dict(hybrid_override_pattern=nemo, intermediate_size=96, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                           ssm_state_size=16, conv_kernel=4),
        "falcon_h1": dict(num_hidden_layers=layers, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128, mamba_n_groups=2, mamba_d_state=16,
                          mamba_d_conv=4, mamba_rms_norm=True),
        "kimi_linear": dict(num_hidden_layers=layers, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16, linear_num_heads=2, linear_head_dim=16, layer_types=kinds,
                            mlp_layer_types=["dense"] * layers, moe_intermediate_size=32, num_local_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1),
        "granitemoehybrid": dict(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                 layer_types=["attention" if i in attn else "mamba" for i in range(layers)],
                                 position_embedding_type="rope", num_local_experts=0, shared_intermediate_size=96,
                                 mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                                 mamba_expand=2),
        "bamba": dict(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                      attn_layer_indices=attn, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                      mamba_expand=2),
    }


CLASSES = {"nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
           "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM"),
           "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
           "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
           "bamba": ("BambaConfig", "BambaForCausalLM")}


def make_tiny(torch, family: str, path: str, layers: int) -> str:
    """Write the tiny random checkpoint of ``family`` at ``path`` (transformers' own model)."""
    from ppspec.bench.gpu_bench import _save_random, make_random_checkpoint

    shape = {**TINY, **shapes(layers)[family]}
    torch.manual_seed(0)
    if family == "qwen3_5":
        make_random_checkpoint(torch, path, "cpu", mtp=False, **shape)
    else:
        _save_random(torch, path, "cpu", *CLASSES[family], shape)
    return path


# ops that launch no kernel: views, shapes, allocations
_NO_KERNEL = {"view", "_unsafe_view", "split", "split_with_sizes", "slice", "select", "expand", "permute", "transpose",
              "t", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "unbind", "narrow", "chunk", "empty",
              "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "_reshape_alias",
              "unfold", "is_nonzero", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "reshape",
              "contiguous", "to", "detach_", "resolve_conj", "resolve_neg"}
# ops that make a CUDA stream wait for the host
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim", "bincount",
             "unique_consecutive", "item"}
_REFERENCE = (os.sep + "naive", os.sep + "packed.py")  # plain-torch kernels: the CPU path only
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # this checkout
# reference functions that kernels/' dispatch runs on CUDA too (no Triton kernel takes their
# place); a reference that model code calls directly runs there as well. A checkout before
# 23b08be ran sigmoid_gated_rms_norm_ref on CUDA too: add it here to count that one
_EVERY_DEVICE = {"store_kv_ref"}


def _site() -> str | None:
    """Where the current op comes from, as ``file:line function``: the innermost frame of
    this checkout; None when that is a reference kernel that kernels/' dispatch replaces by
    a Triton kernel on CUDA (a reference of :data:`_EVERY_DEVICE`, or one called from
    outside kernels/, runs there too: its caller's frame)."""
    frames = [fr for fr in traceback.extract_stack()[:-2] if fr.filename.startswith(_ROOT)
              and not fr.filename.endswith("family_host.py") and f"{os.sep}.venv{os.sep}" not in fr.filename]
    if not frames:
        return "?"
    fr = frames[-1]
    if not any(r in fr.filename for r in _REFERENCE):
        return f"{fr.filename[len(_ROOT):]}:{fr.lineno} {fr.name}"
    i = next(i for i, f in enumerate(frames) if any(r in f.filename for r in _REFERENCE))
    caller = frames[max(i - 1, 0)]
    if frames[i].name in _EVERY_DEVICE or not caller.filename[len(_ROOT):].startswith("kernels" + os.sep):
        return f"{caller.filename[len(_ROOT):]}:{caller.lineno} {caller.name} (plain torch on every device)"
    return None


class ReadCounter:
    """Counts device reads (module docstring) and ``fact`` fallbacks while active."""

    def __init__(self):
        self.reads: collections.Counter = collections.Counter()
        self.fallbacks: collections.Counter = collections.Counter()
        self.ops = 0  # ATen ops that launch a kernel on CUDA, outside the reference kernels

    @contextlib.contextmanager
    def active(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        from ppspec.kernels import checks

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.overloadpacket.__name__
                hit = name in _SYNC_OPS
                if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) and \
                        isinstance(args[0], torch.Tensor) and (len(args) < 2 or isinstance(args[1], torch.Tensor)):
                    hit = True
                if name in ("index", "index_put", "index_put_") and any(
                        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
                    hit = True
                if hit or name not in _NO_KERNEL:
                    site = _site()
                    if site is not None:
                        counter.ops += name not in _NO_KERNEL
                        if hit:
                            counter.reads[f"{name} @ {site}"] += 1
                return func(*args, **kwargs)

        tolist, fact = torch.Tensor.tolist, checks.fact

        def counted_tolist(t, *a, **k):
            site = _site()
            if site is not None:
                counter.reads[f"tolist @ {site}"] += 1
            return tolist(t, *a, **k)

        def counted_fact(t, name, compute):
            def fallback():
                counter.fallbacks[f"{name} @ {_site()}"] += 1
                return compute()
            return fact(t, name, fallback)

        torch.Tensor.tolist = counted_tolist
        checks.fact = counted_fact
        try:
            with Mode():
                yield self
        finally:
            torch.Tensor.tolist = tolist
            checks.fact = fact


def measure(torch, path: str, batch: int, steps: int, graphs: bool, ctx: int = 24) -> dict:
    """Median ms of a decode step and of a verify round (D = 4, with its commit) of
    ``batch`` requests at about ``ctx`` tokens on the CPU, and the device reads and fact
    fallbacks of one of each (per step)."""
    from ppspec.bench.gpu_bench import prefilled_steps

    out = {}
    for drafts in (0, 3):
        mode = "verify" if drafts else "decode"
        kw = dict(device="cpu", dtype=torch.float32, commit_design="replay", cuda_graph_max_bs=batch if graphs else 0)
        r, step, _ = prefilled_steps(torch, path, batch, ctx, drafts, rounds=steps + 8, **kw)
        if graphs and mode not in r.graphs:
            return {}
        step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        c = ReadCounter()
        with c.active():
            step()
        out[mode] = dict(ms=statistics.median(times) * 1e3, reads=c.reads, fallbacks=c.fallbacks, ops=c.ops)
        del r, step
    return out


def profile(torch, path: str, batch: int, steps: int, top: int) -> str:
    """cProfile of ``steps`` eager decode steps, by own time."""
    import cProfile
    import io
    import pstats

    from ppspec.bench.gpu_bench import prefilled_steps

    r, step, _ = prefilled_steps(torch, path, batch, 24, 0, rounds=steps + 4, device="cpu", dtype=torch.float32,
                                 commit_design="replay", cuda_graph_max_bs=0)
    step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.family_host", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="qwen3_5,nemotron_h,falcon_h1,kimi_linear,granitemoehybrid,bamba",
                    help="comma-separated, of: " + ", ".join(shapes(4)))
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of every checkpoint (NemotronH: blocks / 2)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each kind (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--reads", action="store_true", help="list every device read and fact fallback by its site")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N of eager decode steps")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    root = tempfile.mkdtemp()
    print(f"CPU, fp32, replay commit design, batch {a.batch}, {a.layers} layers, torch {torch.__version__}, "
          f"{a.threads} thread(s); median of {a.steps} steps\n")
    print("| family | decode eager (ms) | decode padded graph path (ms) | verify round eager (ms) | "
          "verify padded graph path (ms) | device reads per decode / verify (eager) | fact fallbacks per decode / verify "
          "| ops per decode / verify (eager) |")
    print("|---|---|---|---|---|---|---|---|")
    details = []
    for fam in a.families.split(","):
        path = make_tiny(torch, fam, os.path.join(root, fam), a.layers)
        eager = measure(torch, path, a.batch, a.steps, graphs=False)
        padded = measure(torch, path, a.batch, a.steps, graphs=True)
        g = {m: f"{padded[m]['ms']:.2f}" if padded else "off" for m in ("decode", "verify")}
        n = {m: sum(eager[m]["reads"].values()) for m in eager}
        f = {m: sum(eager[m]["fallbacks"].values()) for m in eager}
        print(f"| {fam} | {eager['decode']['ms']:.2f} | {g['decode']} | {eager['verify']['ms']:.2f} | {g['verify']} | "
              f"{n['decode']} / {n['verify']} | {f['decode']} / {f['verify']} | "
              f"{eager['decode']['ops']} / {eager['verify']['ops']} |", flush=True)
        if a.reads:
            for m in ("decode", "verify"):
                for k, v in sorted(eager[m]["reads"].items()) + sorted(eager[m]["fallbacks"].items()):
                    details.append(f"{fam} {m}: {v} x {k}")
        if a.profile:
            details.append(f"--- {fam}: cProfile of {a.steps} eager decode steps\n"
                           + profile(torch, path, a.batch, a.steps, a.profile))
    if details:
        print("\n" + "\n".join(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
