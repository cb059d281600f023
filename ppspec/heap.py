"""A serving process's startup heap, kept out of the garbage collector's passes.

A serving process starts with a large heap that lives as long as it does: torch,
transformers and the tokenizer, the model's modules, the pools' bookkeeping, the app's
routes. CPython's cyclic collector walks every tracked object of a generation on each of
its passes, so a full (oldest-generation) pass over that heap stalls the event loop for
tens to hundreds of milliseconds while it finds nothing to free: what a served round
allocates is acyclic and freed by reference counting. On the CPU host the HTTP server of
``engine_cost`` (MTP, concurrency 64) spent 13% of a run's wall time in the collector, its
full passes up to 150 ms each (docs/PERFORMANCE.md, "The collector's passes").

:func:`freeze_startup_heap` runs once per serving process, after its start and warm-up and
before it serves: one full collection (so no startup garbage is kept), then
``gc.freeze()``, which moves every object alive into a permanent generation that no later
pass walks. The collector stays on for what serving allocates; frozen objects are still
freed by reference counting. vLLM's API server and engine core and SGLang's processes do
the same after their start. ``--no-gc-freeze`` turns it off, for an A/B in one run. On an H100
neither setting was faster at concurrency 1 in both orders of such runs (docs/PERFORMANCE.md).
"""
from __future__ import annotations

import gc
import logging

log = logging.getLogger("ppspec")


def freeze_startup_heap(process: str, enabled: bool = True) -> int:
    """Collect, then freeze the heap of this process (``process``: its name in the log);
    nothing when not ``enabled`` (``--no-gc-freeze``). Returns the number of objects now
    frozen (``gc.get_freeze_count()``)."""
    if not enabled:
        log.info("%s: the startup heap is not frozen (--no-gc-freeze)", process)
        return 0
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects of the startup heap frozen (out of the collector's passes)", process, frozen)
    return frozen
