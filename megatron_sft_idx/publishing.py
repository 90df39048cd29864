"""Publishing: the one commit rule for a shard and for a set, on local disk or in object storage.

Every writer publishes through here: the builder, preprocess and repack, the promotion gate,
the shard tools (merge, convert) and uploads (:func:`upload_shard` / :func:`publish`, here).

**A shard** (:func:`commit_shard`) -- its files complete and durable first, ``.idx`` last:

1. the new files are made durable (local: every source fsynced; they are temporaries beside
   the final names, or a staged shard on the same filesystem);
2. (local: under a lock on the directory, so publications into it take turns) the old ``.idx``
   is removed first, so no reader can pair an old index with new data (local: that removal is
   made durable before anything else changes; a prefix with no old file skips the sync), then
   the old files the new shard lacks;
3. the data files are put in place (local: renamed in publish order; object storage:
   uploaded in parallel), then the ``.idx``: the commit point every reader needs (upstream's
   too), always a file created for this publication (local readers tell generations apart by
   its inode, ``_files.py``);
4. local: the directory is fsynced; object storage: the objects' sizes are checked against
   the local files.

A failure before the ``.idx`` is in place leaves nothing that opens; from temporaries, the
files already renamed are removed again (the prefix holds no dataset rather than a mixture);
a staged shard is left where it stopped, and a rerun finishes it (:func:`commit_staged`).

**A set** (:func:`commit_set`, the one sequence; used by :func:`publish_set` for preprocess and
repack, by promotion, and by :func:`publish`): its manifests are withdrawn before the first
shard is touched, the old outputs it replaces are removed (every ``.idx`` before any other
file), each shard is committed, then its balanced pack orders (``--balance-for``: derived
files beside the data, each written whole, atomically), and the manifests are written last --
the set's commit point, recording its order -- so a reader of the set sees the whole previous
set, no set, or the whole new set. Then the destination is **read back** (``Destination.read_back``):
every shard placed (sizes, the ``.idx`` header, the ``.seq.idx`` header and metadata), every
order and manifest written (whole), nothing replaced left over; a publication that returns
whole has seen its destination whole.

**An existing output** is refused by :func:`refuse_existing`, one message for every door.

**A moved shard's source** goes ``.idx`` first (:func:`remove_shard`), so it never opens
with files missing.

Destinations (:mod:`megatron_sft_idx.storage.destination`): a local directory or object storage
behind one interface (the primitives, with their deadlines and checks); this module orders
them and never asks which kind it holds, nor imports a storage client.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _atomic
from ._crc import crc32
from .errors import (IncompleteDestinationError, RemoteStorageError, ShardError, ShardExistsError,
                     ShardNotFoundError)
from .format import (ALL_SUFFIXES, IDX_HEADER_SIZE, IDX_SUFFIX, PUBLISH_ORDER, SEQ_IDX_HEADER_SIZE,
                     SEQ_IDX_SUFFIX, SeqIdxHeader)
from .manifest import encode_manifest, manifest_document
from .multi import expand_shards, manifest_for
from .reader import MMapIndexedDataset
from .storage.destination import Destination, Expect, LocalDestination, destination_for
from .storage.urls import ObjectURL

if TYPE_CHECKING:
    from .manifest import OrderRecord

__all__ = ["commit_shard", "commit_staged", "remove_shard",
           "existing_shard", "refuse_existing", "upload_shard", "publish_shard", "publish", "local_files",
           "StagedShard", "StagedSet", "StagedOrder", "publish_set", "manifest_bytes", "write_bytes",
           "write_manifest", "upload_file", "SetFile", "SetOutcome", "commit_set", "expect_shard",
           "expect_bytes"]


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
        if old:   # the removal durable before new data takes the names (a new prefix has none to order)
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


def commit_staged(staged: str, final: str, destination: Optional[Destination] = None) -> None:
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
        destination = destination or LocalDestination()
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
    shard = MMapIndexedDataset(prefix)  # the reader's open-time checks: complete, consistent sizes
    suffixes = [IDX_SUFFIX, ".bin"] if shard.is_pretrain else list(ALL_SUFFIXES)
    return {s: prefix + s for s in PUBLISH_ORDER if s in suffixes}


def _source_files(prefix: str, config=None) -> Dict[str, str]:
    """``{suffix: path}`` of the shard to publish: a local one's (:func:`local_files`), or, for a
    shard staged in object storage (copied server-side, never read here), its objects as
    listed, every file of an SFT shard required.

    Raises:
        ShardError: the local shard does not open, or a staged object is missing (naming it)."""
    source = destination_for(prefix, config)
    if source.moves:
        return local_files(prefix)
    listed = _shard_sizes(source, prefix)
    for suffix in PUBLISH_ORDER:
        if prefix + suffix not in listed:
            raise ShardError("a staged object is missing", path=prefix + suffix,
                             hint="rerun with --resume (the shard is written again)")
    return {s: prefix + s for s in PUBLISH_ORDER}


def upload_shard(prefix, dest, *, replace: bool = False, config=None) -> Dict[str, str]:
    """Upload the local shard ``prefix`` to the shard URL ``dest`` (``s3://b/dir/name``), ``.idx`` last.

    Returns:
        ``{suffix: object URL}`` of every uploaded file.

    Raises:
        ShardExistsError: a shard exists at ``dest`` and ``replace`` is false.
        ShardError: ``dest`` is not a URL, the local shard does not open; RemoteStorageError: an
            upload failed (nothing that opens is left at ``dest``: ``.idx`` was not sent).
        SizeMismatchError: an object's listed size differs from its local file after upload.
    """
    url = str(ObjectURL.parse(dest))   # (an upload: a URL, never a local path)
    publish_shard(prefix, url, replace=replace, config=config)
    return {s: url + s for s in local_files(os.fspath(prefix))}


def publish_shard(prefix, dest, *, replace: bool = False, link: bool = False, config=None,
                  destination: Optional[Destination] = None) -> str:
    """Publish one finished local shard under the exact prefix ``dest`` (a path or a URL),
    ``.idx`` last, copying it (or hard-linking it, ``link``, where the destination moves files
    into place: locally). The source is left as it was. Returns ``dest``.

    Raises:
        ShardExistsError: a shard exists at ``dest`` and ``replace`` is false (nothing written);
        ShardError: the local shard does not open, it is already at ``dest``, or ``link`` into a
            destination that copies; RemoteStorageError / OSError while writing.
    """
    prefix, dest = os.fspath(prefix), os.fspath(dest)
    destination = destination or destination_for(dest, config)
    files = _source_files(prefix, config)
    existing = destination.existing(dest)
    if not replace:
        refuse_existing([dest + s for s in existing], replace_with="replace=True (--replace)")
    if destination.normal(dest) == os.path.abspath(prefix):
        raise ShardError("the shard is already at the destination", path=prefix)
    if link and not destination.moves:
        raise ShardError("hard links need a local destination", path=dest, hint="publish without link")
    destination.make_directory(destination.parent(dest))
    sources: Dict[str, str] = {}
    try:
        for suffix, src in files.items():
            tmp = destination.temporary(dest + suffix)
            if tmp is None:   # the destination reads the source as it is (an upload)
                sources[suffix] = src
                continue
            sources[suffix] = tmp
            if link:
                os.link(src, tmp)
            else:
                shutil.copyfile(src, tmp)
        commit_shard(sources, dest, destination, existing=existing)
    except BaseException:
        _atomic.remove_quietly(t for s, t in sources.items() if t != files[s])
        raise
    return dest


def publish(source: Union[str, Sequence[str]], dest, *, replace: bool = False, link: bool = False,
            manifest: Optional[str] = None, config=None) -> List[str]:
    """Publish finished local shards into directory ``dest`` (a local path or a URL), by the
    set's rule (:func:`commit_set`; the sources are left as they were).

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
        open or exists without ``replace``; RemoteStorageError / OSError while writing;
        IncompleteDestinationError: the destination, read back, is not what was published.
    """
    prefixes = expand_shards(source)
    names = [os.path.basename(p) for p in prefixes]
    if len(set(names)) != len(names):
        raise ShardError("two shards of the set share a name", field="source", actual=names)
    dest = os.fspath(dest)
    destination = destination_for(dest, config)
    targets = [destination.join(dest, n) for n in names]
    for prefix in prefixes:  # every shard opens, before anything is written
        local_files(prefix)
    if not replace:
        for target in targets:
            refuse_existing([target + s for s in destination.existing(target)],
                            replace_with="replace=True (--replace)")
    files = ()
    if manifest:
        path = destination.join(dest, manifest)
        files = (SetFile(path, lambda: manifest_bytes(path, list(zip(targets, prefixes))), "manifest",
                         needs=tuple(range(len(prefixes))), commit_point=True),)

    def place(i: int) -> bool:
        publish_shard(prefixes[i], targets[i], replace=True, link=link, destination=destination)
        return True

    outcome = commit_set(destination, list(zip(prefixes, targets)), place=place, files=files)
    outcome.raise_if_incomplete()
    return targets


def manifest_bytes(path: str, shards: Sequence[Tuple[str, str]], order: Optional["OrderRecord"] = None) -> bytes:
    """The manifest ``path`` (local or a URL) of published shards ``(final, local copy)``: entries
    from the local copies' headers, prefixes as the finals relative to the manifest; ``order``
    (a :class:`megatron_sft_idx.manifest.OrderRecord`) recorded.

    Raises:
        ShardError: a local copy does not open; IncompatibleShardsError, ShardSetError: the
            shards cannot be read as one set.
    """
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


# --------------------------------------------------------------------------- a set


@dataclass(frozen=True)
class SetFile:
    """A file that travels with a set: a balanced order, or a manifest (``commit_point``: the
    set's commit point, withdrawn before the first shard is touched and written last)."""

    final: str
    data: Callable[[], bytes]     # its bytes (called once, after the shards it needs are in place)
    what: str                     # "pack order", "manifest": how messages name it
    needs: Tuple[int, ...] = ()   # the shards (indices) that must be in place before it is written
    after: Tuple[str, ...] = ()   # files of the set (finals) that must be written before it
    commit_point: bool = False


@dataclass
class SetOutcome:
    """What :func:`commit_set` did: the shards placed, the files written (their bytes), the
    files not written (``left``: final -> why), and what the read-back found wrong
    (``problems``: ``(path, what is there now)``)."""

    placed: List[int] = field(default_factory=list)
    written: Dict[str, bytes] = field(default_factory=dict)
    left: Dict[str, str] = field(default_factory=dict)
    problems: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return not self.problems

    def raise_if_incomplete(self, hint: str = "publish again with replace=True") -> None:
        """Raises:
            IncompleteDestinationError: the read-back found a file missing or different (the
                first named, the others counted)."""
        if self.problems:
            path, why = self.problems[0]
            more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            raise IncompleteDestinationError(f"the destination is not whole after publishing: {why}{more}",
                                             path=path, hint=hint)


def commit_set(destination: Destination, shards: Sequence[Tuple[str, str]], *,
               place: Optional[Callable[[int], bool]] = None, files: Sequence[SetFile] = (),
               replaced: Sequence[str] = (), done: Iterable[int] = (),
               on_commit: Optional[Callable[[int], None]] = None, on_shard: Optional[Callable[[], None]] = None,
               step: Optional[Callable[[str, str, Callable[[], None]], None]] = None,
               lenient: bool = False) -> SetOutcome:
    """Commit a set at ``destination`` -- the one sequence every set publication follows
    (preprocess and repack, promotion, :func:`publish`):

    1. its commit points (the manifests of ``files``) are withdrawn;
    2. ``replaced`` (what of an earlier generation the new one does not bring) is removed,
       every ``.idx`` first;
    3. each shard ``(local prefix, final prefix)`` is placed, by ``place(i)`` (True when it
       arrived; default: :func:`commit_staged` where the destination moves files, else an
       upload), except those in ``done`` (an interrupted attempt placed them);
    4. the other ``files`` (balanced orders), then the manifests, each only once the shards it
       ``needs`` are in place and the files it comes ``after`` were written;
    5. the destination is read back (``Destination.read_back``): every shard placed now (sizes, the
       ``.idx`` header, the ``.seq.idx`` whole, which holds every checksum), every file written,
       and that nothing of ``replaced`` is left.

    ``step(path, doing, op)`` runs each destination operation (default: as is) -- the caller's
    error naming. ``lenient``: a file that cannot be written is recorded in ``left`` and the
    publication goes on (promotion reports per shard); otherwise its error propagates.

    Raises:
        what ``place`` or ``step`` raise; ShardError: a staged file is missing.
    """
    step = step or (lambda path, doing, op: op())
    done, out = set(done), SetOutcome()
    points = [f for f in files if f.commit_point]
    for f in points:
        step(f.final, "delete the old output", lambda: destination.remove([f.final]))
    keep = {shards[i][1] + s for i in done for s in PUBLISH_ORDER}
    gone = [p for p in replaced if p not in keep]
    for path in _commit_point_first(gone):
        step(path, "delete the old output", lambda: destination.remove([path]))
    expected: List[Expect] = []
    place = place or (lambda i: _place_staged(destination, shards[i][0], shards[i][1], step))
    for i, (local, final) in enumerate(shards):
        if i not in done:
            before = expect_shard(local, final)
            if place(i):
                out.placed.append(i)
                expected += before
                if on_commit is not None:
                    on_commit(i)
        if on_shard is not None:
            on_shard()
    arrived = set(out.placed) | done
    for f in [f for f in files if not f.commit_point] + points:
        missing = [shards[n][1] for n in f.needs if n not in arrived]
        blocked = [a for a in f.after if a in out.left]
        if missing or blocked:
            out.left[f.final] = (f"not written: {_names(missing)} did not arrive" if missing
                                 else f"not written: {_names(blocked)} was not written")
            continue
        try:
            data = f.data()
            step(f.final, f"write the {f.what}", lambda: destination.write_bytes(f.final, data))
        except (ShardError, RemoteStorageError, OSError) as exc:
            if not lenient:
                raise
            out.left[f.final] = f"writing the {f.what} failed: {exc}"
            continue
        out.written[f.final] = data
        expected.append(expect_bytes(f.final, data))
    written = set(out.written) | {e.path for e in expected}
    expected += [Expect(p, None) for p in gone if p not in written]
    out.problems = list(out.left.items()) + destination.read_back(expected)
    return out


def _place_staged(destination: Destination, staged: str, final: str, step) -> bool:
    """A staged local shard to ``final``: moved (resumable, :func:`commit_staged`) where the
    destination moves files, else uploaded from the staged copy (which stays)."""
    if destination.moves:
        commit_staged(staged, final, destination)
    else:
        step(final, "upload the shard",
             lambda: publish_shard(staged, final, replace=True, destination=destination))
    return True


def _names(paths: Sequence[str], limit: int = 3) -> str:
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in paths]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


# --------------------------------------------------------------------------- reading back


def _shard_sizes(source: Destination, prefix: str) -> Dict[str, int]:
    """``{path: size}`` of the files of the shard ``prefix`` that exist: each file's where files are
    moved (local), one listing of the prefix where they are objects."""
    paths = [prefix + s for s in PUBLISH_ORDER]
    if source.moves:
        return source.sizes(paths)
    listed = source.listing(prefix)
    return {p: listed[p] for p in paths if p in listed}


def expect_shard(local: str, final: str) -> List[Expect]:
    """What the shard at ``final`` must be once the local shard ``local`` is published there:
    every file's size, the ``.idx`` header, and the ``.seq.idx`` header with the metadata
    (which records the size and CRC-32 of every other file, and the header the CRC-32 of its
    body). Read before publishing (a move takes the files).

    ``local`` may be a shard staged in object storage: its sizes are listed and its headers read
    by ranged reads (bounded: the headers alone).

    Raises:
        ShardError: the ``.seq.idx`` header does not parse (the shard was gated: a bug)."""
    source = destination_for(local)
    sizes = _shard_sizes(source, local)
    out = []
    for suffix in PUBLISH_ORDER:
        path = local + suffix
        size = sizes.get(path)
        if size is None:
            continue
        if suffix == SEQ_IDX_SUFFIX:
            raw = source.read_head(path, SEQ_IDX_HEADER_SIZE) or b""
            header = SeqIdxHeader.parse(raw, path, size)
            head = source.read_head(path, SEQ_IDX_HEADER_SIZE + header.metadata_length) or b""
        else:
            head = (source.read_head(path, IDX_HEADER_SIZE) or b"") if suffix == IDX_SUFFIX else b""
        out.append(Expect(final + suffix, size, None, head))
    return out


def expect_bytes(path: str, data: bytes) -> Expect:
    """A small file written whole (an order, a manifest): its size and CRC-32."""
    return Expect(path, len(data), crc32(data))


# --------------------------------------------------------------------------- a staged run's set


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
                destination: Optional[Destination] = None,
                on_commit: Optional[Callable[[int, List[str]], None]] = None,
                on_shard: Optional[Callable[[], None]] = None,
                on_error: Optional[Callable[[ShardError, str, str], BaseException]] = None) -> SetOutcome:
    """Publish a run's staged set by :func:`commit_set`, local or to object storage.

    ``replaced``: existing outputs of an earlier generation (``--overwrite``), removed after the
    manifests are withdrawn and before any shard is touched, every ``.idx`` first. ``done``:
    shards already published by an interrupted attempt (their files are kept, not committed
    again). ``on_commit(i, local_files)`` records shard ``i`` (a receipt: its local files after
    the commit -- moved to the final names where the destination moves them, else the staged
    copies); ``on_shard()`` is called after each shard (progress); ``on_error(exc, path, doing)``
    turns a storage failure into the caller's error. Returns the outcome, read back.

    Raises:
        ShardError: a staged file is missing, or a staged shard does not open (remote).
        OSError: the filesystem refused a rename or write; RemoteStorageError (or what
        ``on_error`` returns) when a request failed for good.
    """
    if not staged.shards:
        return SetOutcome()
    destination = destination or destination_for(staged.shards[0].final)
    if destination.moves:
        for path, _ in staged.manifests:
            _atomic.clear_stale_temporaries([path])  # (a manifest write an earlier attempt was killed in)

    def step(path: str, doing: str, op: Callable[[], None]) -> None:
        try:
            op()
        except (RemoteStorageError, ShardNotFoundError) as exc:
            if on_error is None:
                raise
            raise on_error(exc, path, doing) from None

    def committed(i: int) -> None:
        if on_commit is not None:
            where = staged.shards[i].final if destination.moves else staged.shards[i].staged
            on_commit(i, [where + s for s in PUBLISH_ORDER if os.path.exists(where + s)])

    index = {s.final: i for i, s in enumerate(staged.shards)}
    local_copy = {s.final: s.staged for s in staged.shards}
    records, orders = {}, {}
    files = []
    for order in staged.orders:
        needs = tuple(index[f] for path, finals in staged.manifests if path == order.manifest for f in finals)
        files.append(SetFile(order.final, lambda order=order: order.data, "pack order", needs or tuple(index.values())))
        if order.manifest is not None:
            records[order.manifest], orders[order.manifest] = order.record, order.final
    for path, finals in staged.manifests:
        def data(path=path, finals=finals) -> bytes:
            # from the staged copies' headers (a moved shard: its final prefix holds the same files)
            return manifest_bytes(path, [(f, local_copy[f] if os.path.exists(local_copy[f] + IDX_SUFFIX) else f)
                                         for f in finals], records.get(path))
        files.append(SetFile(path, data, "manifest", tuple(index[f] for f in finals),
                             after=(orders[path],) if path in orders else (), commit_point=True))
    return commit_set(destination, [(s.staged, s.final) for s in staged.shards], files=files, replaced=replaced,
                      done=done, on_commit=committed, on_shard=on_shard, step=step)
