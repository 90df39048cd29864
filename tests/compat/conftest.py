"""Compatibility tests against the real megatron-core / Megatron-Bridge wheels.

They run in a subprocess per installed stack (``tests/training/test_compat_stacks.py``), with that
stack's ``--target`` directory first on PYTHONPATH and ``MEGATRON_SFT_IDX_STACK`` naming it;
the plain suite does not collect this directory (``tests/conftest.py``). The first thing
here checks that the intended megatron-core was imported, not another one on the path.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import megatron_cpu  # noqa: E402,F401  (before any megatron import)
import stacks  # noqa: E402

STACK = stacks.current()
stacks.verify(STACK)

# Modules that need what only some stacks ship: Megatron-Bridge (needs megatron-core >= 0.17),
# Megatron-LM's SFTDataset and data samplers (megatron/training/, shipped in the megatron-core wheel
# from 0.17 on).
collect_ignore = []
if STACK.bridge is None:
    collect_ignore += ["test_bridge_parity.py", "test_sft_dataset_parity.py", "test_bench_collate.py",
                       "test_batching_torchrun.py", "test_batching_bridge.py", "test_bridge_example.py",
                       "test_balanced_loaders.py", "test_bridge_next.py",
                       "test_megatron_lm_5017.py",  # its golden was made on the 0.19.2 stack
                       "test_nemo_rl_3380.py"]  # reads no megatron: one stack runs it
# Single tests of a module the other stacks run too, left out the same way (not skipped: a stack's
# suite has no skips, tests/training/test_compat_stacks.py).
BRIDGE_ONLY = {"test_loss_rules.py::test_bridges_default_gradient_is_the_replayed_weighting"}


def pytest_collection_modifyitems(config, items):
    if STACK.bridge is not None:
        return
    left = [item for item in items if f"{item.path.name}::{item.name}" in BRIDGE_ONLY]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if item not in left]
