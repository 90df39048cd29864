"""Where ``--tokenizer`` comes from: a local path, an object-storage URL, or a Hugging Face name.

A local directory (or ``tokenizer.json``) is loaded where it is. A URL (``s3://bucket/tok/``,
``msc://profile/tok/``: the tokenizer's files directly under that prefix) or a Hugging Face hub
name (``org/name``: from the local Hugging Face cache -- the commands set ``HF_HUB_OFFLINE=1``
unless it is set, so nothing is downloaded unasked; with ``HF_HUB_OFFLINE=0`` from the hub when
it is reachable, else the cache) is *resolved once* by the driver into
:class:`TokenizerFiles` -- the bytes of the tokenizer's files (those of :data:`TOKENIZER_FILES`
that exist; ``tokenizer.json`` must), at most :data:`MAX_TOKENIZER_BYTES` in all -- which the
run ships to its tasks with the step (Ray's object store holds the step; forked workers inherit
it). Each process then :meth:`~TokenizerFiles.materialize`\\ s them into its own node's cache
directory (``<cache>/tokenizers/``, ``<cache>`` the index cache's: ``MEGATRON_SFT_IDX_CACHE``,
else ``$XDG_CACHE_HOME/megatron_sft_idx``; never a path the driver chose), in a directory
named by the digest of the files, holding one directory named as the source's last level (one
plain name: a URL with an empty, ``.`` or ``..`` level is refused before anything is read), so
the tokenizer loads, names itself and hashes (``files_sha256``) exactly as a local copy of the
same files does: the same shards. The copies are a cache a later run reuses, bounded: each use
marks its copy's directory (its mtime), and the copies beyond the :data:`CACHE_KEEP` most recently
used, or unused for :data:`CACHE_MAX_AGE` seconds, are removed when a copy is materialized.
Nothing is deleted outside ``<cache>/tokenizers/`` (:func:`~megatron_sft_idx._atomic.remove_tree`).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..._atomic import remove_tree
from ..._extras import require_extra
from ...errors import ShardError
from ...storage import ObjectURL, is_remote
from ...storage.config import StorageConfig
from ...storage.urls import check_url, plain_name

#: The files of a tokenizer that are shipped (and hashed into its identity, :mod:`.chat`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "added_tokens.json")
#: The most bytes a shipped tokenizer's files may hold together.
MAX_TOKENIZER_BYTES = 64 << 20
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_ROOT = "tokenizers"
#: Tokenizer copies a node's cache keeps (the most recently used), and the seconds an unused one stays.
CACHE_KEEP, CACHE_MAX_AGE = 8, 30 * 86400


@dataclass(frozen=True, eq=False)
class TokenizerFiles:
    """A tokenizer's files, by value: what the driver ships to the tasks.

    ``source``: the URL or hub name as given (what the run records as the tokenizer's path);
    ``name``: the directory name a local copy has (the source's last level); ``files``:
    ``((file name, bytes), ...)`` sorted by name; ``digest``: sha256 over names and bytes.
    """

    source: str
    name: str
    files: Tuple[Tuple[str, bytes], ...]
    digest: str

    @classmethod
    def of(cls, source: str, name: str, files: Dict[str, bytes]) -> "TokenizerFiles":
        items = tuple(sorted(files.items()))
        return cls(source, name, items, _digest(items))

    def __hash__(self) -> int:   # (a key of the per-process encoder cache: by content, not bytes compared)
        return hash((self.source, self.name, self.digest))

    def __eq__(self, other) -> bool:
        return isinstance(other, TokenizerFiles) and (self.source, self.name, self.digest) == \
            (other.source, other.name, other.digest)

    @property
    def size(self) -> int:
        return sum(len(data) for _, data in self.files)

    def materialize(self) -> str:
        """The directory of this process's node that holds these files (written once, atomically;
        a copy found there is used when its bytes verify, else written again).

        Raises:
            ShardError: the temporary directory cannot be written; ``name`` is no plain name.
        """
        with _LOCK:
            root = os.path.join(StorageConfig.resolve().cache_root, _ROOT)
            key = (self.digest, self.name, root)   # (the name can be the identity's; another cache: a new copy)
            known = _MATERIALIZED.get(key)
            if known is not None and os.path.isdir(known):
                return known
            parent = os.path.join(root, self.digest[:32])
            target = os.path.join(parent, plain_name(self.name, "the tokenizer's directory name"))
            try:
                if not _holds(target, self.files):
                    _write_directory(parent, target, self.files)
                os.utime(parent)   # (used now: the bound keeps the most recently used)
            except OSError as exc:
                raise ShardError(f"cannot write the tokenizer's files to this node's cache directory "
                                 f"({exc.strerror or exc})", path=getattr(exc, "filename", None) or parent,
                                 field="tokenizer", hint="free space there, or set MEGATRON_SFT_IDX_CACHE to a "
                                                         "writable local directory") from None
            _evict(root, keep=parent)
            _MATERIALIZED[key] = target
            return target


_MATERIALIZED: Dict[Tuple[str, str, str], str] = {}
_RESOLVED: Dict[str, TokenizerFiles] = {}
_LOCK = threading.Lock()


def _digest(items) -> str:
    h = hashlib.sha256()
    for name, data in items:
        h.update(name.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode())
    return h.hexdigest()


def _holds(directory: str, files) -> bool:
    """Whether ``directory`` holds exactly these files with these bytes."""
    try:
        if sorted(os.listdir(directory)) != [name for name, _ in files]:
            return False
        for name, data in files:
            with open(os.path.join(directory, name), "rb") as f:
                if f.read(len(data) + 1) != data:
                    return False
    except OSError:
        return False
    return True


def _evict(root: str, keep: str) -> None:
    """Remove the copies under ``root`` beyond the :data:`CACHE_KEEP` most recently used, or
    unused for :data:`CACHE_MAX_AGE` seconds (never ``keep``, the copy in use). Best effort: a
    copy another process removes or renews meanwhile is left to it."""
    try:
        entries = [(os.stat(os.path.join(root, n)).st_mtime, os.path.join(root, n)) for n in os.listdir(root)]
    except OSError:
        return
    oldest = time.time() - CACHE_MAX_AGE
    for rank, (mtime, path) in enumerate(sorted(entries, reverse=True)):
        if path != keep and (rank >= CACHE_KEEP or mtime < oldest):
            remove_tree(path, root)


def _write_directory(parent: str, target: str, files) -> None:
    """Write ``files`` into a fresh directory beside ``target`` and rename it into place."""
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=parent)
    try:
        for name, data in files:
            with open(os.path.join(staging, name), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        if os.path.isdir(target):   # a copy that did not verify (or another process's, just made)
            if _holds(target, files):
                return
            remove_tree(target, parent)
        try:
            os.rename(staging, target)
            staging = None
        except OSError:   # another process of this node renamed its copy first: use it if whole
            if not _holds(target, files):
                raise
    finally:
        if staging is not None:
            remove_tree(staging, parent)


def tokenizer_origin(value: Optional[str]) -> str:
    """Where ``--tokenizer value`` comes from: ``"storage"`` (an ``s3://`` / ``msc://`` URL),
    ``"hub"`` (a hub name, ``org/name`` or ``name``, where no local path of that name exists) or
    ``"local"`` (a path, or no tokenizer)."""
    if not value:
        return "local"
    if is_remote(value):
        return "storage"
    return "hub" if not os.path.exists(value) and _HUB_NAME.match(value) else "local"


def is_tokenizer_reference(value: Optional[str]) -> bool:
    """Whether ``--tokenizer value`` is resolved by the driver and shipped: a URL, or a hub name
    (``org/name`` or ``name``) where no local path of that name exists."""
    return tokenizer_origin(value) != "local"


def resolve_tokenizer(value: str) -> TokenizerFiles:
    """The files of the tokenizer ``value`` (a URL or a hub name) read once per process.

    Raises:
        ShardError: no ``tokenizer.json`` there, more than :data:`MAX_TOKENIZER_BYTES`, a hub
            name neither reachable nor cached; RemoteStorageError and its kin: the store failed.
    """
    with _LOCK:
        known = _RESOLVED.get(value)
    if known is not None:
        return known
    files = _from_storage(value) if tokenizer_origin(value) == "storage" else _from_hub(value)
    with _LOCK:
        _RESOLVED[value] = files
    return files


def local_tokenizer(value: str) -> str:
    """A path ``ChatTokenizer`` loads for ``--tokenizer value``: ``value`` itself when local, else
    the node-local copy of its files (:func:`resolve_tokenizer`, then materialized)."""
    return resolve_tokenizer(value).materialize() if is_tokenizer_reference(value) else value


def _too_large(value: str, size: int) -> ShardError:
    return ShardError(f"the tokenizer's files hold {size} bytes, more than the {MAX_TOKENIZER_BYTES} a run ships "
                      "to its tasks", path=value, field="tokenizer", expected=MAX_TOKENIZER_BYTES, actual=size,
                      hint="give a directory holding only the tokenizer's files (tokenizer.json, "
                           "tokenizer_config.json, ...), or a local copy on every node")


def _from_storage(value: str) -> TokenizerFiles:
    from ...storage.objects import list_objects, open_object   # (start-up: the object-store layer loads for a URL only)

    url = ObjectURL.parse(check_url(value, "--tokenizer"))
    if url.name in TOKENIZER_FILES and not value.endswith("/"):   # a tokenizer.json named directly
        url = url.parent
    directory = str(url).rstrip("/") + "/"
    listed = {ObjectURL.parse(u).key.rpartition("/")[2]: (u, info) for u, info in list_objects(directory)
              if "/" not in ObjectURL.parse(u).key[len(ObjectURL.parse(directory).key):]}
    chosen = {name: listed[name] for name in TOKENIZER_FILES if name in listed}
    if "tokenizer.json" not in chosen:
        raise ShardError("no tokenizer.json under this URL", path=directory, field="tokenizer",
                         hint="--tokenizer takes a local directory, the URL of a directory holding tokenizer.json "
                              "(and tokenizer_config.json), or a Hugging Face name")
    size = sum(info.size for _, info in chosen.values())
    if size > MAX_TOKENIZER_BYTES:
        raise _too_large(value, size)
    files = {}
    for name, (u, info) in chosen.items():
        with open_object(u, info=info) as f:
            data = f.read()
        if len(data) != info.size:
            raise ShardError(f"read {len(data)} bytes of a tokenizer file listed with {info.size}", path=u,
                             field="tokenizer", hint="the file changed while it was read; run again")
        files[name] = data
    return TokenizerFiles.of(value, url.name or url.bucket, files)


def _from_hub(value: str) -> TokenizerFiles:
    require_extra("preprocess", "huggingface_hub")
    from huggingface_hub import snapshot_download   # (an optional, heavy dependency: hub names only)

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:   # (the cache named now, not when huggingface_hub was imported)
        directory = snapshot_download(value, allow_patterns=list(TOKENIZER_FILES), local_files_only=offline,
                                      cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    except Exception as exc:   # (the hub's own errors: not found, offline and not cached, network)
        raise ShardError(f"--tokenizer {value!r} is neither a local path nor a Hugging Face tokenizer this machine "
                         f"can get ({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                         path=value, field="tokenizer",
                         hint="give a local directory, an s3:// or msc:// URL, or a hub name that is reachable "
                              "or in the local Hugging Face cache (HF_HUB_CACHE)") from None
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]
    if "tokenizer.json" not in names:
        raise ShardError("the Hugging Face repository has no tokenizer.json", path=value, field="tokenizer",
                         hint="give a repository with a fast tokenizer (tokenizer.json)")
    size = sum(os.path.getsize(os.path.join(directory, n)) for n in names)
    if size > MAX_TOKENIZER_BYTES:
        raise _too_large(value, size)
    files = {}
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            files[name] = f.read()
    return TokenizerFiles.of(value, value.rstrip("/").rpartition("/")[2], files)
