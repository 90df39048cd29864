"""Atomic promotion of checked shards into training storage.

A shard that passed is moved (or hard-linked with ``link=True``) into a
destination directory so that no reader ever opens a half-promoted shard:

1. every file is placed under a temporary name beside its final name — a hard
   link on the same filesystem (no data copied), else a copy that is fsynced;
2. when replacing, the old ``.idx`` is removed first (an old index can never
   pair with new data), then any old file the new shard lacks;
3. the temporaries are renamed over the final names in publish order, ``.idx``
   last, and the directory is fsynced (``_atomic.publish``, shared with the builder);
4. for a move, the source files are removed, ``.idx`` first.

A crash before step 3 ends leaves no ``.idx`` at the destination, so nothing
there opens; a crash in step 4 leaves a complete copy at both places.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict

from .. import _atomic
from ..errors import RemoteStorageError, ShardError, ShardExistsError
from ..storage import is_remote
from ..format import IDX_SUFFIX, PUBLISH_ORDER, ShardPaths
from .report import Report, ShardReport, make_finding


def promote(shard: ShardReport, dest, *, link: bool = False, replace: bool = False) -> Dict[str, str]:
    """Move (or hard-link) a passing shard's files into directory ``dest``, ``.idx`` last.

    Returns:
        ``{suffix: destination path}`` for every file promoted.

    Raises:
        ShardExistsError: a shard exists at the destination and ``replace`` is false.
        ShardError: the shard did not pass, a file changed since it was checked, or ``link``
            across filesystems -- all refused before anything is touched.
        OSError: an I/O failure while placing files (nothing that opens is left at ``dest``).
    """
    if not shard.passed:
        raise ShardError("refusing to promote a shard that failed the check", path=shard.prefix)
    dest = os.fspath(dest)
    os.makedirs(dest, exist_ok=True)
    suffixes = [s for s in PUBLISH_ORDER if s in shard.files]
    source = {s: shard.prefix + s for s in suffixes}
    dest_prefix = os.path.join(dest, os.path.basename(shard.prefix))
    final = {s: dest_prefix + s for s in suffixes}
    if os.path.abspath(dest_prefix) == os.path.abspath(shard.prefix):
        raise ShardError("the shard is already at the destination", path=shard.prefix)
    _verify_unchanged(shard, source)
    existing = [p for p in ShardPaths.from_prefix(dest_prefix) if os.path.lexists(p)]
    if existing and not replace:
        raise ShardExistsError("a shard already exists at the destination", path=dest_prefix,
                               actual=[os.path.basename(p) for p in existing])
    same_fs = os.stat(os.path.dirname(os.path.abspath(shard.prefix))).st_dev == os.stat(dest).st_dev
    if link and not same_fs:
        raise ShardError("--link needs the destination on the same filesystem as the shard",
                         path=dest, hint="promote without --link (the files are then copied)")
    _atomic.clear_stale_temporaries(final.values())
    tmp: Dict[str, str] = {}
    try:
        for suffix in suffixes:
            tmp[suffix] = _atomic.temporary_path(final[suffix])
            _place(source[suffix], tmp[suffix], same_fs, link, shard.files[suffix])
        if existing:
            _remove_old(dest_prefix, final)
        _atomic.publish([(tmp[s], final[s]) for s in suffixes], unpublish_first=dest_prefix + IDX_SUFFIX)
    except BaseException:
        _atomic.remove_quietly(tmp.values())
        raise
    if not link:
        # The source goes .idx first, so its prefix never opens with files missing.
        _atomic.remove_quietly(source[s] for s in reversed(suffixes))
        _atomic.fsync_dir(shard.prefix)
    return final


def _verify_unchanged(shard: ShardReport, source: Dict[str, str]) -> None:
    for suffix, path in source.items():
        st = os.stat(path)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != shard.identity.get(suffix):
            raise ShardError("the file changed after it was checked", path=path,
                                   hint="check the shard again before promoting it")


def _place(src: str, tmp: str, same_fs: bool, link: bool, size: int) -> None:
    """Put ``src``'s bytes at ``tmp``: a hard link when possible, else a copy that is fsynced."""
    if same_fs:
        try:
            os.link(src, tmp)
            return
        except OSError:
            if link:
                raise
    shutil.copyfile(src, tmp)
    if os.path.getsize(tmp) != size:
        raise OSError(f"copy of {src} has {os.path.getsize(tmp)} bytes, expected {size}")
    _atomic.fsync_file(tmp)


def _remove_old(dest_prefix: str, final: Dict[str, str]) -> None:
    """Old .idx first, then old files the new shard does not replace (e.g. SFT companions)."""
    _atomic.remove_quietly([dest_prefix + IDX_SUFFIX])
    _atomic.fsync_dir(dest_prefix)
    _atomic.remove_quietly(p for p in ShardPaths.from_prefix(dest_prefix) if p not in final.values())


def promote_remote(shard: ShardReport, dest, **kw) -> Dict[str, str]:
    from .remote import promote_remote as upload

    return upload(shard, dest, **kw)


def promote_report(report: Report, dest, *, link: bool = False, replace: bool = False) -> Report:
    """Promote every passing shard of ``report``; record where each file went, or why not.

    Adds a finding to every shard: PROMOTED, NOT_PROMOTED (it failed), PROMOTION_REFUSED
    or PROMOTION_FAILED (the latter two fail the shard and the run).
    """
    names = set()
    for shard in report.shards:
        if not shard.passed:
            shard.add(make_finding("NOT_PROMOTED", "the shard failed the check and was left in place",
                                   shard.prefix))
            continue
        name = os.path.basename(shard.prefix)
        if name in names:
            shard.add(make_finding("PROMOTION_REFUSED", f"another shard of this run is named {name!r}",
                                   shard.prefix))
            continue
        names.add(name)
        try:
            place = promote_remote if is_remote(dest) else promote  # s3:// msc://: upload, .idx last
            shard.promoted = place(shard, dest, link=link, replace=replace)
        except RemoteStorageError as exc:  # mid-upload: the destination's .idx was not written
            shard.add(make_finding("PROMOTION_FAILED", str(exc), shard.prefix))
        except ShardError as exc:  # raised before anything was touched
            shard.add(make_finding("PROMOTION_REFUSED", str(exc), shard.prefix))
        except OSError as exc:
            shard.add(make_finding("PROMOTION_FAILED", f"{exc.__class__.__name__}: {exc}", shard.prefix))
        else:
            verb = "linked" if link else "moved"
            shard.add(make_finding("PROMOTED", f"{verb} {len(shard.promoted)} files to {dest}", shard.prefix))
    report.options.update({"promote": os.fspath(dest), "link": link, "replace": replace})
    return report


__all__ = ["promote", "promote_report"]
