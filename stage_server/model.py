"""The model code by the names it had before model families had folders (tests and
benches import them from here): the Qwen3-Next / Qwen3.5 stage model
(``models/qwen3_next/model.py``), the GDN mixer (``layers/gdn.py``), the shared blocks
(``layers/``) and the micro-batch layout (``batch.py``). New code imports from those."""
from .batch import DECODE, PREFILL, VERIFY, BatchMeta, MixedMeta, per_part  # noqa: F401
from .layers.common import MLP, fuse_linears  # noqa: F401
from .layers.gdn import GatedDeltaNet, GatedRMSNorm  # noqa: F401
from .layers.moe import Experts, run_experts  # noqa: F401
from .layers.rotary import Rotary, rope_frequencies  # noqa: F401
from .models.qwen3_next.model import (DecoderLayer, GatedAttention, MTPHead, RMSNorm, Router,  # noqa: F401
                                      SparseMoE, StageModel)
