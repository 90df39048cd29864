"""Publishing: the one commit rule for a shard and for a set, on local disk or in object storage.

Every writer publishes through here: the builder, preprocess and repack, the promotion gate,
the shard tools (merge, convert) and uploads (``storage.upload_shard`` / ``publish``).

**A shard** (:func:`commit_shard`) -- its files complete and durable first, ``.idx`` last:

1. the new files are made durable (local: every source fsynced; they are temporaries beside
   the final names, or a staged shard on the same filesystem);
2. (local: under a lock on the directory, so publications into it take turns) the old ``.idx``
   is removed first, so no reader can pair an old index with new data, then the old files
   the new shard lacks;
3. the data files are put in place (local: renamed in publish order; object storage:
   uploaded in parallel), then the ``.idx``: the commit point every reader needs (upstream's
   too), always a file created for this publication (local readers tell generations apart by
   its inode, ``_files.py``);
4. local: the directory is fsynced; object storage: the objects' sizes are checked against
   the local files.

A failure before the ``.idx`` is in place leaves nothing that opens; from temporaries, the
files already renamed are removed again (the prefix holds no dataset rather than a mixture);
a staged shard is left where it stopped, and a rerun finishes it (:func:`commit_staged`).

**A set** (:func:`publish_set`, :func:`publish`): its manifests are removed before the first
shard is touched, the old outputs it replaces are removed (every ``.idx`` before any other
file), each shard is committed, then its balanced pack orders (``--balance-for``: derived
files beside the data, each written whole, atomically), and the manifests are written last --
the set's commit point, recording its order -- so a reader of the set sees the whole previous
set, no set, or the whole new set.

**An existing output** is refused by :func:`refuse_existing`, one message for every door.

**A moved shard's source** goes ``.idx`` first (:func:`remove_shard`), so it never opens
with files missing.

Destinations: :class:`LocalDestination` here, ``storage.upload.ObjectDestination`` for
``s3://`` / ``msc://`` (the primitives, with their deadlines and checks; imported for URLs
only). This module orders them; it never imports a storage client.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _atomic
from .errors import RemoteStorageError, ShardError, ShardExistsError, ShardNotFoundError
from .format import ALL_SUFFIXES, IDX_SUFFIX, PUBLISH_ORDER, SEQ_IDX_SUFFIX
from .storage._url import ObjectURL, is_remote

if TYPE_CHECKING:
    from .manifest import OrderRecord

__all__ = ["LocalDestination", "destination_for", "commit_shard", "commit_staged", "remove_shard",
           "existing_shard", "refuse_existing", "upload_shard", "publish_shard", "publish", "local_files",
           "StagedShard", "StagedSet", "StagedOrder", "publish_set", "manifest_bytes", "write_bytes",
           "write_manifest", "upload_file"]


# --------------------------------------------------------------------------- destinations


class LocalDestination:
    """Where files go on local disk. The interface every destination has: ``existing(prefix)``
    (suffixes present), ``exists(path)``, ``prepare(sources)`` (make them durable),
    ``turn(prefix)`` (a context: publications into one place take turns), ``remove(paths)``,
    ``sync(prefix)``, ``put(source, final)``, ``put_many(pairs)``, ``finish(prefix, files)``,
    ``write_bytes(path, data)``."""

    remote = False

    def existing(self, prefix: str) -> List[str]:
        return [s for s in ALL_SUFFIXES if os.path.lexists(prefix + s)]

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def prepare(self, sources: Iterable[str]) -> None:
        for path in sources:
            _atomic.fsync_file(path)

    def turn(self, prefix: str):
        return _atomic.directory_lock(prefix)

    def remove(self, paths: Iterable[str]) -> None:
        _atomic.remove_quietly(paths)

    def sync(self, prefix: str) -> None:
        _atomic.fsync_dir(prefix)

    def put(self, source: str, final: str) -> None:
        os.replace(source, final)
        if os.path.lexists(source):
            # rename() of two links to one inode succeeds and does nothing (POSIX): the final
            # name already holds this content (a rerun of a killed promotion).
            os.unlink(source)

    def put_many(self, pairs: Sequence[Tuple[str, str]]) -> None:
        for source, final in pairs:
            self.put(source, final)

    def finish(self, prefix: str, files: Mapping[str, str]) -> None:
        _atomic.fsync_dir(prefix)

    def write_bytes(self, path: str, data: bytes) -> None:
        _atomic.write_file_atomically(path, lambda f: f.write(data))


def destination_for(path: str, config=None):
    """The destination of ``path``: local, or object storage for an ``s3://`` / ``msc://`` URL."""
    if is_remote(path):
        from .storage.upload import ObjectDestination

        return ObjectDestination(config)
    return LocalDestination()


