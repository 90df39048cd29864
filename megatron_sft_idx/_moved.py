"""Names that moved: the one door through which an old name still answers, loudly.

A module or attribute that moved keeps answering for one warning cycle, and only through this
module: the old module calls :func:`warn_moved` once, at import (a ``FutureWarning`` naming
the new home and the version that removes the old name); an old attribute whose new home sits
above the module that held it (which would need an import back up, a circle the import
contract cannot see) no longer resolves: looking it up warns the same way and raises
``AttributeError`` (:func:`moved_getattr`). The project's own code, tests, benchmarks and docs
use only the new names (``tests/project/test_architecture.py`` forbids importing an old
module; docs/CONTRIBUTING.md "Moved names" lists this table).

Imports nothing of the package: any module may use it.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Callable, Dict, NamedTuple


class Moved(NamedTuple):
    new: str       # where the names live now, as a user imports them
    removal: str   # the version that removes the old name (already removed: it warns and fails)
    works: bool    # True: the old name still resolves (a warn-once module); False: it fails


# Old module -> its new homes. Each is a module that warns once and still re-exports its names.
MOVED_MODULES: Dict[str, Moved] = {
    "megatron_sft_idx.preprocess.pipeline": Moved(
        "megatron_sft_idx.preprocess.driver (run, prove_inputs), .config (Config, PackJob, PlanSettings), "
        ".plan (plan_shards, split_conversations), .tokenize (Inputs, resolve_inputs)", "0.2.0", True),
    "megatron_sft_idx.training.factory": Moved(
        "megatron_sft_idx.open (open_packed, records_no_identity), megatron_sft_idx.legacy (load_legacy_npy, "
        "load_parquet, RestrictedUnpickler, normalise_bridge_loss)", "0.2.0", True),
    "megatron_sft_idx.training.manifest": Moved(
        "megatron_sft_idx.manifest (Manifest, load_manifest, read_manifest, ...), "
        "megatron_sft_idx.publishing (write_manifest)", "0.2.0", True),
    "megatron_sft_idx.training.multi": Moved(
        "megatron_sft_idx.multi (MultiShardDataset, expand_shards, ...), megatron_sft_idx.manifest (Manifest, "
        "load_manifest), megatron_sft_idx.publishing (write_manifest)", "0.2.0", True),
    "megatron_sft_idx.training._sources": Moved(
        "megatron_sft_idx.packed (PackSummary, summarize, FlatPackedSource, ...)", "0.2.0", True),
    # The module name is the repack function now (``from megatron_sft_idx.preprocess import repack``):
    # a package attribute cannot be both, so the module is gone; importing it is ModuleNotFoundError.
    "megatron_sft_idx.preprocess.repack": Moved(
        "megatron_sft_idx.preprocess.repack is the repack function (megatron_sft_idx.preprocess.driver); "
        "RepackConfig from megatron_sft_idx.preprocess.config, plan_only from .driver, the CLI from .repack_cli "
        "(build_repack_parser, repack_main), format_plan_summary from .summary", "0.1.0", False),
}

# Old attribute ("module.name") -> its new home. Their new homes are above the old module, so
# they no longer resolve: looking one up warns and raises AttributeError.
MOVED_NAMES: Dict[str, Moved] = {
    **{f"megatron_sft_idx.storage.upload.{name}": Moved(f"megatron_sft_idx.publishing.{name}", "0.1.0", False)
       for name in ("upload_shard", "publish", "publish_shard", "local_files")},
    **{f"megatron_sft_idx.storage.{name}": Moved(f"megatron_sft_idx.publishing.{name}", "0.1.0", False)
       for name in ("upload_shard", "publish", "publish_shard")},
    "megatron_sft_idx.storage.remote.RemoteIndexedDataset": Moved("megatron_sft_idx.MMapIndexedDataset "
                                                                  "(megatron_sft_idx.reader)", "0.1.0", False),
    **{f"megatron_sft_idx.preprocess.cli.{name}": Moved(f"megatron_sft_idx.preprocess.repack_cli.{name}", "0.1.0",
                                                         False)
       for name in ("repack_main", "build_repack_parser", "REPACK_PROG", "REPACK_DESCRIPTION")},
    "megatron_sft_idx.storage.RemoteIndexedDataset": Moved("megatron_sft_idx.MMapIndexedDataset "
                                                           "(megatron_sft_idx.reader)", "0.1.0", False),
}

_warned: set = set()


def message(old: str, moved: Moved) -> str:
    """What a user of ``old`` reads: where it lives now, and when (or that) the old name goes."""
    if moved.works:
        return (f"{old} is deprecated and will be removed in megatron_sft_idx {moved.removal}: "
                f"import from {moved.new}")
    return f"{old} was removed in megatron_sft_idx {moved.removal}: import from {moved.new}"


def warn_moved(module: str) -> None:
    """Called at the top of a moved module (``warn_moved(__name__)``): one ``FutureWarning`` per
    process, pointing at the line that imported it."""
    if module in _warned:
        return
    _warned.add(module)
    warnings.warn(message(module, MOVED_MODULES[module]), FutureWarning, stacklevel=_importer_level(module))


def moved_getattr(module: str, fallback: Callable[[str], object] = None) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module``: a name of :data:`MOVED_NAMES` warns and raises
    ``AttributeError`` naming its new home; any other name goes to ``fallback`` (a lazy face's
    look-up) or is an ordinary ``AttributeError``."""

    def __getattr__(name: str):
        old = f"{module}.{name}"
        moved = MOVED_NAMES.get(old)
        if moved is not None:
            text = message(old, moved)
            warnings.warn(text, FutureWarning, stacklevel=2)
            raise AttributeError(text)
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def _importer_level(module: str) -> int:
    """The ``stacklevel`` of the first frame outside this module, the moved module and the
    import machinery: the user's import line. (``warnings`` itself passes over the frames of
    ``importlib._bootstrap`` without counting them; the rest are counted here.)"""
    skip = {__file__, getattr(sys.modules.get(module), "__file__", None)}
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        bootstrap = "importlib" in name and "_bootstrap" in name
        if not bootstrap and name not in skip and os.path.dirname(name) != os.path.dirname(importlib.__file__):
            break
        frame, level = frame.f_back, level + (0 if bootstrap else 1)
    return level
