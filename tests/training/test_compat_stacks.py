"""Run tests/compat/ against each installed megatron stack, each in its own interpreter.

megatron-core 0.16.1 (the oldest supported) and 0.19.2 with Megatron-Bridge 0.6.2 are
installed side by side by ``make install-compat`` (``pip install --no-deps --target
.deps/<stack>``); each run puts one stack's directory first on PYTHONPATH, and
tests/compat/conftest.py refuses to run if another megatron-core was imported.
In CI (``CI`` set, as ``.ci/run`` runs) a missing stack is a failure, never a skip.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
from support.side_stacks import require

pytestmark = [pytest.mark.compat, pytest.mark.slow, pytest.mark.timeout(1800)]  # one stack's suite: up to 1500 s

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: compat/ lives there
ROOT = os.path.dirname(HERE)
# tests/compat/stacks.py by its path: tests/compat/ stays off sys.path, where its conftest.py would
# shadow tests/conftest.py for a process the plain suite spawns (tests/storage/test_remote.py).
_spec = importlib.util.spec_from_file_location("stacks", os.path.join(HERE, "compat", "stacks.py"))
stacks = sys.modules["stacks"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stacks)


@pytest.mark.parametrize("name", sorted(stacks.STACKS))
def test_compat_suite_passes_against_the_installed_stack(name, tmp_path):
    stack = stacks.STACKS[name]
    require(os.path.isdir(os.path.join(stack.path, "megatron", "core")), stack.path)
    env = dict(os.environ, MEGATRON_SFT_IDX_STACK=name,
               PYTHONPATH=os.pathsep.join([stack.path, ROOT]), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "t"), os.path.join(HERE, "compat")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"compat suite failed against {name}:\n{tail}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, tail