# --------------------------------------------------------------------------- one shard


def commit_shard(files: Mapping[str, str], prefix: str, destination=None, *, rollback: bool = True,
                 existing: Optional[Sequence[str]] = None) -> None:
    """Put ``files`` (``{suffix: source}``, with ``.idx``) at ``prefix``, ``.idx`` last (the module's rule).

    ``rollback``: the sources are temporaries; if a rename fails, the files already renamed are
    removed again. A local source is renamed (same filesystem); a remote one is uploaded.
    ``existing``: the suffixes present at ``prefix`` when the caller has just listed them.

    Raises:
        OSError, RemoteStorageError: a step failed (nothing that opens is left at ``prefix``
            unless the ``.idx`` was in place); SizeMismatchError: an upload came out short.
    """
    destination = destination or destination_for(prefix)
    data = [(files[s], prefix + s) for s in PUBLISH_ORDER if s in files and s != IDX_SUFFIX]
    destination.prepare(files[s] for s in PUBLISH_ORDER if s in files)
    with destination.turn(prefix):
        old = destination.existing(prefix) if existing is None else existing
        if IDX_SUFFIX in old:  # unpublish first: the old index never meets new data
            destination.remove([prefix + IDX_SUFFIX])
        destination.sync(prefix)
        destination.remove(prefix + s for s in old if s not in files and s != IDX_SUFFIX)
        try:
            destination.put_many(data)
            destination.put(files[IDX_SUFFIX], prefix + IDX_SUFFIX)
        except BaseException:
            if rollback:
                _atomic.remove_quietly(final for source, final in data if not os.path.lexists(source))
            raise
        destination.finish(prefix, files)


def commit_staged(staged: str, final: str) -> None:
    """Move the staged local shard ``staged`` (a complete shard, on the final's filesystem) to
    ``final``, ``.idx`` last; resumable after an interruption at any point: a staged file already
    moved (its final name present) is left, and a shard whose ``.idx`` was moved is complete.

    Raises:
        ShardError: a staged file is missing and was never published (the staging directory
            was tampered with). OSError: the filesystem refused a rename.
    """
    pending, vanished = {}, None
    for suffix in PUBLISH_ORDER:
        src, dst = staged + suffix, final + suffix
        if os.path.exists(src):
            pending[suffix] = src
        elif not os.path.exists(dst):
            vanished = vanished or src
    if vanished is not None:
        raise ShardError("a staged file vanished before it was published", path=vanished,
                         hint="rerun without --resume to rebuild the output")
    if IDX_SUFFIX in pending:  # not committed yet
        destination = LocalDestination()
        # Files already moved belong to the new shard: only the names still pending hold old ones.
        old = [s for s in destination.existing(final) if s in pending]
        commit_shard(pending, final, destination, rollback=False, existing=old)


def remove_shard(prefix: str, suffixes: Sequence[str] = PUBLISH_ORDER) -> None:
    """Remove the local shard files ``prefix + suffixes`` (a moved shard's source), ``.idx``
    first, so the prefix never opens with files missing; a symbolic link loses the link only."""
    _atomic.remove_quietly(prefix + s for s in _commit_point_first(suffixes))
    _atomic.fsync_dir(prefix)


def _commit_point_first(items: Iterable[str]) -> List[str]:
    return sorted(items, key=lambda p: not _is_commit_point(p))


def _is_commit_point(path: str) -> bool:
    return path.endswith(IDX_SUFFIX) and not path.endswith(SEQ_IDX_SUFFIX)


# --------------------------------------------------------------------------- existing outputs


