"""Turn the gate's inputs (prefixes, globs, directories, file names) into shard prefixes."""

from __future__ import annotations

import glob
import os
from typing import List, Optional, Sequence, Union

from ..errors import ShardNotFoundError
from ..format import ALL_SUFFIXES
from ..storage import is_remote

#: Longest first, so "x.seq.idx" is prefix "x", not "x.seq".
_SUFFIXES = tuple(sorted(ALL_SUFFIXES, key=len, reverse=True))
_TMP_TAG = ".tmp-"


def prefix_of(path: str) -> Optional[str]:
    """The shard prefix of one of its files, or None (also for a builder's temporary)."""
    if _TMP_TAG in os.path.basename(path):
        return None
    for suffix in _SUFFIXES:
        if path.endswith(suffix) and len(path) > len(suffix):
            return path[: -len(suffix)]
    return None


def _is_prefix(path: str) -> bool:
    return any(os.path.lexists(path + suffix) for suffix in ALL_SUFFIXES)


def _in_directory(directory: str) -> List[str]:
    found = []
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full):
            prefix = prefix_of(full)
            if prefix is not None:
                found.append(prefix)
    return found


def _expand(arg: str) -> List[str]:
    if is_remote(arg):
        from ..storage.discover import expand_remote
        return expand_remote(arg)
    if os.path.isdir(arg):
        return _in_directory(arg)
    if _is_prefix(arg):
        return [arg]
    if glob.has_magic(arg):
        out = []
        for match in sorted(glob.glob(arg)):
            if os.path.isdir(match):
                out += _in_directory(match)
            else:
                prefix = prefix_of(match) if os.path.isfile(match) else None
                if prefix is not None:
                    out.append(prefix)
                elif _is_prefix(match):
                    out.append(match)
        return out
    if os.path.isfile(arg):
        prefix = prefix_of(arg)
        return [prefix] if prefix is not None else []
    return []


def resolve_prefixes(inputs: Union[str, "os.PathLike[str]", Sequence]) -> List[str]:
    """Every shard prefix named by ``inputs``, in order, without duplicates.

    Raises:
        ShardNotFoundError: an input matches no shard file (a typo must not pass as "nothing to check").
    """
    if isinstance(inputs, (str, bytes, os.PathLike)):
        inputs = [inputs]
    seen, out, unmatched = set(), [], []
    for raw in inputs:
        arg = os.fspath(raw)
        found = _expand(arg)
        if not found:
            unmatched.append(arg)
        for prefix in found:
            if prefix not in seen:
                seen.add(prefix)
                out.append(prefix)
    if unmatched or not out:
        raise ShardNotFoundError(f"no shard file matches {unmatched or list(inputs)}",
                                 path=", ".join(unmatched) or None, field="prefixes",
                                 hint="give a prefix (path without .idx/.bin), a glob or a directory")
    return out
