import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# tests/compat/ imports the real megatron-core / Megatron-Bridge of one installed stack each;
# tests/test_compat_stacks.py runs it once per stack in a subprocess with that stack on the path.
if not os.environ.get("MEGATRON_SFT_IDX_STACK"):
    collect_ignore = ["compat"]
