import os
import sys

import pytest

# first, before a test module imports transformers: takes the checkout root off sys.path,
# where kernels/ would shadow Hugging Face's kernels package (ppspec/__init__.py)
import ppspec  # noqa: F401

sys.path.insert(0, os.path.dirname(__file__))

from checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="session")
def make_ckpt(ckpt_root):
    def _make(kind, **kw):
        return make_checkpoint(kind, ckpt_root, **kw)

    return _make
