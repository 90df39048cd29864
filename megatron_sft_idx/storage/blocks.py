"""A large remote file read as a 1-D array, through ranged GETs and an in-memory block cache.

The object is cut into aligned blocks of ``block_size`` bytes. A read of elements
``[a, b)`` is served from the block its first byte lies in. A block is fetched whole,
by one ranged GET, the first time a read needs it; the fetch is extended past the
block's end to the end of the record (pack) that straddles it — the reader tells the
array where packs end — so a pack is always served by its first block's fetch: a pack
that fits in a block costs at most one request per file, cached or not, and nothing
is fetched twice for a pack that crosses a boundary. Missing blocks of one read (a
pack longer than a block) or of one :meth:`RemoteArray.gather` are coalesced into one
GET per contiguous run, runs fetched in parallel. The last ``cache_blocks`` blocks
stay in memory (LRU); a slice inside one fetch is a zero-copy view of it. The GETs of
one read share one deadline (``StorageConfig.operation_seconds`` of their bytes), so a
batch ends within one operation's budget however many runs it has.

``.loss.bin`` uses ``block_size / itemsize`` bytes per block, so its blocks cover the
same tokens as ``.bin``'s: the block-local order (:mod:`megatron_sft_idx.locality`)
then fetches each block of both files once per epoch.
"""

from __future__ import annotations

import collections
import concurrent.futures as futures
import os
import threading
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ._deadline import Deadline
from .urls import ObjectURL

#: Largest single GET when contiguous missing blocks are coalesced.
MAX_RUN_BYTES = 64 << 20

_POOLS: Dict[str, Tuple[int, futures.ThreadPoolExecutor]] = {}
_POOL_LOCK = threading.Lock()


def fetch_pool(workers: int, name: str = "runs") -> futures.ThreadPoolExecutor:
    """This process's thread pool ``name`` (a forked worker must not inherit the parent's
    threads). Jobs of one pool never wait on jobs of the same pool: a job that fans out
    uses another pool (``"arrays"`` fans out to ``"runs"``), so no pool can deadlock."""
    with _POOL_LOCK:
        pid, pool = _POOLS.get(name, (-1, None))
        if pool is None or pid != os.getpid():
            pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"msi-{name}")
            _POOLS[name] = (os.getpid(), pool)
        return pool


