"""Atomic promotion of checked shards into training storage.

A shard that passed is moved (or hard-linked with ``link=True``) into a
destination directory so that no reader ever opens a half-promoted shard:

1. every file is placed under a temporary name beside its final name: the
   ``.idx`` always as a fresh copy (readers tell generations apart by its inode,
   see ``_files.py``), the others as a hard link on the same filesystem (no data
   copied), else as a copy that is fsynced;
2. they are committed by :func:`megatron_sft_idx.publishing.commit_shard`, the rule the
   builder and every other writer share: under the directory's lock, the old ``.idx`` is
   removed first (an old index can never pair with new data), then any old file the new
   shard lacks; the temporaries are renamed over the final names in publish order,
   ``.idx`` last, and the directory is fsynced;
3. for a move, the source files are removed, ``.idx`` first (``publishing.remove_shard``):
   by :func:`promote_report` only once every shard of the run is placed and the manifests
   that list them are written at the destination (:mod:`.travel`).

A crash before step 2 ends leaves no ``.idx`` at the destination, so nothing
there opens; a crash in step 3 leaves a complete copy at both places.

Symbolic links are resolved: the destination always receives regular files
holding the content that was checked (a hard link to, or a copy of, the link's
target); a move removes the source links, never their targets. A link that
dangles, or whose target changed since the check, is refused.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, Optional, Sequence

from .. import _atomic, publishing
from ..errors import RemoteStorageError, ShardError
from ..format import IDX_SUFFIX, PUBLISH_ORDER
from ..storage.destination import Destination, destination_for
from .checks import require_whole_sets_found
from .report import Report, ShardReport, make_finding
from .travel import commit, plan


def promote(shard: ShardReport, dest, *, link: bool = False, replace: bool = False,
            keep_source: bool = False, destination: Optional[Destination] = None) -> Dict[str, str]:
    """Move (or hard-link) a passing shard's files into directory ``dest`` (a path, or an
    ``s3://`` / ``msc://`` "directory": uploaded), ``.idx`` last. ``keep_source``: leave the
    source files for the caller to remove (after its manifests).

    Returns:
        ``{suffix: destination path}`` for every file promoted.

    Raises:
        ShardExistsError: a shard exists at the destination and ``replace`` is false.
        ShardError: the shard did not pass, a file changed (or a link's target vanished)
            since it was checked, or ``link`` across filesystems or into object storage -- all
            refused before anything is published.
        OSError, RemoteStorageError: a failure while placing files (nothing that opens is left
            at ``dest``).
    """
    if not shard.passed:
        raise ShardError("refusing to promote a shard that failed the check", path=shard.prefix)
    dest = os.fspath(dest)
    destination = destination or destination_for(dest)
    if link and not destination.moves:
        raise ShardError("--link cannot link into object storage", path=dest, hint="promote without --link")
    destination.make_directory(dest)
    suffixes = [s for s in PUBLISH_ORDER if s in shard.files]
    source = {s: shard.prefix + s for s in suffixes}
    dest_prefix = destination.join(dest, os.path.basename(shard.prefix))
    final = {s: dest_prefix + s for s in suffixes}
    if destination.normal(dest_prefix) == os.path.abspath(shard.prefix):
        raise ShardError("the shard is already at the destination", path=shard.prefix)
    _verify_unchanged(shard, source)
    existing = destination.existing(dest_prefix)
    if not replace:
        publishing.refuse_existing([dest_prefix + s for s in existing], replace_with="--replace")
    tmp: Dict[str, Optional[str]] = {s: destination.temporary(final[s]) for s in suffixes}
    staged = {s: t for s, t in tmp.items() if t is not None}   # (a destination that uploads reads the sources)
    if staged:
        dest_dev = os.stat(os.path.dirname(next(iter(staged.values())))).st_dev
        same_fs = {s: shard.identity[s][0] == dest_dev for s in staged}
        if link and not all(same_fs[s] for s in staged if s != IDX_SUFFIX):
            raise ShardError("--link needs the destination on the same filesystem as the shard",
                             path=dest, hint="promote without --link (the files are then copied)")
    try:
        for suffix, path in staged.items():
            _place(source[suffix], path, same_fs[suffix] and suffix != IDX_SUFFIX, link, shard.identity[suffix])
        publishing.commit_shard({s: tmp[s] or source[s] for s in suffixes}, dest_prefix, destination,
                                existing=existing)
    except BaseException:
        _atomic.remove_quietly(staged.values())
        raise
    if not link and not keep_source:  # a source that is a symbolic link loses the link only
        publishing.remove_shard(shard.prefix, suffixes)
    return final


def _identity(path: str) -> tuple:
    st = os.stat(path)  # follows symbolic links: the content is what was checked
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _verify_unchanged(shard: ShardReport, source: Dict[str, str]) -> None:
    for suffix, path in source.items():
        try:
            now = _identity(path)
        except OSError as exc:
            raise ShardError(f"the file is gone or unreadable since it was checked: {exc.strerror or exc}",
                             path=path, hint="check the shard again before promoting it") from None
        if now != shard.identity.get(suffix):
            raise ShardError("the file changed after it was checked", path=path,
                             hint="check the shard again before promoting it")


def _place(src: str, tmp: str, hard_link: bool, link: bool, identity: tuple) -> None:
    """Put the checked content of ``src`` at ``tmp`` as a regular file: a hard link to its
    (symbolic links resolved) inode when ``hard_link``, else a copy that is fsynced.

    Raises:
        ShardError: the content is no longer the one that was checked.
        OSError: linking (with ``link``) or copying failed.
    """
    target = os.path.realpath(src)
    if hard_link:
        try:
            os.link(target, tmp)
        except OSError:
            if link:
                raise
        else:
            if _identity(tmp)[:2] != identity[:2]:
                raise ShardError("the file changed after it was checked", path=src,
                                 hint="check the shard again before promoting it")
            return
    copy_file(target, tmp)
    if os.path.getsize(tmp) != identity[2] or _identity(target) != identity:
        raise ShardError("the file changed while it was copied", path=src,
                         hint="check the shard again before promoting it")


def copy_file(src: str, dst: str) -> None:
    """Copy ``src`` to the new file ``dst`` and fsync it (the one place promotion writes data)."""
    shutil.copyfile(src, dst)
    _atomic.fsync_file(dst)


def promote_report(report: Report, dest, *, link: bool = False, replace: bool = False,
                   inputs: Sequence[str] = ()) -> Report:
    """Promote every passing shard of ``report`` with the manifests and orders that travel with
    them (:mod:`.travel`), by the set's commit rule (:func:`megatron_sft_idx.publishing.commit_set`),
    then read the destination back; record where each file went, or why not. ``inputs``: what
    the check was given (a manifest among them travels even when it lives elsewhere).

    A set is promoted whole or not at all: the shards given must hold every member of each
    set they touch (``SET_INCOMPLETE``), and a set with a failing member is not promoted; an
    order or manifest that travels is verified before anything moves. Adds a finding to every
    shard: PROMOTED, NOT_PROMOTED (it failed), PROMOTION_REFUSED, TRAVELLER_INVALID or
    PROMOTION_FAILED; and DESTINATION_INCOMPLETE where the destination read back is not whole
    (the sources are then kept). Every one but PROMOTED and NOT_PROMOTED fails the run.
    """
    dest = os.fspath(dest)
    destination = destination_for(dest)
    require_whole_sets_found(report.shards, "the shards given to --promote")
    candidates = _candidates(report)
    the_plan = plan(candidates, dest, destination, replace=replace, inputs=inputs)
    movable = []
    for shard in candidates:
        if shard.prefix in the_plan.refused:
            code, why = the_plan.refused[shard.prefix]
            shard.add(make_finding(code, why, shard.prefix))
        else:
            movable.append(shard)
    moved = commit(the_plan, movable, report, destination, dest,
                   lambda shard: _promote_one(shard, dest, destination, link, replace), link=link)
    if not link:  # the sources go last, after the manifests that listed them
        for shard in moved:
            publishing.remove_shard(shard.prefix, [s for s in PUBLISH_ORDER if s in shard.files])
    report.options.update({"promote": dest, "link": link, "replace": replace})
    return report


def _candidates(report: Report) -> List[ShardReport]:
    """The shards that may be promoted; the others get NOT_PROMOTED or PROMOTION_REFUSED."""
    failed_sets = {s.shard_set.id: s.prefix for s in report.shards if not s.passed and s.shard_set is not None}
    names, out = set(), []
    for shard in report.shards:
        if not shard.passed:
            shard.add(make_finding("NOT_PROMOTED", "the shard failed the check and was left in place",
                                   shard.prefix))
            continue
        name = os.path.basename(shard.prefix)
        if shard.shard_set is not None and shard.shard_set.id in failed_sets:
            why = (f"{failed_sets[shard.shard_set.id]} of its {shard.shard_set.describe()} failed the check: "
                   "a set is promoted whole or not at all")
        elif name in names:
            why = f"another shard of this run is named {name!r}"
        else:
            names.add(name)
            out.append(shard)
            continue
        shard.add(make_finding("PROMOTION_REFUSED", why, shard.prefix))
    return out


def _promote_one(shard: ShardReport, dest: str, destination: Destination, link: bool, replace: bool) -> bool:
    """Place one shard at ``dest`` (its source kept); True when it was committed there."""
    try:
        shard.promoted = promote(shard, dest, link=link, replace=replace, keep_source=True, destination=destination)
    except RemoteStorageError as exc:  # mid-upload: the destination's .idx was not written
        shard.add(make_finding("PROMOTION_FAILED", str(exc), shard.prefix))
    except ShardError as exc:  # raised before anything was touched
        shard.add(make_finding("PROMOTION_REFUSED", str(exc), shard.prefix))
    except OSError as exc:
        shard.add(make_finding("PROMOTION_FAILED", f"{exc.__class__.__name__}: {exc}", shard.prefix))
    else:
        verb = "linked" if link else "moved"
        shard.add(make_finding("PROMOTED", f"{verb} {len(shard.promoted)} files to {dest}", shard.prefix))
        return True
    return False


__all__ = ["promote", "promote_report"]
