"""The per-node cache of a remote shard's small index files.

``.idx``, ``.seq.idx`` and (when small) ``.seq.bin`` are downloaded once per node and
mapped from local disk, as megatron-core caches ``.idx`` files (``ObjectStorageConfig.
path_to_idx_cache``) — but without a barrier: the processes of a node (ranks, DataLoader
workers) take an ``flock`` on one lock file per shard; the first downloads, the others
wait on the lock and then find the files in place (``<digest>.lock`` beside the entries).

Layout: ``<root>/<scheme>/<digest>@<generation>/`` (the digest of the shard's URL: no local name
is taken from a key) holds ``shard.idx``,
``shard.seq.idx``, ``shard.seq.bin`` and ``receipt.json``. The *generation* is a digest
of the five objects' sizes and ETags as listed at open, so a re-uploaded shard gets a
new directory: files of two generations never share a directory, and nothing a
running process has mapped is ever overwritten. Files are written under temporary
names, verified, fsynced and renamed; ``receipt.json`` is written last and is the
commit point of the entry. Older generations of the same shard are removed once a newer
one is committed.

What is verified, and when:

* at download: ``.seq.idx`` by its header and body CRC-32s, the other files by the size
  and CRC-32 the metadata records (a pretrain ``.idx``, which no metadata covers, by its
  size); a mismatch is downloaded once more, then refused (:class:`ChecksumError`);
* at every reuse by a process: the receipt is parsed strictly (:func:`parse_receipt`) and
  must name this URL, this generation and the objects as listed now; then each file is
  verified as at download (the CRC-32 the receipt records for files no metadata covers),
  from the descriptor the reader will map, so the bytes verified are the bytes read. A
  process verifies a file once while its identity (device, inode, size, mtime, ctime) is
  unchanged; an edit changes the ctime, so an entry edited after its download is always
  caught. An entry that fails is downloaded again (a warning names the file and why).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
from typing import Dict, Iterable, Optional, Tuple

from .. import _atomic
from .._crc import crc32, crc32_combine
from ..errors import ChecksumError, MetadataError, MetadataLimitError, ShardError, SizeMismatchError
from ..format import (ALL_SUFFIXES, IDX_SUFFIX, METADATA_OFFSET, SEQ_IDX_HEADER_SIZE, SEQ_IDX_SUFFIX,
                      SeqIdxHeader)
from ..jsondoc import load_json
from ..metadata import ShardMetadata
from ._stores import ObjectInfo, ObjectStore
from .urls import ObjectURL

RECEIPT = "receipt.json"
RECEIPT_FORMAT = "megatron_sft_idx.index_cache"
RECEIPT_VERSION = 2
#: A receipt is a few hundred bytes; anything much larger is not one.
RECEIPT_MAX_BYTES = 64 << 10
LOCAL_NAME = "shard"
_GENERATION = re.compile(r"[0-9a-f]{16}")
_CHUNK = 16 << 20
logger = logging.getLogger("megatron_sft_idx.storage")

#: (dev, ino, size, mtime_ns, ctime_ns, CRC-32) of files this process verified -> the shard
#: metadata for a ``.seq.idx`` (None for the others).
_VERIFIED: Dict[tuple, Optional[ShardMetadata]] = {}
_VERIFIED_LOCK = threading.Lock()


def generation(infos: Dict[str, ObjectInfo]) -> str:
    """Digest of every object's size and ETag: a new upload is a new generation."""
    text = json.dumps({s: [i.size, i.etag] for s, i in sorted(infos.items())}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_dir(root: str, url: ObjectURL, gen: str) -> str:
    """``<root>/<scheme>/<digest of the URL>@<gen>``: named by digest alone, never by a key (a key
    may hold ``..`` or any character a local path cannot; the receipt names the URL)."""
    return os.path.join(root, url.scheme, hashlib.sha256(str(url).encode("utf-8")).hexdigest()[:32] + f"@{gen}")


def open_cached(store: ObjectStore, url: ObjectURL, infos: Dict[str, ObjectInfo], suffixes: Iterable[str],
                root: str) -> Tuple[str, Dict[str, int]]:
    """``(prefix, {suffix: fd})``: read-only descriptors of verified copies of ``url``'s
    ``suffixes`` objects, and the local prefix they are at. The caller owns the descriptors.

    Reuses this generation's entry when its receipt and files verify (see the module doc),
    else downloads it (one process per node; the others wait on the lock).

    Raises:
        ChecksumError, SizeMismatchError: a downloaded file does not match what the shard's
            metadata (or, for ``.seq.idx``, its own header) records, twice in a row.
        RemoteStorageError, ShardNotFoundError: the download failed.
        ShardError: the cache directory is not writable.
    """
    suffixes = tuple(suffixes)
    gen = generation(infos)
    directory = entry_dir(root, url, gen)
    prefix = os.path.join(directory, LOCAL_NAME)
    fds = _reuse(directory, prefix, url, gen, infos, suffixes)
    if fds is not None:
        return prefix, fds
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ShardError(f"cannot create the index cache directory: {exc.strerror or exc}", path=directory,
                         hint="set MEGATRON_SFT_IDX_CACHE (or cache_dir=) to a writable local directory") from None
    with _locked(directory.rsplit("@", 1)[0] + ".lock"):  # one lock per shard, whatever the generation
        fds = _reuse(directory, prefix, url, gen, infos, suffixes)  # another process may have just done it
        if fds is None:
            _atomic.remove_quietly([os.path.join(directory, RECEIPT)])  # uncommitted until downloaded again
            crcs, metadata = _download(store, url, infos, suffixes, prefix)
            _write_receipt(directory, url, gen, infos, crcs)
            _remove_older_generations(directory)
            fds = _open_all(prefix, suffixes)
            for suffix, fd in fds.items():  # verified as temporaries; renaming kept the inodes
                _remember(fd, crcs[suffix], metadata if suffix == SEQ_IDX_SUFFIX else None)
    return prefix, fds


# --------------------------------------------------------------------------- reuse


def _reuse(directory: str, prefix: str, url: ObjectURL, gen: str, infos: Dict[str, ObjectInfo],
           suffixes) -> Optional[Dict[str, int]]:
    """Descriptors of a committed, verified entry; None when there is none (or it failed)."""
    path = os.path.join(directory, RECEIPT)
    if not os.path.exists(path):
        return None
    fds: Dict[str, int] = {}
    try:
        receipt = parse_receipt(path)
        _match_receipt(receipt, path, url, gen, infos, suffixes)
        fds = _open_all(prefix, suffixes)
        _verify_entry(fds, prefix, receipt)
        return fds
    except (ShardError, OSError) as exc:
        for fd in fds.values():
            os.close(fd)
        logger.warning("index cache entry %s is not usable, downloading it again: %s", directory, exc)
        return None


def _open_all(prefix: str, suffixes) -> Dict[str, int]:
    fds: Dict[str, int] = {}
    try:
        for suffix in suffixes:
            fds[suffix] = os.open(prefix + suffix, os.O_RDONLY)
    except OSError:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def _verify_entry(fds: Dict[str, int], prefix: str, receipt: dict) -> None:
    """Every cached file against what it must be, as at download (``.seq.idx`` first: its
    metadata verifies the rest), and against the CRC-32 its receipt records; files this
    process verified with the same identity are skipped.

    Raises:
        ChecksumError, SizeMismatchError, HeaderError: a file is not what it must be.
        MetadataError: the receipt records another CRC-32 than the file verified has.
    """
    metadata = None
    for suffix in sorted(fds, key=lambda s: s != SEQ_IDX_SUFFIX):
        expected = receipt["files"][suffix]
        fd, name = fds[suffix], prefix + suffix
        key = _identity(fd, expected["crc32"])
        with _VERIFIED_LOCK:
            known, remembered = key in _VERIFIED, _VERIFIED.get(key)
        if known:
            metadata = remembered if suffix == SEQ_IDX_SUFFIX else metadata
            continue
        found, crc = _verify_fd(fd, suffix, name, expected["size"], metadata)
        if crc != expected["crc32"]:
            raise MetadataError(f"index cache receipt records CRC-32 {expected['crc32']:#010x}, the file has "
                                f"{crc:#010x}", path=name, field=f"files.{suffix}.crc32",
                                hint="the cache entry is downloaded again")
        metadata = found if suffix == SEQ_IDX_SUFFIX else metadata
        with _VERIFIED_LOCK:
            _VERIFIED[key] = found if suffix == SEQ_IDX_SUFFIX else None


def _identity(fd: int, crc: int) -> tuple:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, crc)