class RemoteArray:
    """Read-only 1-D ``dtype`` array stored in an object; ``a[i:j]`` fetches what it needs.

    Args:
        store: ``store()`` returns the :class:`~._stores.ObjectStore` to read through, looked
            up on every fetch so that a forked DataLoader worker uses its own client (never
            the parent's pooled connections).
        url: the object.
        size: its size in bytes (from the listing at open); ``etag``: its version, sent as
            ``If-Match`` so a replaced object is refused rather than mixed in.
        dtype: element type; ``block_size``: bytes per block (a multiple of the itemsize).
        cache_blocks: blocks kept in memory (LRU).
        concurrency: parallel GETs of :meth:`gather`.
        extend: ``extend(e) -> element index``: where the record that straddles element
            ``e`` ends (``e`` when none does). A fetch that ends at a block boundary is
            extended to it (by at most one block), so a pack that starts in a block is
            served from that block's fetch even when it runs into the next block.
    """

    def __init__(self, store, url: ObjectURL, size: int, etag: str, dtype, block_size: int,
                 cache_blocks: int, concurrency: int = 8, extend: Optional[Callable[[int], int]] = None) -> None:
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
        self.extend = extend
        self.shape = (self.nbytes // self.itemsize,)
        # block number -> bytes from the block's start to the end of what was fetched with it
        self._blocks: "collections.OrderedDict[int, memoryview]" = collections.OrderedDict()
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
            return self._slice(start, max(start, stop), {})
        i = int(key)
        if i < 0:
            i += self.shape[0]
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"index {key} out of range for {self.shape[0]} elements of {self.url}")
        return self._slice(i, i + 1, {})[0]

    def __array__(self, dtype=None, copy=None):
        out = self._slice(0, self.shape[0], {})
        return out if dtype is None else out.astype(dtype)

    def _slice(self, start: int, stop: int, pinned: Dict[int, memoryview]) -> np.ndarray:
        """Elements ``[start, stop)``; ``pinned`` holds blocks already fetched for this read."""
        b0, b1 = start * self.itemsize, stop * self.itemsize
        if b1 <= b0:
            out = np.empty(0, self.dtype)
            out.flags.writeable = False
            return out
        k0 = b0 // self.block_size
        first = pinned.get(k0)
        if first is None:
            first = self._ensure([k0])[k0]
        base = k0 * self.block_size
        if b1 - base <= len(first):  # the common case: a zero-copy view of one fetch
            return np.frombuffer(first, self.dtype, stop - start, b0 - base)
        k1 = (b1 - 1) // self.block_size
        blocks = {**pinned, **self._ensure([k for k in range(k0, k1 + 1) if k not in pinned])}
        parts = []
        for k in range(k0, k1 + 1):
            lo = max(b0, k * self.block_size) - k * self.block_size
            hi = min(b1, (k + 1) * self.block_size) - k * self.block_size
            parts.append(np.frombuffer(blocks[k], np.uint8, hi - lo, lo))
        out = np.concatenate(parts).view(self.dtype)
        out.flags.writeable = False
        return out

    def gather(self, ranges: Sequence[Tuple[int, int]], pinned: Optional[Dict[int, memoryview]] = None
               ) -> List[np.ndarray]:
        """``[self[a:b] for a, b in ranges]``, fetching every missing block first with
        ``concurrency`` parallel GETs (contiguous missing blocks share one request).
        ``pinned``: blocks already fetched for these ranges by :meth:`fetch_for`."""
        pinned = self.fetch_for(ranges) if pinned is None else pinned
        return [self._slice(a, b, pinned) for a, b in ranges]

    def fetch_for(self, ranges: Sequence[Tuple[int, int]]) -> Dict[int, memoryview]:
        """Every block the ``ranges`` need (missing ones fetched), held against eviction."""
        firsts = sorted({a * self.itemsize // self.block_size for a, b in ranges if b > a})
        pinned = self._ensure(firsts) if firsts else {}
        more = set()
        for a, b in ranges:  # reads running past their first block's fetch (long packs)
            if b > a:
                k0 = a * self.itemsize // self.block_size
                if b * self.itemsize - k0 * self.block_size > len(pinned[k0]):
                    more.update(range(k0 + 1, (b * self.itemsize - 1) // self.block_size + 1))
        if more - pinned.keys():
            pinned.update(self._ensure(sorted(more - pinned.keys())))
        return pinned

    # ------------------------------------------------------------------ the cache

    def _ensure(self, ks: Iterable[int]) -> Dict[int, memoryview]:
        """Blocks ``ks`` (fetched if missing), held in a dict so none is evicted before use."""
        ks = list(ks)
        have: Dict[int, memoryview] = {}
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

    def _fetch(self, missing: List[int]) -> Dict[int, memoryview]:
        spans = [self._span(run) for run in _runs(missing, max(1, MAX_RUN_BYTES // self.block_size))]
        store = self.store()
        deadline = Deadline(store.config.operation_seconds(sum(stop - start for _, _, start, stop in spans)))

        def fetch(span):
            return self._fetch_run(store, span, deadline)

        if len(spans) == 1 or self.concurrency == 1:
            results = [fetch(span) for span in spans]
        else:
            results = list(fetch_pool(self.concurrency).map(fetch, spans))
        out: Dict[int, memoryview] = {}
        for part in results:
            out.update(part)
        return out

    def _span(self, run: Tuple[int, int]) -> Tuple[int, int, int, int]:
        """``(k0, k1, start, stop)``: the bytes one GET fetches for blocks ``[k0, k1]``, plus
        the tail of a record straddling the end."""
        k0, k1 = run
        start = k0 * self.block_size
        stop = min((k1 + 1) * self.block_size, self.nbytes)
        if self.extend is not None and stop < self.nbytes:
            # Untrusted index: never extend by more than one block.
            end = int(self.extend(stop // self.itemsize)) * self.itemsize
            stop = min(max(stop, end), stop + self.block_size, self.nbytes)
        return k0, k1, start, stop

    def _fetch_run(self, store, span: Tuple[int, int, int, int], deadline: Deadline) -> Dict[int, memoryview]:
        """One GET for one span, within the read's ``deadline``."""
        k0, k1, start, stop = span
        view = memoryview(store.read_range(self.url, start, stop - start, self.etag, deadline))
        # Each block's entry runs to the end of the fetch (views of one buffer: no copy).
        return {k: view[(k - k0) * self.block_size:] for k in range(k0, k1 + 1)}

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
