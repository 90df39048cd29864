"""Entry points of the console scripts (``[project.scripts]`` in ``pyproject.toml``) and ``tools/*.py``.

Each tool's CLI lives in its own module as ``build_parser()`` + ``main(argv) -> int``; this
module only starts it: it checks first that the extra the tool needs is installed, and turns a
:class:`~megatron_sft_idx._extras.MissingExtraError` raised anywhere in the tool into one line
on stderr and exit status 2, never a traceback.

Adding a console script: a row in ``TOOLS`` and the line
``my-tool = "megatron_sft_idx._console:my_tool"`` in ``pyproject.toml`` (the function
``my_tool`` is made from the row, below); ``tests/packaging/test_extras.py`` then asks for a real
invocation of it in its ``PROBES`` table, and runs it with its dependencies hidden.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from typing import List, NamedTuple, Optional, Tuple

from ._extras import MissingExtraError, require_extra
from ._signals import INTERRUPTS, exit_code, process_entry, signal_name, signals_raise


class Tool(NamedTuple):
    target: str                  # "module:function", the tool's main(argv) -> int
    extra: Optional[str]         # the extra every run needs (None: numpy + numba suffice)
    modules: Tuple[str, ...]     # what that extra must provide for any run of the tool


TOOLS = {
    # Format-specific packages (zstandard for .zst, pyarrow for Parquet) are checked where used.
    "preprocess-sft": Tool("megatron_sft_idx.preprocess.cli:main", "preprocess",
                           ("transformers", "tokenizers", "jinja2", "tqdm", "huggingface_hub")),
    # A store holds tokens already: no tokenizer unless --verify-masks (checked where used).
    "repack-sft": Tool("megatron_sft_idx.preprocess.repack_cli:repack_main", "preprocess", ("tqdm",)),
    "check-idx": Tool("megatron_sft_idx.gate.cli:main", None, ()),
    "write-sft-manifest": Tool("megatron_sft_idx.training.manifest_cli:main", None, ()),
    # The shard tools need the core only; --to parquet, --sql and --plot check the 'tools' extra where used.
    "merge-shards": Tool("megatron_sft_idx.tools.merge_cli:main", None, ()),
    "convert-packed": Tool("megatron_sft_idx.tools.convert_cli:main", None, ()),
    "inspect-idx": Tool("megatron_sft_idx.tools.inspect_cli:main", None, ()),
    # Reads shard indexes only; --plot checks the 'tools' extra where used.
    "plan-batches": Tool("megatron_sft_idx.tools.plan_batches_cli:main", None, ()),
}


def run(name: str, argv: Optional[List[str]] = None) -> int:
    """Run tool ``name`` with ``argv`` (default ``sys.argv[1:]``); its exit status."""
    tool = TOOLS[name]
    if argv is None:  # the process's own command line: the tool owns its signals until exit
        process_entry()
        if "megatron_sft_idx._numba" in sys.modules:  # tools/*.py import their CLI first
            sys.modules["megatron_sft_idx._numba"].skip_extensions()
    asks_help = any(a in ("-h", "--help") for a in (sys.argv[1:] if argv is None else argv))
    try:
        if tool.extra is not None and not asks_help:  # the help is read before installing more
            require_extra(tool.extra, *tool.modules, user=name)
        module, function = tool.target.split(":")
        with signals_raise():  # a signal while the tool is still importing: it has done nothing yet
            entry = getattr(import_module(module), function)
    except MissingExtraError as exc:
        print(f"{name}: error: {exc.detail}", file=sys.stderr)
        return 2
    except INTERRUPTS as exc:
        print(f"{name}: interrupted by {signal_name(exc)} while starting; nothing was done", file=sys.stderr)
        return exit_code(exc)
    try:
        return entry(argv)
    except MissingExtraError as exc:
        print(f"{name}: error: {exc.detail}", file=sys.stderr)
        return 2


def __getattr__(name: str):
    """``preprocess_sft`` etc.: the zero-argument function a console script calls, for each TOOLS row."""
    tool = name.replace("_", "-")
    if tool not in TOOLS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return lambda: run(tool)


def sft_idx_check(argv: Optional[List[str]] = None) -> int:
    """The native checker (``csrc/sft_idx_check.cpp``) built at install time, run in this process's place.

    Without it (no C++ compiler when the package was installed, or ``MEGATRON_SFT_IDX_NATIVE=0``)
    one line says why and what to do instead; exit status 2.
    """
    from .native import NativeLibraryError, checker_path   # (start-up: every console script imports this
    from .storage.urls import local_only                   # module; only this one needs these)

    args = sys.argv[1:] if argv is None else list(argv)
    # the native checker maps local files; check-idx streams the same passes from URLs
    refused = local_only((("", a) for a in args), "the native checker reads local files only; check URLs "
                         "with check-idx (same checks, streamed from object storage)")
    if refused:
        print(f"sft_idx_check: error: {refused}", file=sys.stderr)
        return 2
    try:
        path = checker_path()
    except NativeLibraryError as exc:
        print(f"sft_idx_check: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, ["sft_idx_check", *args])  # replaces this process: exit status and signals are the checker's
    return 2  # not reached


__all__ = ["TOOLS", "run", "sft_idx_check"]
