"""Output names, the work directory, and publishing every output shard at the end.

Shards are built under a work directory next to the output
(``.<name>.work-<pid>``) and moved to their final names only after every
shard (and ``--check``) succeeded, ``.idx`` last per shard. A run that is
killed leaves only its work directory, which the next run removes (its pid is
no longer alive); nothing ever appears under a final name half-written.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from typing import List, Sequence

from .. import _atomic
from ..errors import ShardExistsError
from ..format import ALL_SUFFIXES, IDX_SUFFIX, PUBLISH_ORDER

SPLIT_NAMES = ("train", "valid", "test")
_WORK_TAG = ".work-"


def split_prefix(output_prefix: str, split: str, splitting: bool) -> str:
    return f"{output_prefix}_{split}" if splitting else output_prefix


def shard_prefix(base: str, index: int, numbered: bool) -> str:
    return f"{base}_{index:06d}" if numbered else base


def existing_outputs(bases: Sequence[str]) -> List[str]:
    """Files of shards already at ``base`` or ``base_NNNNNN`` for any base."""
    found = []
    for base in bases:
        for suffix in ALL_SUFFIXES:
            if os.path.exists(base + suffix):
                found.append(base + suffix)
        numbered = re.compile(re.escape(os.path.basename(base)) + r"_\d{6}(\.|$)")
        for path in glob.glob(glob.escape(base) + "_" + "[0-9]" * 6 + ".*"):
            if numbered.match(os.path.basename(path)) and path.endswith(ALL_SUFFIXES):
                found.append(path)
    return sorted(set(found))


def refuse_existing(bases: Sequence[str], overwrite: bool) -> List[str]:
    """Raise unless no output exists or ``overwrite``; returns what would be replaced.

    Raises:
        ShardExistsError: an output exists and ``overwrite`` is false.
    """
    found = existing_outputs(bases)
    if found and not overwrite:
        raise ShardExistsError(f"output already exists ({len(found)} file(s), e.g. {found[0]})",
                               path=found[0], hint="pass --overwrite to replace it, or choose another --output-prefix")
    return found


def make_work_dir(output_prefix: str) -> str:
    """Create this run's work directory after removing those of runs that are no longer alive."""
    parent = os.path.dirname(os.path.abspath(output_prefix))
    name = os.path.basename(output_prefix)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, glob.escape(f".{name}{_WORK_TAG}") + "*")):
        pid_text = stale.rsplit(_WORK_TAG, 1)[-1]
        if pid_text.isdigit() and not _atomic._alive(int(pid_text)) and int(pid_text) != os.getpid():
            shutil.rmtree(stale, ignore_errors=True)
    work = os.path.join(parent, f".{name}{_WORK_TAG}{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "spool"))
    os.makedirs(os.path.join(work, "staged"))
    return work


def staged_prefix(work_dir: str, final_prefix: str) -> str:
    return os.path.join(work_dir, "staged", os.path.basename(final_prefix))


def publish_all(pairs: Sequence[tuple], replaced: Sequence[str]) -> None:
    """Remove replaced outputs (``.idx`` first), then move each staged shard to its final prefix."""
    for path in sorted(replaced, key=lambda p: not p.endswith(IDX_SUFFIX)):
        _atomic.remove_quietly([path])
    for staged, final in pairs:
        _atomic.publish([(staged + s, final + s) for s in PUBLISH_ORDER], unpublish_first=final + IDX_SUFFIX)
