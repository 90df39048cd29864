"""Optional dependencies: say which extra to install, in one line, before anything fails deep inside.

The core (reader, builder, packing, gate) needs only numpy and numba. Everything else comes
with an extra declared in ``pyproject.toml``; code that needs one calls :func:`require_extra`
just before the import (as datatrove's steps declare ``_requires_dependencies``)::

    require_extra("preprocess", "zstandard")
    import zstandard

Without the package this raises :class:`MissingExtraError` (an ``ImportError``) whose message
is one line naming the extra and the pip command; the console scripts
(:mod:`megatron_sft_idx._console`) print that line and exit 2 instead of a traceback.
Only the standard library is imported here: the reader's import cost must stay flat.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional

DISTRIBUTION = "megatron_sft_idx"


class MissingExtraError(ImportError):
    """An optional dependency is missing; ``.extra`` is the extra that brings it, ``.module`` the import."""

    def __init__(self, extra: str, module: str, user: str) -> None:
        self.extra, self.module, self.user = extra, module, user
        # What a tool prints after "tool: error: "; the exception's message leads with who needs it.
        self.detail = f"needs the '{extra}' extra ({module} is not installed): {install_command(extra)}"
        super().__init__(f"{user} {self.detail}", name=module)

    def __reduce__(self):  # raised in a worker process, it must unpickle in the parent
        return type(self), (self.extra, self.module, self.user)


def install_command(extra: str) -> str:
    """The pip command that installs ``extra``, quoted for a POSIX shell."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def _importable(module: str) -> bool:
    """True when ``module`` can be found, without importing it (a cheap path lookup)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or __spec__ is None
        return False


def require_extra(extra: str, *modules: str, user: Optional[str] = None) -> None:
    """Raise :class:`MissingExtraError` unless every one of ``modules`` is importable.

    ``user`` names who needs them in the message (a tool such as ``preprocess-sft``);
    by default the calling module's name, so an import site stays a one-line call.

    Raises:
        MissingExtraError: the first module of ``modules`` that cannot be found.
    """
    for module in modules:
        if sys.modules.get(module) is not None or _importable(module):
            continue
        if user is None:
            # The caller's module name: one frame up, so call sites need not repeat it.
            user = sys._getframe(1).f_globals.get("__name__", DISTRIBUTION)
        raise MissingExtraError(extra, module, user)


__all__ = ["MissingExtraError", "require_extra", "install_command", "DISTRIBUTION"]
