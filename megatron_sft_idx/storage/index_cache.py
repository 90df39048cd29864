"""The per-node cache of a remote shard's small index files.

``.idx``, ``.seq.idx`` and (when small) ``.seq.bin`` are downloaded once per node and
mapped from local disk, as megatron-core caches ``.idx`` files (``ObjectStorageConfig.
path_to_idx_cache``) — but without a barrier: the processes of a node (ranks, DataLoader
workers) take an ``flock`` on one lock file per shard; the first downloads, the others
wait on the lock and then find the files in place (``<key>.lock`` beside the entries).

Layout: ``<root>/<scheme>/<bucket>/<key>@<generation>/`` holds ``shard.idx``,
``shard.seq.idx``, ``shard.seq.bin`` and ``receipt.json``. The *generation* is a digest
of the five objects' sizes and ETags as listed at open, so a re-uploaded shard gets a
new directory: files of two generations never share a directory, and nothing a
running process has mapped is ever overwritten. Files are written under temporary
names, verified, fsynced and renamed; ``receipt.json`` is written last and is the
commit point of the entry. Verification at download: ``.seq.idx`` by its header and
body CRC-32s, the other files by the size and CRC-32 the metadata records. Older
generations of the same shard are removed once a newer one is committed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import zlib
from typing import Dict, Iterable, Optional

from .. import _atomic
from .._crc import crc32
from ..errors import ChecksumError, ShardError, SizeMismatchError
from ..format import IDX_SUFFIX, METADATA_OFFSET, SEQ_IDX_HEADER_SIZE, SEQ_IDX_SUFFIX, SeqIdxHeader
from ..metadata import ShardMetadata
from ._stores import ObjectInfo, ObjectStore
from ._url import ObjectURL

RECEIPT = "receipt.json"
RECEIPT_FORMAT = "megatron_sft_idx.index_cache"
LOCAL_NAME = "shard"
_SAFE = re.compile(r"[^A-Za-z0-9._=+,@-]")


def generation(infos: Dict[str, ObjectInfo]) -> str:
    """Digest of every object's size and ETag: a new upload is a new generation."""
    text = json.dumps({s: [i.size, i.etag] for s, i in sorted(infos.items())}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_dir(root: str, url: ObjectURL, gen: str) -> str:
    """``<root>/<scheme>/<bucket>/<key>@<gen>``, each key component made filesystem-safe."""
    parts = [_safe(p) for p in url.key.split("/") if p not in ("", ".")]
    parts[-1] = f"{parts[-1]}@{gen}" if parts else f"@{gen}"
    return os.path.join(root, url.scheme, _safe(url.bucket), *parts)


def _safe(part: str) -> str:
    part = _SAFE.sub("_", part)
    return "_" + part if part in ("..", "") else part


def cached_prefix(store: ObjectStore, url: ObjectURL, infos: Dict[str, ObjectInfo],
                  suffixes: Iterable[str], root: str) -> str:
    """The local prefix whose ``suffixes`` files are verified copies of ``url``'s objects.

    Downloads them (one process per node; the others wait on the lock) unless this
    generation is already committed.

    Raises:
        ChecksumError: a downloaded file does not match what the shard's metadata (or,
            for ``.seq.idx``, its own header) records, twice in a row.
        RemoteStorageError, ShardNotFoundError: the download failed.
        ShardError: the cache directory is not writable.
    """
    suffixes = tuple(suffixes)
    directory = entry_dir(root, url, generation(infos))
    prefix = os.path.join(directory, LOCAL_NAME)
    if _committed(directory, prefix, infos, suffixes):
        return prefix
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ShardError(f"cannot create the index cache directory: {exc.strerror or exc}", path=directory,
                         hint="set MEGATRON_SFT_IDX_CACHE (or cache_dir=) to a writable local directory") from None
    with _locked(directory.rsplit("@", 1)[0] + ".lock"):  # one lock per shard, whatever the generation
        if not _committed(directory, prefix, infos, suffixes):  # another process may have just done it
            _download(store, url, infos, suffixes, prefix)
            _write_receipt(directory, url, infos, suffixes)
            _remove_older_generations(directory)
    return prefix


def _committed(directory: str, prefix: str, infos: Dict[str, ObjectInfo], suffixes) -> bool:
    try:
        with open(os.path.join(directory, RECEIPT), "rb") as f:
            receipt = json.loads(f.read().decode("utf-8"))
        files = receipt["files"]
        return all(os.path.getsize(prefix + s) == infos[s].size == files[s] for s in suffixes)
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive ``flock`` on ``path`` (released by the kernel if the holder dies)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _download(store: ObjectStore, url: ObjectURL, infos: Dict[str, ObjectInfo], suffixes, prefix: str) -> None:
    """Every file to a temporary, verified (one retry of a mismatching download), then renamed."""
    order = sorted(suffixes, key=lambda s: s != SEQ_IDX_SUFFIX)  # .seq.idx first: its metadata verifies the rest
    tmp: Dict[str, str] = {}
    metadata: Optional[ShardMetadata] = None
    try:
        for suffix in order:
            tmp[suffix] = _atomic.temporary_path(prefix + suffix)
            for attempt in (1, 2):
                store.download(url.with_suffix(suffix), tmp[suffix], infos[suffix])
                try:
                    metadata = _verify(tmp[suffix], suffix, str(url.with_suffix(suffix)), infos[suffix], metadata)
                    break
                except (ChecksumError, SizeMismatchError):
                    if attempt == 2:
                        raise
        for suffix in order:
            _atomic.fsync_file(tmp[suffix])
            os.replace(tmp[suffix], prefix + suffix)
        _atomic.fsync_dir(prefix)
    finally:
        _atomic.remove_quietly(p for p in tmp.values() if os.path.exists(p))


def _verify(path: str, suffix: str, name: str, info: ObjectInfo, metadata: Optional[ShardMetadata]):
    """Check one downloaded file; returns the shard metadata once ``.seq.idx`` is read."""
    size = os.path.getsize(path)
    if size != info.size:
        raise SizeMismatchError("downloaded size differs from the listed size", path=name, field="size",
                                expected=info.size, actual=size)
    if suffix == SEQ_IDX_SUFFIX:
        with open(path, "rb") as f:
            raw = f.read()
        header = SeqIdxHeader.parse(raw[:SEQ_IDX_HEADER_SIZE], name, size)
        body = zlib.crc32(memoryview(raw)[SEQ_IDX_HEADER_SIZE:])
        if body != header.body_crc32:
            raise ChecksumError(".seq.idx body CRC-32 differs from its header", path=name, field="body_crc32",
                                expected=header.body_crc32, actual=body)
        return ShardMetadata.decode(raw[METADATA_OFFSET:METADATA_OFFSET + header.metadata_length], path=name)
    digest = metadata.files.get(suffix) if metadata is not None else None
    if digest is None:  # pretrain .idx: no metadata records a checksum; the reader parses it
        return metadata
    if digest.size != size:
        raise SizeMismatchError("file size differs from the size recorded in the metadata", path=name,
                                field="size", expected=digest.size, actual=size)
    actual = _file_crc(path)
    if actual != digest.crc32:
        raise ChecksumError(f"CRC-32 is {actual:#010x}, the metadata records {digest.crc32:#010x}", path=name,
                            field="crc32", expected=digest.crc32, actual=actual,
                            hint="the object in the bucket is not the file the shard was written with; "
                                 "upload the shard again")
    return metadata


def _file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(16 << 20)
            if not chunk:
                return crc
            crc = crc32(chunk, crc)


def _write_receipt(directory: str, url: ObjectURL, infos: Dict[str, ObjectInfo], suffixes) -> None:
    receipt = {"format": RECEIPT_FORMAT, "version": 1, "url": str(url),
               "objects": {s: {"size": i.size, "etag": i.etag} for s, i in infos.items()},
               "files": {s: infos[s].size for s in suffixes}}
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
        if other != name and other.rsplit("@", 1)[0] == stem and re.fullmatch(r"[0-9a-f]{16}", other.rsplit("@", 1)[-1]):
            shutil.rmtree(os.path.join(parent, other), ignore_errors=True)


__all__ = ["cached_prefix", "generation", "entry_dir", "IDX_SUFFIX"]