def existing_shard(prefix: str, *, committed: bool = False, config=None) -> List[str]:
    """The files (or objects) of a shard at ``prefix`` that exist: any of the five, or with
    ``committed`` its ``.idx`` only (the companions of a build that never committed are
    leftovers, replaced without asking)."""
    destination = destination_for(prefix, config)
    if committed:
        return [prefix + IDX_SUFFIX] if destination.exists(prefix + IDX_SUFFIX) else []
    return [prefix + s for s in destination.existing(prefix)]


def refuse_existing(found: Sequence[str], *, replace_with: str = "--overwrite",
                    elsewhere: str = "another output") -> None:
    """Refuse to write over ``found`` (existing output files or objects), in one message for
    every door; nothing when ``found`` is empty.

    Raises:
        ShardExistsError: naming the first file, and how to replace it.
    """
    if found:
        raise ShardExistsError(f"output already exists ({len(found)} file(s), e.g. {found[0]})", path=found[0],
                               hint=f"pass {replace_with} to replace it, or choose {elsewhere}")


# --------------------------------------------------------------------------- the doors


def local_files(prefix: str) -> Dict[str, str]:
    """``{suffix: path}`` of a local shard's files, in publish order (``.idx`` last).

    Raises:
        ShardError: the shard does not open (so nothing broken is ever published).
    """
    from .reader import MMapIndexedDataset

    shard = MMapIndexedDataset(prefix)  # the reader's open-time checks: complete, consistent sizes
    suffixes = [IDX_SUFFIX, ".bin"] if shard.is_pretrain else list(ALL_SUFFIXES)
    return {s: prefix + s for s in PUBLISH_ORDER if s in suffixes}


def upload_shard(prefix, dest, *, replace: bool = False, config=None) -> Dict[str, str]:
    """Upload the local shard ``prefix`` to the shard URL ``dest`` (``s3://b/dir/name``), ``.idx`` last.

    Returns:
        ``{suffix: object URL}`` of every uploaded file.

    Raises:
        ShardExistsError: a shard exists at ``dest`` and ``replace`` is false.
        ShardError: the local shard does not open; RemoteStorageError: an upload failed
            (nothing that opens is left at ``dest``: ``.idx`` was not sent).
        SizeMismatchError: an object's listed size differs from its local file after upload.
    """
    from .storage.upload import ObjectDestination

    prefix = os.fspath(prefix)
    url = str(ObjectURL.parse(dest))
    files = local_files(prefix)
    destination = ObjectDestination(config)
    existing = destination.existing(url)
    if not replace:
        refuse_existing([url + s for s in existing], replace_with="replace=True (--replace)")
    commit_shard(files, url, destination, rollback=False, existing=existing)
    return {s: url + s for s in files}


def publish_shard(prefix, dest, *, replace: bool = False, link: bool = False, config=None) -> str:
    """Publish one finished local shard under the exact prefix ``dest`` (a path or a URL),
    ``.idx`` last, copying it (or hard-linking it, ``link``, locally). Returns ``dest``.

    Raises:
        ShardExistsError: a shard exists at ``dest`` and ``replace`` is false (nothing written);
        ShardError: the local shard does not open; RemoteStorageError / OSError while writing.
    """
    prefix, dest = os.fspath(prefix), os.fspath(dest)
    files = local_files(prefix)
    if not replace:
        refuse_existing(existing_shard(dest, config=config), replace_with="replace=True (--replace)")
    if is_remote(dest):
        upload_shard(prefix, dest, replace=True, config=config)
        return dest
    if os.path.abspath(dest) == os.path.abspath(prefix):
        raise ShardError("the shard is already at the destination", path=prefix)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    finals = {s: dest + s for s in files}
    _atomic.clear_stale_temporaries(finals.values())
    tmp: Dict[str, str] = {}
    try:
        for suffix, src in files.items():
            tmp[suffix] = _atomic.temporary_path(finals[suffix])
            if link:
                os.link(src, tmp[suffix])
            else:
                shutil.copyfile(src, tmp[suffix])
        commit_shard(tmp, dest, LocalDestination())
    except BaseException:
        _atomic.remove_quietly(tmp.values())
        raise
    return dest


