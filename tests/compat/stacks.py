"""The megatron stacks the compatibility tests run against, and where each is installed.

``make install-compat`` installs each with ``pip install --no-deps --target .deps/<name>``
(Megatron-Bridge declares Python >= 3.12; the CPU torch wheel here is for 3.11, so it is
installed with ``--ignore-requires-python``; see tests/compat/megatron_cpu.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPS = os.environ.get("MEGATRON_SFT_IDX_DEPS", os.path.join(ROOT, ".deps"))


@dataclass(frozen=True)
class Stack:
    name: str
    core: str
    bridge: Optional[str]

    @property
    def path(self) -> str:
        return os.path.join(DEPS, self.name)


STACKS = {
    "megatron-core-0.16.1": Stack("megatron-core-0.16.1", "0.16.1", None),
    # Bridge 0.6.2 imports megatron.core._rank_utils.safe_get_world_size: core >= 0.17.
    "megatron-bridge-0.6.2": Stack("megatron-bridge-0.6.2", "0.19.2", "0.6.2"),
}


#: transformers versions the padding-free adapter is also tested against, beside the environment's
#: (``.ci/constraints.txt``): each installed by ``make install-compat`` with ``pip install --no-deps
#: --target .deps/<name>`` and put first on PYTHONPATH by tests/training/test_compat_transformers.py.
TRANSFORMERS = {"transformers-5.24.0": "5.24.0"}


def transformers_path(name: str) -> str:
    return os.path.join(DEPS, name)


def current() -> Stack:
    name = os.environ.get("MEGATRON_SFT_IDX_STACK")
    if name not in STACKS:
        raise RuntimeError(f"MEGATRON_SFT_IDX_STACK must be one of {sorted(STACKS)}, not {name!r}; "
                           "run these tests through tests/training/test_compat_stacks.py or `make test`")
    return STACKS[name]


def verify(stack: Stack) -> None:
    """The imported megatron-core (and Bridge) are the stack's, from its directory."""
    import megatron.core
    from megatron.core import package_info

    where = os.path.realpath(megatron.core.__file__)
    if not where.startswith(os.path.realpath(stack.path) + os.sep):
        raise RuntimeError(f"megatron.core imported from {where}, not from {stack.path}: "
                           "the stack's directory must come first on PYTHONPATH")
    if package_info.__version__.split("+")[0] != stack.core:  # 0.19 appends the cwd's git hash
        raise RuntimeError(f"megatron-core {package_info.__version__} imported, expected {stack.core}")
    if stack.bridge is not None:
        from megatron.bridge import package_info as bridge_info

        if bridge_info.__version__.split("+")[0] != stack.bridge:
            raise RuntimeError(f"megatron-bridge {bridge_info.__version__}, expected {stack.bridge}")