def _remember(fd: int, crc: int, metadata: Optional[ShardMetadata]) -> None:
    with _VERIFIED_LOCK:
        _VERIFIED[_identity(fd, crc)] = metadata


# --------------------------------------------------------------------------- download and verify


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive ``flock`` on ``path`` (released by the kernel if the holder dies)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ShardError(f"cannot create the index cache lock: {exc.strerror or exc}", path=path,
                         hint="set MEGATRON_SFT_IDX_CACHE (or cache_dir=) to a writable local directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _download(store: ObjectStore, url: ObjectURL, infos: Dict[str, ObjectInfo], suffixes,
              prefix: str) -> Tuple[Dict[str, int], Optional[ShardMetadata]]:
    """Every file to a temporary, verified (one retry of a mismatching download), then renamed.
    Returns each file's CRC-32 (for the receipt) and the shard metadata (None: pretrain)."""
    order = sorted(suffixes, key=lambda s: s != SEQ_IDX_SUFFIX)  # .seq.idx first: its metadata verifies the rest
    tmp: Dict[str, str] = {}
    crcs: Dict[str, int] = {}
    metadata: Optional[ShardMetadata] = None
    try:
        for suffix in order:
            tmp[suffix] = _atomic.temporary_path(prefix + suffix)
            for attempt in (1, 2):
                store.download(url.with_suffix(suffix), tmp[suffix], infos[suffix])
                fd = os.open(tmp[suffix], os.O_RDONLY)
                try:
                    metadata, crcs[suffix] = _verify_fd(fd, suffix, str(url.with_suffix(suffix)), infos[suffix].size,
                                                        metadata)
                    break
                except (ChecksumError, SizeMismatchError):
                    if attempt == 2:
                        raise
                finally:
                    os.close(fd)
        for suffix in order:
            _atomic.fsync_file(tmp[suffix])
            os.replace(tmp[suffix], prefix + suffix)
        _atomic.fsync_dir(prefix)
    finally:
        _atomic.remove_quietly(p for p in tmp.values() if os.path.exists(p))
    return crcs, metadata