def publish(source: Union[str, Sequence[str]], dest, *, replace: bool = False, link: bool = False,
            manifest: Optional[str] = None, config=None) -> List[str]:
    """Publish finished local shards into directory ``dest`` (a local path or a URL).

    Args:
        source: a local shard prefix, a list of them, or a directory of shards.
        dest: destination directory; shard ``.../name`` goes to ``dest/name``.
        replace: replace shards of the same name at ``dest``.
        link: local destinations only: hard-link instead of copying.
        manifest: also write a manifest of the published set with this file name into
            ``dest``, last (the set's commit point).

    Returns:
        the published prefixes (paths or URLs), in source order.

    Raises:
        ShardError (ShardExistsError, ...) before anything is written when a shard does not
        open or exists without ``replace``; RemoteStorageError / OSError while writing.
    """
    from .multi import expand_shards

    prefixes = expand_shards(source)
    names = [os.path.basename(p) for p in prefixes]
    if len(set(names)) != len(names):
        raise ShardError("two shards of the set share a name", field="source", actual=names)
    dest = os.fspath(dest)
    remote = is_remote(dest)
    targets = [str(ObjectURL.parse(dest).join(n)) if remote else os.path.join(dest, n) for n in names]
    for prefix in prefixes:  # every shard opens, before anything is written
        local_files(prefix)
    if not replace:
        for target in targets:
            refuse_existing(existing_shard(target, config=config), replace_with="replace=True (--replace)")
    for prefix, target in zip(prefixes, targets):
        publish_shard(prefix, target, replace=True, link=link, config=config)  # existence checked above
    if manifest:
        path = str(ObjectURL.parse(dest).join(manifest)) if remote else os.path.join(dest, manifest)
        write_bytes(path, manifest_bytes(path, list(zip(targets, prefixes))), config)
    return targets


def manifest_bytes(path: str, shards: Sequence[Tuple[str, str]], order: Optional["OrderRecord"] = None) -> bytes:
    """The manifest ``path`` (local or a URL) of published shards ``(final, local copy)``: entries
    from the local copies' headers, prefixes as the finals relative to the manifest; ``order``
    (a :class:`megatron_sft_idx.manifest.OrderRecord`) recorded.

    Raises:
        ShardError: a local copy does not open; IncompatibleShardsError, ShardSetError: the
            shards cannot be read as one set.
    """
    from .manifest import encode_manifest, manifest_document
    from .reader import MMapIndexedDataset

    members = [(final, MMapIndexedDataset(local)) for final, local in shards]
    return encode_manifest(manifest_document(path, members, relative=True, order=order))


def write_manifest(path, shards, *, relative: bool = True) -> dict:
    """Write a manifest at ``path`` (a local file, or an ``s3://`` / ``msc://`` object) listing
    ``shards`` (anything :func:`megatron_sft_idx.multi.select_shards` takes, local or URLs):
    the document of :func:`megatron_sft_idx.multi.manifest_for` (shards that do not agree or do
    not form whole sets are refused: a manifest a reader would refuse is never written), written
    whole by :func:`write_bytes` (one PUT for an object). Returns the manifest object.

    Raises:
        ShardError (any subclass): see :func:`megatron_sft_idx.multi.manifest_for`.
    """
    from .manifest import encode_manifest
    from .multi import manifest_for

    path = os.fspath(path)
    document = manifest_for(path, shards, relative=relative)
    write_bytes(path, encode_manifest(document))
    return document


def write_bytes(path: str, data: bytes, config=None) -> None:
    """Create or replace one small file or object whole (a manifest): readers see the old or the new."""
    destination_for(path, config).write_bytes(path, data)


def upload_file(local: str, dest: str, config=None) -> None:
    """Upload one finished local file (e.g. a Parquet file) to the URL ``dest``: one PUT, its own commit."""
    destination_for(dest, config).put(local, dest)


# --------------------------------------------------------------------------- a staged set


@dataclass(frozen=True)
class StagedShard:
    staged: str     # prefix in the staging directory (a complete shard)
    final: str      # prefix it is published to


@dataclass(frozen=True)
class StagedOrder:
    """A balanced pack order to publish beside its data (``--balance-for``)."""

    final: str                 # where it goes (``P.order`` / ``BASE.order``)
    data: bytes                # the order file's bytes
    manifest: Optional[str]    # the manifest that records it (None: beside a single shard)
    record: "OrderRecord"      # what that manifest records of it
    order: object = None       # the :class:`~megatron_sft_idx.batching.Order` itself (for the run's log)


