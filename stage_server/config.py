"""Model configuration: a checkpoint's ``config.json`` handed to its model family.

:func:`load_config` reads the file, looks its ``model_type`` up among the model families
(``stage_server.models``; docs/DESIGN.md, "Layer families") and hands the JSON to that
family's parser, which returns the family's config object (``family.ModelConfig``). The
typed reads every parser uses are ``stage_server.fields``.
"""
from __future__ import annotations

import json
import os

from .fields import CheckpointError, Fields, read_config_json  # noqa: F401  (CheckpointError: the error of every load)
from .models import family_for

PAGE_SIZE = 16  # tokens per KV page of a stage's pools (StageRunner's default)


def load_config(model_dir: str):
    """Parse ``model_dir/config.json`` with the parser of the family its ``model_type``
    names (``stage_server.models.family_for``); the config object is the family's
    (``ModelConfig``: ``models.qwen3_next.config.HybridConfig`` for Qwen3-Next / Qwen3.5).
    The EOS ids are config.json's ``eos_token_id`` followed by those generation_config.json
    adds (transformers' ``generate`` stops on the latter, vLLM adds them to the stop tokens:
    Qwen's name ``<|endoftext|>`` beside config.json's ``<|im_end|>``).

    Raises:
        CheckpointError: missing or unreadable config, a ``model_type`` no family serves, or
            what the family's parser refuses; the message names the file and the field.
    """
    path, raw = read_config_json(model_dir)
    cfg = family_for(path, raw).parse_config(path, raw)
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        try:
            with open(gen_path) as f:
                gen = json.load(f)
            if isinstance(gen, dict):
                extra = Fields(gen_path, gen).ints("eos_token_id", lo=0)
                cfg.eos_token_ids = list(dict.fromkeys([*cfg.eos_token_ids, *extra]))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            pass
        except CheckpointError:
            if not cfg.eos_token_ids:  # the only EOS ids there are: the checkpoint is broken
                raise
    return cfg
