"""Turn the gate's inputs (prefixes, globs, directories, file names, manifests) into shard
prefixes, remembering how each was named (:class:`Selection`): the set rules apply to what a
directory, a glob or a manifest selects (:mod:`megatron_sft_idx.sets`)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from ..errors import ShardNotFoundError
from ..format import ALL_SUFFIXES
from ..manifest import MANIFEST_SUFFIX, load_manifest, require_entries_present
from ..storage.paths import names_file, select


@dataclass(frozen=True)
class Selection:
    """The shards one input names: ``kind`` is ``"prefix"``, ``"directory"``, ``"glob"`` or
    ``"manifest"``; ``source`` the input as given."""

    kind: str
    source: str
    prefixes: Tuple[str, ...]

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


def _manifest(arg: str) -> List[str]:
    """The prefixes a manifest lists, each there (local: its ``.idx`` exists).

    Raises:
        ShardError: the manifest is malformed; ShardNotFoundError: an entry's shard is not
        there (naming the manifest and the entry).
    """
    m = load_manifest(arg)
    require_entries_present(arg, m.prefixes, urls=True)
    return list(m.prefixes)


def _expand(arg: str) -> Tuple[str, List[str]]:
    """``(kind, prefixes)`` of one input: a manifest's entries, or what :func:`_expand_local`
    (a URL: its store's listing) finds."""
    if arg.endswith(MANIFEST_SUFFIX) and names_file(arg):
        return "manifest", _manifest(arg)
    return select(arg, _expand_local)


def _kind(arg: str) -> str:
    """What a local input is: a directory, a prefix (a file of the shard exists) or a glob."""
    if os.path.isdir(arg):
        return "directory"
    if _is_prefix(arg):
        return "prefix"
    return "glob" if glob.has_magic(arg) else "prefix"


def _expand_local(arg: str) -> Tuple[str, List[str]]:
    kind = _kind(arg)
    if kind == "directory":
        return kind, _in_directory(arg)
    if _is_prefix(arg):
        return kind, [arg]
    return kind, _expand_glob(arg) if kind == "glob" else _file(arg)


def _file(arg: str) -> List[str]:
    if os.path.isfile(arg):
        prefix = prefix_of(arg)
        return [prefix] if prefix is not None else []
    return []


def _expand_glob(arg: str) -> List[str]:
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


def resolve_prefixes(inputs: Union[str, "os.PathLike[str]", Sequence]) -> List[str]:
    """Every shard prefix named by ``inputs``, in order, without duplicates.

    Raises:
        ShardNotFoundError: an input matches no shard file (a typo must not pass as "nothing to
        check"), or a manifest lists a shard that is not there.
        ShardError: a manifest is malformed.
    """
    seen, out = set(), []
    for selection in resolve_selections(inputs):
        for prefix in selection.prefixes:
            if prefix not in seen:
                seen.add(prefix)
                out.append(prefix)
    return out


def resolve_selections(inputs: Union[str, "os.PathLike[str]", Sequence]) -> List[Selection]:
    """What each input names, and how (see :class:`Selection`); raises as :func:`resolve_prefixes`."""
    if isinstance(inputs, (str, bytes, os.PathLike)):
        inputs = [inputs]
    out: List[Selection] = []
    unmatched = []
    for raw in inputs:
        arg = os.fspath(raw)
        kind, found = _expand(arg)
        if not found:
            unmatched.append(arg)
        else:
            out.append(Selection(kind, arg, tuple(dict.fromkeys(found))))
    if unmatched or not out:
        raise ShardNotFoundError(f"no shard file matches {unmatched or list(inputs)}",
                                 path=", ".join(unmatched) or None, field="prefixes",
                                 hint="give a prefix (path without .idx/.bin), a glob or a directory")
    return out