def _verify_fd(fd: int, suffix: str, name: str, size: int,
               metadata: Optional[ShardMetadata]) -> Tuple[Optional[ShardMetadata], int]:
    """Check one file: ``.seq.idx`` by its own header and body CRC-32s (its metadata is
    returned), a file the metadata covers by that size and CRC-32; any other (a pretrain
    ``.idx``) only by its size here (its caller compares the CRC-32 with the receipt's).
    Returns ``(metadata, CRC-32 of the whole file)``.

    Raises:
        SizeMismatchError, ChecksumError, HeaderError, MetadataError: naming ``name``.
    """
    actual_size = os.fstat(fd).st_size
    if actual_size != size:
        raise SizeMismatchError("the file's size differs from the object's", path=name, field="size",
                                expected=size, actual=actual_size)
    if suffix == SEQ_IDX_SUFFIX:
        head = os.pread(fd, SEQ_IDX_HEADER_SIZE, 0)
        header = SeqIdxHeader.parse(head, name, size)
        body = _file_crc(fd, SEQ_IDX_HEADER_SIZE)
        if body != header.body_crc32:
            raise ChecksumError(".seq.idx body CRC-32 differs from its header", path=name, field="body_crc32",
                                expected=header.body_crc32, actual=body)
        found = ShardMetadata.decode(os.pread(fd, header.metadata_length, METADATA_OFFSET), path=name)
        return found, crc32_combine(crc32(head), body, size - len(head))
    actual = _file_crc(fd)
    digest = metadata.files.get(suffix) if metadata is not None else None
    if digest is None:  # pretrain .idx: no metadata records a checksum; the reader parses it
        return metadata, actual
    if digest.size != size:
        raise SizeMismatchError("file size differs from the size recorded in the metadata", path=name,
                                field="size", expected=digest.size, actual=size)
    if actual != digest.crc32:
        raise ChecksumError(f"CRC-32 is {actual:#010x}, the metadata records {digest.crc32:#010x}", path=name,
                            field="crc32", expected=digest.crc32, actual=actual,
                            hint="the object in the bucket (or its cached copy) is not the file the shard was "
                                 "written with; upload the shard again if this persists")
    return metadata, actual


def _file_crc(fd: int, offset: int = 0, crc: int = 0) -> int:
    """CRC-32 of the file from ``offset`` to its end, read in chunks by ``pread``."""
    while True:
        chunk = os.pread(fd, _CHUNK, offset)
        if not chunk:
            return crc
        crc = crc32(chunk, crc)
        offset += len(chunk)


# --------------------------------------------------------------------------- the receipt


