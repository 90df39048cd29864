"""What a fuzz or property test may assert about a refusal: its class, and the file it concerns.

A mutated artifact can be refused correctly by more than one reader -- a mutated store by the
store's reader, or by the plan's check against the store -- so a test names every file
legitimately involved and checks that the error's ``path`` is one of them (or inside one of the
directories), never one spelling of the message.
"""

import os

from megatron_sft_idx.errors import ShardError


def concerns(exc: BaseException, *involved, error=ShardError) -> str:
    """Assert ``exc`` is an ``error`` whose ``path`` attribute is one of ``involved`` (files or
    directories; a path inside a directory counts, ``file:line`` counts as ``file``) and whose
    message is one line. Returns the path.
    """
    assert isinstance(exc, error), f"{type(exc).__name__} is not a {error.__name__}: {exc}"
    path = getattr(exc, "path", None)
    assert path, f"the refusal names no file: {exc}"
    assert "\n" not in str(exc), f"the refusal is not one line: {exc}"
    roots = [os.path.realpath(str(p)) for p in involved]
    for candidate in (path, path.rsplit(":", 1)[0]):
        real = os.path.realpath(candidate)
        if any(real == root or real.startswith(root + os.sep) for root in roots):
            return path
    raise AssertionError(f"the refusal concerns {path!r}, none of the files involved {roots}: {exc}")
