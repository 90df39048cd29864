"""The local storage source of a shard: the five files of one generation, opened without locks.

:class:`ShardFiles` is the source :class:`~megatron_sft_idx.reader.MMapIndexedDataset` composes for a
local prefix (``storage/remote.py`` holds the one for ``s3://`` / ``msc://``, with the same
interface): it reads the fixed headers (:meth:`ShardFiles.read`), maps the index files
(:meth:`ShardFiles.map`), makes the whole-file arrays of the data files
(:meth:`ShardFiles.data_array`) and serves a batch of slices (:meth:`ShardFiles.gather`). The
reader knows packs; a source knows bytes.

Opening one generation:

A shard at prefix ``P`` is replaced (the builder's ``overwrite=True``, ``check_idx
--promote --replace``, preprocessing's publish) only through
:func:`megatron_sft_idx.publishing.commit_shard`:

1. ``P.idx`` is removed first, before any other file of ``P`` changes;
2. the new companions are renamed over the old ones (old files the new shard lacks are
   removed);
3. a new ``P.idx`` is renamed into place last. It is always a file created for this
   publication, never a link to an index published before; and writers to one
   directory take turns (a lock on the directory), so two publications never interleave.

So whenever ``P.idx`` exists, the paths name one generation's five files. A reader:

1. opens ``P.idx`` (inode ``I``), then the four other files;
2. checks that the path ``P.idx`` still names ``I`` (``st_dev``, ``st_ino``);
3. keeps the descriptors and later maps the files *from them*, never by path again.

If ``P.idx`` named ``I`` at step 1 and still does at step 2, no publication removed ``I`` in
between (once removed, ``P.idx`` can only name a new file, and no new file can carry
``I``'s number while this reader holds ``I`` open), hence none touched a companion: the
four files opened in between are ``I``'s generation. If the check fails -- or ``P.idx`` is
missing while companions exist, the middle of a replacement -- the reader closes
everything and tries again after a short pause, a bounded number of times, then raises a
named error (:class:`ShardChangedError`, :class:`IncompleteShardError`).
"""

from __future__ import annotations

import mmap
import os
import stat
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from .errors import IncompleteShardError, ShardChangedError, ShardError, ShardNotFoundError
from .format import IDX_SUFFIX, ShardPaths

#: Attempts to open one generation before giving up, and the pause after the first failed
#: one, doubled each time up to the maximum (about 0.3 s in all): enough to wait out a
#: replacement in progress, short enough that a truly incomplete shard fails quickly.
OPEN_ATTEMPTS = 12
FIRST_PAUSE = 0.001
MAX_PAUSE = 0.05


class _Retry(Exception):
    """The files changed while they were being opened; ``missing`` when P.idx was absent."""

    def __init__(self, missing: bool, present: List[str]) -> None:
        super().__init__()
        self.missing, self.present = missing, present


