"""Kimi Linear (``model_type: kimi_linear``): KDA layers, MLA full attention with the
compressed KV latent in the paged KV cache, MoE with shared experts (docs/DESIGN.md,
"Kimi Linear")."""
from .config import MODEL_TYPE, KimiLinearConfig
from .config import load_kimi_config as load_config
from .loader import load_kimi_stage_model as load_stage_model

__all__ = ["MODEL_TYPE", "KimiLinearConfig", "load_config", "load_stage_model"]