@dataclass(frozen=True)
class StagedSet:
    """What one run publishes: its shards, when it writes several one manifest per split, and
    its balanced orders."""

    shards: Tuple[StagedShard, ...]
    manifests: Tuple[Tuple[str, Tuple[str, ...]], ...]   # (manifest path, final prefixes it lists)
    orders: Tuple[StagedOrder, ...] = ()


def publish_set(staged: StagedSet, replaced: Sequence[str], *, done: Iterable[int] = (),
                on_commit: Optional[Callable[[int, List[str]], None]] = None,
                on_shard: Optional[Callable[[], None]] = None,
                on_error: Optional[Callable[[ShardError, str, str], BaseException]] = None) -> None:
    """Publish a staged set (the module's rule for a set), local or to object storage.

    ``replaced``: existing outputs of an earlier generation (``--overwrite``), removed after the
    manifests and before any shard is touched, every ``.idx`` first. ``done``: shards already
    published by an interrupted attempt (their files are kept, not committed again).
    ``on_commit(i, local_files)`` records shard ``i`` (a receipt: its local files after the
    commit -- moved to the final names locally, the staged copies after an upload);
    ``on_shard()`` is called after each shard (progress); ``on_error(exc, path, doing)`` turns
    a storage failure into the caller's error.

    Raises:
        ShardError: a staged file is missing, or a staged shard does not open (remote).
        OSError: the filesystem refused a rename or write; RemoteStorageError (or what
        ``on_error`` returns) when a request failed for good.
    """
    remote = any(is_remote(s.final) for s in staged.shards)
    destination = destination_for(staged.shards[0].final if staged.shards else "")
    done = set(done)

    def step(path: str, doing: str, op: Callable[[], None]) -> None:
        try:
            op()
        except (RemoteStorageError, ShardNotFoundError) as exc:
            if on_error is None:
                raise
            raise on_error(exc, path, doing) from None

    keep = {staged.shards[i].final + s for i in done for s in PUBLISH_ORDER}
    for path, _ in staged.manifests:
        step(path, "delete the old output", lambda: destination.remove([path]))
        if not remote:
            _atomic.clear_stale_temporaries([path])  # (a manifest write an earlier attempt was killed in)
    for path in _commit_point_first(p for p in replaced if p not in keep):
        step(path, "delete the old output", lambda: destination.remove([path]))
    for i, shard in enumerate(staged.shards):
        if i not in done:
            if remote:
                step(shard.final, "upload the shard", lambda: upload_shard(shard.staged, shard.final, replace=True))
                after = [shard.staged + s for s in PUBLISH_ORDER if os.path.exists(shard.staged + s)]
            else:
                commit_staged(shard.staged, shard.final)
                after = [shard.final + s for s in PUBLISH_ORDER]
            if on_commit is not None:
                on_commit(i, after)
        if on_shard is not None:
            on_shard()
    records = {}
    for order in staged.orders:
        step(order.final, "write the pack order", lambda: _put_bytes(destination, order.final, order.data, remote,
                                                                  staged.shards[0].staged))
        if order.manifest is not None:
            records[order.manifest] = order.record
    local_copy = {s.final: s.staged if remote else s.final for s in staged.shards}
    for path, finals in staged.manifests:
        data = manifest_bytes(path, [(f, local_copy[f]) for f in finals], records.get(path))
        if not remote:
            destination.write_bytes(path, data)
            continue
        # Uploaded from a copy beside the staged shards, which the run keeps (it records the
        # manifest's size and checksum from it).
        kept = os.path.join(os.path.dirname(local_copy[finals[0]]), ObjectURL.parse(path).name)
        LocalDestination().write_bytes(kept, data)
        step(path, "upload the manifest", lambda: destination.put(kept, path))


def _base_name(path: str) -> str:
    return ObjectURL.parse(path).name if is_remote(path) else os.path.basename(path)


def _put_bytes(destination, path: str, data: bytes, remote: bool, staged_prefix: str) -> None:
    """One small derived file whole: atomically locally; uploaded from a copy beside the staged
    shards for object storage (one PUT: readers see the old object or the new one)."""
    if not remote:
        destination.write_bytes(path, data)
        return
    kept = os.path.join(os.path.dirname(staged_prefix), _base_name(path))
    LocalDestination().write_bytes(kept, data)
    destination.put(kept, path)