class ShardFiles:
    """Descriptors of one generation's files (present ones only), their sizes, and maps made from them.

    The local storage source. A source's interface, as the reader uses it: ``prefix``, ``sizes``
    (``{suffix: bytes}`` of the files present), :meth:`read`, :meth:`map`, :meth:`data_array`,
    :meth:`gather`, :meth:`close`; ``remote`` and ``batched`` (whether a batch of packs is
    cheaper gathered at once than pack by pack); ``mmaps`` (for ``madvise``); ``config`` and
    ``local_index_prefix`` (remote sources only); :meth:`block_stats`, :meth:`clear_blocks`.
    """

    remote = False
    #: Local maps: the per-pack path (one lookup, scalar checks, three slices) costs less than
    #: any vectorised bookkeeping of a batch (bench.hotpath: a batch of 32 went 1.25-1.45x
    #: slower per pack the vectorised way).
    batched = False
    config = None
    local_index_prefix: Optional[str] = None

    def __init__(self, prefix: str, paths: ShardPaths, fds: Dict[str, int], sizes: Dict[str, int]) -> None:
        self.prefix, self.paths, self._fds, self.sizes = prefix, paths, fds, sizes
        self.mmaps: List[mmap.mmap] = []

    def path(self, suffix: str) -> str:
        return self.prefix + suffix

    def read(self, suffix: str, size: int, offset: int) -> bytes:
        """``size`` bytes at ``offset`` (fewer at the end of the file)."""
        try:
            return os.pread(self._fds[suffix], size, offset)
        except OSError as exc:  # an I/O error: name the file, not errno
            raise _unreadable(self.path(suffix), exc) from None

    def read_into(self, suffix: str, buffer, offset: int) -> int:
        """Fill ``buffer`` (writable, bytes-like) from ``offset``; the bytes read (fewer at the end)."""
        try:
            return os.preadv(self._fds[suffix], [buffer], offset)
        except OSError as exc:
            raise _unreadable(self.path(suffix), exc) from None

    def map(self, suffix: str):
        """``(uint8 array, mmap or None)``: a read-only map of the whole file, from its descriptor.

        The descriptor is closed once mapped (the map keeps its own).
        """
        size, fd = self.sizes[suffix], self._fds.pop(suffix, None)
        if fd is None:  # closed after an earlier failure to map
            raise ShardError("the file is no longer open", path=self.path(suffix), hint="reopen the shard")
        try:
            if size == 0:
                out = np.empty(0, dtype=np.uint8)
                out.flags.writeable = False
                return out, None
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # shrunk since open (ValueError), or an I/O error
            raise ShardError(f"cannot map file: {exc}", path=self.path(suffix),
                             hint="the file changed after the shard was opened; reopen it") from None
        finally:
            os.close(fd)
        self.mmaps.append(mm)
        return np.frombuffer(mm, dtype=np.uint8), mm

    def data_array(self, suffix: str, dtype, count: int, record_end: Optional[Callable[[int], int]] = None,
                   token_itemsize: int = 1):
        """The whole data file ``suffix`` as a read-only array of ``count`` ``dtype`` elements
        (a view of its map). ``record_end`` and ``token_itemsize`` are for sources that fetch
        blocks (unused here)."""
        return np.frombuffer(self.map(suffix)[0], dtype=dtype, count=count, offset=0)

    def gather(self, parts) -> list:
        """For each ``(array, starts, stops)``: the slices ``array[a:b]``."""
        return [[array[a:b] for a, b in zip(starts, stops)] for array, starts, stops in parts]

    def block_stats(self) -> Dict[str, Dict[str, int]]:
        """Block-cache hits and misses per remotely read file: none for local files."""
        return {}

    def clear_blocks(self) -> None:
        """Forget cached blocks of remotely read files: none for local files."""

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _unreadable(path: str, exc: OSError) -> ShardError:
    return ShardError(f"cannot read file: {exc.strerror or exc}", path=path,
                      hint="check that the path is a readable regular file")


def _open_regular(path: str) -> Optional[tuple]:
    """``(fd, stat)`` of a regular file, or None when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _unreadable(path, exc) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ShardError("not a regular file", path=path, hint="a shard is five regular files")
    return fd, st


def _try_open(prefix: str, paths: ShardPaths) -> ShardFiles:
    fds: Dict[str, int] = {}
    sizes: Dict[str, int] = {}
    try:
        opened = _open_regular(paths.idx)
        if opened is None:
            present = [s for s, p in paths.by_suffix().items() if os.path.exists(p)]
            if not present:
                raise ShardNotFoundError("no shard at this prefix (no .idx, .bin or SFT companions)", path=prefix)
            raise _Retry(missing=True, present=present)
        fds[IDX_SUFFIX], idx_stat = opened[0], opened[1]
        sizes[IDX_SUFFIX] = idx_stat.st_size
        for suffix, path in paths.by_suffix().items():
            if suffix != IDX_SUFFIX:
                opened = _open_regular(path)
                if opened is not None:
                    fds[suffix], sizes[suffix] = opened[0], opened[1].st_size
        try:
            now = os.stat(paths.idx)
        except FileNotFoundError:
            raise _Retry(missing=False, present=[]) from None
        if (now.st_dev, now.st_ino) != (idx_stat.st_dev, idx_stat.st_ino):
            raise _Retry(missing=False, present=[])
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return ShardFiles(prefix, paths, fds, sizes)


def open_generation(prefix: str, paths: ShardPaths) -> ShardFiles:
    """Open the files of one generation of the shard at ``prefix`` (see the module docstring).

    Raises:
        ShardNotFoundError: no file of the shard exists.
        IncompleteShardError: ``P.idx`` stays missing while other files exist.
        ShardChangedError: the files kept being replaced while they were opened.
        ShardError: a file exists but cannot be opened, or is not a regular file.
    """
    pause = FIRST_PAUSE
    for attempt in range(OPEN_ATTEMPTS):
        try:
            return _try_open(prefix, paths)
        except _Retry as retry:
            last = retry
        if attempt + 1 < OPEN_ATTEMPTS:
            time.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE)
    if last.missing:
        raise IncompleteShardError(f"{prefix}.idx is missing but {sorted(last.present)} exist",
                                   path=paths.idx, field="files")
    raise ShardChangedError(f"the shard was replaced while it was being opened, {OPEN_ATTEMPTS} times",
                            path=prefix)
