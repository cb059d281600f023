"""Recurrent-state bytes a verify round moves per request, by commit design, for the ~1B
random shapes of each family's GPU benchmark (``gpu_bench``): ``python -m
ppspec.bench.state_traffic [--steps 3]``.

Counted from the per-row layout each layer family declares (``stage_server/family.py``:
``StateSpec`` tensors, ``REPLAY`` ones being the recurrent state, ``SCRATCH`` ones the conv
windows; ``RecordSpec`` step inputs), per layer and request for a verify of ``D = steps +
1`` tokens and its commit, as ``kernels/bench_verify.py`` counts GDN's:

- copy design: the verify reads the state and writes one copy per step into the scratch,
  the commit reads the accepted copy and writes it back: ``(D + 3)`` state sizes;
- replay design: the round reads the state, applies the last round's accepted steps and
  writes it once, and writes ``D`` step records, which the next round reads: 2 state
  sizes plus ``2 D`` records;
- the conv windows are scratch-kept in both designs: ``(D + 3)`` window sizes.

The minimum is 2 state sizes: the state read once and written once. No device needed:
the configs are written by transformers and the stage models built on the meta device.
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from ppspec.bench.gpu_bench import BAMBA_1B, FALCON_H1_1B, GRANITE_1B, KIMI_1B, NEMOTRON_1B, QWEN35_1B

SHAPES = {  # family: (transformers config class, the gpu_bench shape)
    "qwen3_5": ("Qwen3_5TextConfig", QWEN35_1B),
    "kimi_linear": ("KimiLinearConfig", KIMI_1B),
    "nemotron_h": ("NemotronHConfig", NEMOTRON_1B),
    "falcon_h1": ("FalconH1Config", FALCON_H1_1B),
    "granitemoehybrid": ("GraniteMoeHybridConfig", GRANITE_1B),
    "bamba": ("BambaConfig", BAMBA_1B),
}


def _bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty(0, dtype=dtype).element_size()


def traffic(model_dir: str, D: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Per request and round over every recurrent layer of the checkpoint at ``model_dir``:
    ``state`` / ``window`` / ``record`` bytes of one layer, the layer count, and bytes moved
    by the ``copy`` and ``replay`` designs and the ``minimum``."""
    from ppspec.stage_server.config import load_config
    from ppspec.stage_server.family import REPLAY
    from ppspec.stage_server.models import family_of

    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = family_of(cfg).stage_model(cfg, 0, cfg.num_hidden_layers, False)
    layout = model.layer_family.layout(cfg)
    state = sum(_bytes(s.shape, s.dtype or dtype) for s in layout.state if s.verify == REPLAY)
    window = sum(_bytes(s.shape, s.dtype or dtype) for s in layout.state if s.verify != REPLAY)
    record = sum(_bytes(r.shape, torch.float32) for r in layout.record)
    n = len(model.state_layers)
    return dict(family=layout.family.name, layers=n, state=state, window=window, record=record,
                copy=n * (D + 3) * (state + window), replay=n * (2 * state + 2 * D * record + (D + 3) * window),
                minimum=n * 2 * state)


def main(argv: list[str] | None = None) -> None:
    import transformers

    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.state_traffic", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="draft tokens per verify (D = steps + 1)")
    a = ap.parse_args(argv)
    D = a.steps + 1
    print(f"Recurrent state per request and verify round (D = {D}), bf16 stage, recurrent state fp32\n")
    print("| checkpoint | layer family | recurrent layers | state KiB / layer | conv windows KiB | record KiB / step "
          "| copy: MiB (state sizes) | replay: MiB (state sizes) | minimum MiB (2) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (config_cls, shape) in SHAPES.items():
        with tempfile.TemporaryDirectory() as d:
            getattr(transformers, config_cls)(**shape).save_pretrained(d)
            r = traffic(d, D)
        sizes = r["layers"] * r["state"]
        print(f"| {name} | {r['family']} | {r['layers']} | {r['state'] / 1024:.0f} | {r['window'] / 1024:.1f} | "
              f"{r['record'] / 1024:.1f} | {r['copy'] / 2**20:.1f} ({r['copy'] / sizes:.2f}) | "
              f"{r['replay'] / 2**20:.1f} ({r['replay'] / sizes:.2f}) | {r['minimum'] / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
