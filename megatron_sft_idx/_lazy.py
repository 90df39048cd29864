"""Package attributes imported on first use (PEP 562), so that importing a package stays cheap:
``megatron_sft_idx``, ``.training`` and ``.storage`` each name their public objects and the
module holding each, and load that module only when the name is first looked up."""

from __future__ import annotations

from importlib import import_module
from typing import Callable, Mapping


def lazy_getattr(package: str, public: Mapping[str, str], namespace: dict) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: ``public`` maps a name to its (relative) module;
    a name once loaded is stored in ``namespace`` (the package's globals), so it is looked up once."""

    def __getattr__(name: str):
        module = public.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module, package), name)
        namespace[name] = value
        return value

    return __getattr__
