"""numba, for the project's kernels: every kernel module imports it from here.

In a command-line tool's own process, numba is kept from running every installed package's
``numba_extensions`` entry point at its first compile (``_console.run`` calls
:func:`skip_extensions`, or this module does when imported after
:func:`._signals.process_entry`). The kernels use none, and awkward's (installed with
gigatoken) imports awkward and pyarrow: 35-55 MiB resident in each preprocessing process for
nothing. A library caller's process is left as it is, since its own code may use them.
"""

from __future__ import annotations

import numba

from ._signals import is_tool_process


def skip_extensions() -> None:
    """Before numba's first compile: never run the installed ``numba_extensions`` entry points."""
    try:
        from numba.core import entrypoints
    except ImportError:  # a numba without entry points: nothing to skip
        return
    if hasattr(entrypoints, "_already_initialized"):  # numba's own once-only guard
        entrypoints._already_initialized = True


if is_tool_process():
    skip_extensions()

__all__ = ["numba", "skip_extensions"]
