"""Run the padding-free adapter's tests (tests/training/test_training_hf.py) against each other
installed transformers, in its own interpreter: the environment has the version
.ci/constraints.txt pins (5.25.0); ``make install-compat`` puts the others side by side
(``pip install --no-deps --target .deps/transformers-<v>``, pure Python, sharing the environment's
tokenizers, huggingface_hub and TRL). The child runs every test of that file, the slow
``SFTTrainer`` / ``Trainer`` runs of examples/trl_sft.py included, and its first test proves it
imported the asked-for version from the stack's directory. In CI (``CI`` set) a missing stack is
a failure, never a skip.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
from support.side_stacks import require

pytestmark = [pytest.mark.compat, pytest.mark.slow, pytest.mark.timeout(1200)]

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)
# tests/compat/stacks.py by its path (as tests/training/test_compat_stacks.py loads it)
_spec = importlib.util.spec_from_file_location("stacks", os.path.join(HERE, "compat", "stacks.py"))
stacks = sys.modules["stacks"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stacks)


@pytest.mark.parametrize("name", sorted(stacks.TRANSFORMERS))
def test_padding_free_suite_passes_against_the_stacks_transformers(name, tmp_path):
    path = stacks.transformers_path(name)
    require(os.path.isdir(os.path.join(path, "transformers")), path)
    env = dict(os.environ, MEGATRON_SFT_IDX_TRANSFORMERS=f"{stacks.TRANSFORMERS[name]}@{path}",
               PYTHONPATH=os.pathsep.join([path, ROOT]), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0",
                           "--basetemp", str(tmp_path / "t"), os.path.join(HERE, "training", "test_training_hf.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"padding-free suite failed against {name}:\n{tail}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout and " deselected" not in proc.stdout, tail