def parse_receipt(path: str) -> dict:
    """The receipt at ``path``, checked field by field (types, ranges, cross-references).

    Returns:
        ``{"url", "generation", "objects": {suffix: {"size", "etag"}}, "files": {suffix:
        {"size", "crc32"}}}``.

    Raises:
        MetadataError: naming ``path`` and the field, for anything that is not exactly a
            version-2 receipt (a missing, extra or mistyped field, a size out of range, a file
            that is not one of the objects or differs from it in size).
    """
    def bad(field: str, message: str, actual=None) -> MetadataError:
        return MetadataError(f"index cache receipt: {message}", path=path, field=field, actual=actual,
                             hint="the cache entry is downloaded again")

    try:
        doc = load_json(path, max_length=RECEIPT_MAX_BYTES, what="index cache receipt",
                        limit_error=MetadataLimitError)
    except MetadataLimitError as exc:
        raise bad("json" if exc.limit != "bytes" else "size", exc.detail) from None
    except MetadataError as exc:
        raise bad("json", f"not UTF-8 JSON ({exc.detail})") from None
    _exact_keys(doc, {"format", "version", "url", "generation", "objects", "files"}, "", bad)
    if doc["format"] != RECEIPT_FORMAT:
        raise bad("format", f"not {RECEIPT_FORMAT!r}", doc["format"])
    if type(doc["version"]) is not int or doc["version"] != RECEIPT_VERSION:
        raise bad("version", f"version {RECEIPT_VERSION} expected", doc["version"])
    if not isinstance(doc["url"], str) or not doc["url"]:
        raise bad("url", "not a URL", doc["url"])
    if not isinstance(doc["generation"], str) or not _GENERATION.fullmatch(doc["generation"]):
        raise bad("generation", "not 16 hex digits", doc["generation"])
    objects = _entries(doc["objects"], "objects", {"size": int, "etag": str}, bad)
    files = _entries(doc["files"], "files", {"size": int, "crc32": int}, bad)
    for suffix, entry in files.items():
        if not 0 <= entry["crc32"] < 1 << 32:
            raise bad(f"files.{suffix}.crc32", "not a CRC-32", entry["crc32"])
        if suffix not in objects or objects[suffix]["size"] != entry["size"]:
            raise bad(f"files.{suffix}.size", "not the size of the object it copies", entry["size"])
    return doc


def _exact_keys(obj, keys: set, where: str, bad) -> None:
    if not isinstance(obj, dict):
        raise bad(where or "receipt", "not a JSON object", type(obj).__name__)
    missing, extra = keys - obj.keys(), obj.keys() - keys
    if missing or extra:
        name = sorted(missing or extra)[0]
        raise bad(f"{where}.{name}" if where else name, "missing" if missing else "unknown field")


def _entries(obj, where: str, fields: Dict[str, type], bad) -> dict:
    if not isinstance(obj, dict):
        raise bad(where, "not a JSON object", type(obj).__name__)
    for suffix, entry in obj.items():
        if suffix not in ALL_SUFFIXES:
            raise bad(f"{where}.{suffix}", "not a shard file suffix")
        _exact_keys(entry, set(fields), f"{where}.{suffix}", bad)
        for name, kind in fields.items():
            value = entry[name]
            if type(value) is not kind or (kind is int and not 0 <= value < 1 << 63):
                raise bad(f"{where}.{suffix}.{name}", f"not a {'non-negative int64' if kind is int else 'string'}",
                          value)
    return obj


def _match_receipt(doc: dict, path: str, url: ObjectURL, gen: str, infos: Dict[str, ObjectInfo],
                   suffixes) -> None:
    """The receipt must describe this entry: its URL, generation, the objects as listed now,
    and exactly the files asked for. Raises MetadataError naming the field that differs."""
    listed = {s: {"size": i.size, "etag": i.etag} for s, i in infos.items()}
    for field, want, got in (("url", str(url), doc["url"]), ("generation", gen, doc["generation"]),
                             ("objects", listed, doc["objects"]),
                             ("files", sorted(suffixes), sorted(doc["files"]))):
        if want != got:
            raise MetadataError(f"index cache receipt does not describe this entry ({field} differs)", path=path,
                                field=field, hint="the cache entry is downloaded again")


def _write_receipt(directory: str, url: ObjectURL, gen: str, infos: Dict[str, ObjectInfo],
                   crcs: Dict[str, int]) -> None:
    receipt = {"format": RECEIPT_FORMAT, "version": RECEIPT_VERSION, "url": str(url), "generation": gen,
               "objects": {s: {"size": i.size, "etag": i.etag} for s, i in infos.items()},
               "files": {s: {"size": infos[s].size, "crc32": crc} for s, crc in crcs.items()}}
    data = json.dumps(receipt, indent=1, sort_keys=True).encode("utf-8")
    _atomic.write_file_atomically(os.path.join(directory, RECEIPT), lambda f: f.write(data))


def _remove_older_generations(directory: str) -> None:
    """Other generations of this shard: their objects were replaced, nobody can read them on."""
    parent, name = os.path.split(directory)
    stem = name.rsplit("@", 1)[0]
    try:
        siblings = os.listdir(parent)
    except OSError:
        return
    for other in siblings:
        if other != name and other.rsplit("@", 1)[0] == stem and _GENERATION.fullmatch(other.rsplit("@", 1)[-1]):
            _atomic.remove_tree(os.path.join(parent, other), parent)


__all__ = ["open_cached", "parse_receipt", "generation", "entry_dir", "IDX_SUFFIX"]
