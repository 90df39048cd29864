"""A large remote file read as a 1-D array, through ranged GETs and an in-memory block cache.

The object is cut into aligned blocks of ``block_size`` bytes. Reading elements
``[a, b)`` needs the blocks they cover; every missing block of one read is fetched by
one ranged GET (the missing blocks of a read are contiguous unless the read spans a
cached block in the middle, which a pack smaller than a block never does). So a pack
that fits in one block costs at most one request per file, and one that straddles a
boundary still costs one. The last ``cache_blocks`` blocks stay in memory (LRU); a
slice inside one block is a zero-copy view of it, a slice across blocks a copy.

``.loss.bin`` uses ``block_size / itemsize`` bytes per block, so its blocks cover the
same tokens as ``.bin``'s: the block-local order (:mod:`megatron_sft_idx.locality`)
then fetches each block of both files once per epoch.
"""

from __future__ import annotations

import collections
import concurrent.futures as futures
import os
import threading
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ._url import ObjectURL

#: Largest single GET when contiguous missing blocks are coalesced.
MAX_RUN_BYTES = 64 << 20

_POOL: Optional[futures.ThreadPoolExecutor] = None
_POOL_PID = -1
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> futures.ThreadPoolExecutor:
    """One fetch pool per process (a forked worker must not inherit the parent's threads)."""
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():
            _POOL = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="msi-fetch")
            _POOL_PID = os.getpid()
        return _POOL


class RemoteArray:
    """Read-only 1-D ``dtype`` array stored in an object; ``a[i:j]`` fetches what it needs.

    Args:
        store: the :class:`~._stores.ObjectStore` to read through.
        url: the object.
        size: its size in bytes (from the listing at open); ``etag``: its version, sent as
            ``If-Match`` so a replaced object is refused rather than mixed in.
        dtype: element type; ``block_size``: bytes per block (a multiple of the itemsize).
        cache_blocks: blocks kept in memory (LRU).
        concurrency: parallel GETs of :meth:`gather`.
    """

    def __init__(self, store, url: ObjectURL, size: int, etag: str, dtype, block_size: int,
                 cache_blocks: int, concurrency: int = 8) -> None:
        self.store = store
        self.url = url
        self.nbytes = int(size)
        self.etag = etag
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        if block_size % self.itemsize:
            raise ValueError("block_size must be a multiple of the itemsize")
        self.block_size = int(block_size)
        self.cache_blocks = max(1, int(cache_blocks))
        self.concurrency = int(concurrency)
        self.shape = (self.nbytes // self.itemsize,)
        self._blocks: "collections.OrderedDict[int, bytes | memoryview]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"RemoteArray({self.url}, dtype={self.dtype}, len={self.shape[0]}, block={self.block_size})"

    # ------------------------------------------------------------------ reads

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            if step != 1:
                raise ValueError("remote arrays support contiguous slices only (step 1)")
            return self._slice(start, max(start, stop), None)
        i = int(key)
        if i < 0:
            i += self.shape[0]
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"index {key} out of range for {self.shape[0]} elements of {self.url}")
        return self._slice(i, i + 1, None)[0]

    def __array__(self, dtype=None, copy=None):
        out = self._slice(0, self.shape[0], None)
        return out if dtype is None else out.astype(dtype)

    def _slice(self, start: int, stop: int, pinned: Optional[Dict[int, bytes]]) -> np.ndarray:
        b0, b1 = start * self.itemsize, stop * self.itemsize
        if b1 <= b0:
            out = np.empty(0, self.dtype)
            out.flags.writeable = False
            return out
        k0, k1 = b0 // self.block_size, (b1 - 1) // self.block_size
        blocks = pinned if pinned is not None else self._ensure(range(k0, k1 + 1))
        if k0 == k1:  # the common case: a zero-copy view into one cached block
            return np.frombuffer(blocks[k0], self.dtype, stop - start, b0 - k0 * self.block_size)
        parts = []
        for k in range(k0, k1 + 1):
            lo = max(b0, k * self.block_size) - k * self.block_size
            hi = min(b1, (k + 1) * self.block_size) - k * self.block_size
            parts.append(np.frombuffer(blocks[k], np.uint8, hi - lo, lo))
        out = np.concatenate(parts).view(self.dtype)
        out.flags.writeable = False
        return out

    def gather(self, ranges: Sequence[Tuple[int, int]]) -> List[np.ndarray]:
        """``[self[a:b] for a, b in ranges]``, fetching every missing block first with
        ``concurrency`` parallel GETs (contiguous missing blocks share one request)."""
        needed = set()
        for a, b in ranges:
            if b > a:
                needed.update(range(a * self.itemsize // self.block_size,
                                    (b * self.itemsize - 1) // self.block_size + 1))
        pinned = self._ensure(sorted(needed))
        return [self._slice(a, b, pinned) for a, b in ranges]

    # ------------------------------------------------------------------ the cache

    def _ensure(self, ks: Iterable[int]) -> Dict[int, bytes]:
        """Blocks ``ks`` (fetched if missing), held in a dict so none is evicted before use."""
        ks = list(ks)
        have: Dict[int, bytes] = {}
        with self._lock:
            for k in ks:
                data = self._blocks.get(k)
                if data is not None:
                    self._blocks.move_to_end(k)
                    have[k] = data
        missing = [k for k in ks if k not in have]
        self.hits += len(ks) - len(missing)
        if missing:
            self.misses += len(missing)
            fetched = self._fetch(missing)
            have.update(fetched)
            with self._lock:
                for k in missing:
                    self._blocks[k] = fetched[k]
                    self._blocks.move_to_end(k)
                while len(self._blocks) > self.cache_blocks:
                    self._blocks.popitem(last=False)
        return have

    def _fetch(self, missing: List[int]) -> Dict[int, bytes]:
        runs = _runs(missing, max(1, MAX_RUN_BYTES // self.block_size))
        if len(runs) == 1 or self.concurrency == 1:
            results = [self._fetch_run(r) for r in runs]
        else:
            results = list(_pool(self.concurrency).map(self._fetch_run, runs))
        out: Dict[int, bytes] = {}
        for part in results:
            out.update(part)
        return out

    def _fetch_run(self, run: Tuple[int, int]) -> Dict[int, bytes]:
        """One GET for blocks ``[k0, k1]``, split into per-block bytes."""
        k0, k1 = run
        start = k0 * self.block_size
        stop = min((k1 + 1) * self.block_size, self.nbytes)
        data = self.store.read_range(self.url, start, stop - start, self.etag)
        if k0 == k1:
            return {k0: data}
        view = memoryview(data)  # per-block views share the one buffer: no copy
        return {k: view[(k - k0) * self.block_size:(k - k0 + 1) * self.block_size]
                for k in range(k0, k1 + 1)}

    def cached_blocks(self) -> List[int]:
        with self._lock:
            return list(self._blocks)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()


def _runs(ks: List[int], longest: int) -> List[Tuple[int, int]]:
    """Sorted block numbers as runs of consecutive numbers ``(first, last)``, at most
    ``longest`` blocks each (so one GET never grows without bound)."""
    ks = sorted(ks)
    runs = []
    first = prev = ks[0]
    for k in ks[1:]:
        if k != prev + 1 or k - first >= longest:
            runs.append((first, prev))
            first = k
        prev = k
    runs.append((first, prev))
    return runs
