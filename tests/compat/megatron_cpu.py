"""Make the real megatron-core / Megatron-Bridge wheels importable on a CPU-only Python 3.11.

Everything the compatibility tests change about the installed packages is here, each with
its reason; nothing else is stubbed or patched. Import this module before ``megatron``.

1. ``megatron.core.transformer.moe.ops.paged_stash`` (megatron-core >= 0.19) is a module of
   Triton GPU kernels for MoE activation stashing, imported unconditionally by
   ``megatron.core.pipeline_parallel`` -> ``megatron/core/__init__.py``. Triton has no CPU
   build here, so that one module is replaced by a stand-in whose kernels raise if called.
   No data path calls them.
2. ``typing.override`` (Python 3.12) is used by megatron-core 0.19's ``megatron.training``
   models, which Megatron-Bridge imports; Bridge declares Python >= 3.12, and the CPU torch
   wheel exists for 3.11 only. ``typing_extensions.override`` is the same decorator.
3. ``megatron/bridge/__init__.py``, ``megatron/bridge/data/__init__.py`` and
   ``megatron/bridge/data/builders/__init__.py`` only re-export: they import every model
   bridge, PEFT (``transformer_engine``, CUDA-only) and the Energon/HF builders. They are
   registered as bare packages (their directories, without running the re-export lists),
   so ``megatron.bridge.data.packing.*``, ``megatron.bridge.data.datasets.gpt_sft`` and
   ``megatron.bridge.data.builders.gpt_sft`` import and run unmodified.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
import typing

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"
_BARE_PACKAGES = ("megatron.bridge", "megatron.bridge.data", "megatron.bridge.data.builders")


def _triton_kernels_stand_in() -> None:
    if importlib.util.find_spec("triton") is not None or _PAGED_STASH in sys.modules:
        return
    module = types.ModuleType(_PAGED_STASH)
    module.__doc__ = "CPU stand-in for megatron-core's Triton MoE paged-stash kernels (see megatron_cpu)."
    module.GLOBAL_BLOCK_SIZE = 1024

    def _needs_triton(*_args, **_kwargs):
        raise RuntimeError("MoE paged-stash kernels need Triton (GPU); not available on this machine")

    module.paged_stash_copy_kernel = module.paged_stash_pop_kernel = _needs_triton
    sys.modules[_PAGED_STASH] = module


def _typing_override() -> None:
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _bare_package(name: str) -> None:
    if name in sys.modules:
        return
    parent_name, _, child = name.rpartition(".")
    try:
        parent = importlib.import_module(parent_name)
    except ModuleNotFoundError:
        return  # not installed (the megatron-core-only stack)
    spec = importlib.machinery.PathFinder.find_spec(name, list(parent.__path__))
    if spec is None or spec.submodule_search_locations is None:
        return  # not installed (e.g. the megatron-core-only environment)
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    module.__file__ = spec.origin
    module.__package__ = name
    sys.modules[name] = module
    setattr(parent, child, module)


def install() -> None:
    """Apply the three measures above (idempotent)."""
    _triton_kernels_stand_in()
    _typing_override()
    for name in _BARE_PACKAGES:
        _bare_package(name)


install()
