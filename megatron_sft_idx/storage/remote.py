"""A shard in object storage, read through the same interface as a local one.

``MMapIndexedDataset("s3://bucket/train_000")`` constructs a :class:`RemoteIndexedDataset`
(the reader dispatches on the URL). At open it lists the five objects (one LIST, or
five HEADs where listing is not allowed), makes sure the small index files are in the
node's cache (:mod:`.index_cache`) and then runs the local reader's own checks on
them: headers, metadata, sizes against headers and metadata, the last pack's end.
``.bin`` and ``.loss.bin`` (and a ``.seq.bin`` above ``seq_bin_limit``) become
:class:`~.blocks.RemoteArray`\\ s, so ``ds[i]`` costs at most one ranged GET per data
file on a cache miss and none on a hit; :meth:`get_many` fetches a whole batch's
blocks with parallel GETs. It pickles as its URL and :class:`StorageConfig`, so every
DataLoader worker and rank reopens it (from the cache) itself.
"""

from __future__ import annotations

from typing import Dict, Optional

from .._files import ShardFiles
from ..errors import IncompleteShardError, ShardError, ShardNotFoundError
from ..format import ALL_SUFFIXES, BIN_SUFFIX, IDX_SUFFIX, SEQ_BIN_SUFFIX, SEQ_IDX_SUFFIX, SFT_SUFFIXES
from ..reader import MMapIndexedDataset, pack_index
from ._stores import ObjectInfo, ObjectStore, store_for
from ._url import ObjectURL
from .blocks import RemoteArray, fetch_pool
from .config import StorageConfig
from .index_cache import open_cached

__all__ = ["RemoteIndexedDataset", "stat_shard", "remote_shard_exists"]


def stat_shard(store: ObjectStore, url: ObjectURL) -> Dict[str, ObjectInfo]:
    """``{suffix: ObjectInfo}`` of the shard files that exist at ``url`` (``s3://``: one LIST,
    or five HEADs when the credentials may read objects but not list the bucket)."""
    return store.stat_files(url, ALL_SUFFIXES)


def remote_shard_exists(prefix: str, config: Optional[StorageConfig] = None) -> bool:
    """True when ``prefix.idx`` and ``prefix.bin`` exist in the store."""
    url = ObjectURL.parse(prefix)
    infos = stat_shard(store_for(url, StorageConfig.resolve(config)), url)
    return IDX_SUFFIX in infos and BIN_SUFFIX in infos


class RemoteIndexedDataset(MMapIndexedDataset):
    """Random access to the packs of a shard at an ``s3://`` or ``msc://`` URL.

    Args:
        prefix: the shard's URL without suffix.
        check_packs: as for :class:`MMapIndexedDataset`.
        config: a :class:`StorageConfig` (default: from the environment).
        cache_dir, block_size: override those fields of ``config``.
        object_storage_config: megatron-core's ``ObjectStorageConfig`` is accepted too:
            ``path_to_idx_cache`` is the cache directory, ``bin_chunk_nbytes`` the block size.

    Raises:
        everything :class:`MMapIndexedDataset` raises, naming the objects; plus
        RemoteStorageError (retries exhausted, access denied), RemoteTimeoutError (a read
        outlived its budget, docs/STORAGE.md), ResponseMismatchError (a response did not
        answer its request), ObjectChangedError (an object was replaced while being read),
        ChecksumError (a downloaded index file does not match the metadata),
        MissingExtraError (boto3 / MSC not installed).
    """

    def __init__(self, prefix, *, check_packs: bool = False, config: Optional[StorageConfig] = None,
                 cache_dir: Optional[str] = None, block_size: Optional[int] = None,
                 object_storage_config=None) -> None:
        if object_storage_config is not None:  # upstream's contract, same meaning
            cache_dir = cache_dir or getattr(object_storage_config, "path_to_idx_cache", None)
            block_size = block_size or getattr(object_storage_config, "bin_chunk_nbytes", None)
        self.url = ObjectURL.parse(prefix)
        self.config = StorageConfig.resolve(config, cache_dir=cache_dir, block_size=block_size)
        self._cached = frozenset()
        self._cache_prefix = None
        super().__init__(str(self.url), check_packs=check_packs)

    # ------------------------------------------------------------------ reader hooks

    def _open_files(self) -> ShardFiles:
        """The objects' sizes from one listing; descriptors of the node's verified copies of
        the index files (verified from these descriptors when reused, see index_cache)."""
        self._infos = infos = stat_shard(self._current_store(), self.url)
        sizes = {s: i.size for s, i in infos.items()}
        if IDX_SUFFIX not in infos:  # as a local open says it
            if not infos:
                raise ShardNotFoundError("no shard at this URL (no .idx, .bin or SFT companions)", path=self.prefix)
            raise IncompleteShardError(f"{self.prefix}.idx is missing but {sorted(infos)} exist",
                                       path=self.paths.idx, field="files")
        sft = [s for s in SFT_SUFFIXES if s in infos]
        if BIN_SUFFIX not in infos or len(sft) not in (0, len(SFT_SUFFIXES)):
            return ShardFiles(self.prefix, self.paths, {}, sizes)  # the reader names what is missing
        cached = [IDX_SUFFIX]
        if sft:
            cached.append(SEQ_IDX_SUFFIX)
            if infos[SEQ_BIN_SUFFIX].size <= self.config.seq_bin_limit:
                cached.append(SEQ_BIN_SUFFIX)
        try:
            self._cache_prefix, fds = open_cached(self._current_store(), self.url, infos, cached,
                                                  self.config.cache_root)
        except OSError as exc:
            raise ShardError(f"cannot use the index cache: {exc.strerror or exc}", path=exc.filename,
                             hint="clear the index cache directory, or set MEGATRON_SFT_IDX_CACHE") from None
        self._cached = frozenset(cached)
        return ShardFiles(self.prefix, self.paths, fds, sizes)

    def _data_array(self, suffix: str, dtype, count: int):
        if suffix in self._cached:
            return super()._data_array(suffix, dtype, count)
        info = self._infos[suffix]
        block = self.config.block_size
        if suffix != BIN_SUFFIX and suffix != SEQ_BIN_SUFFIX:
            block //= self._itemsize  # .loss.bin blocks cover the same tokens as .bin's
        extend = self._pack_end if suffix != SEQ_BIN_SUFFIX else None
        return RemoteArray(self._current_store, self.url.with_suffix(suffix), info.size, info.etag, dtype,
                           block, self.config.cache_blocks, self.config.concurrency, extend)

    def _current_store(self) -> ObjectStore:
        """This process's store (a forked worker gets its own client, not the parent's)."""
        return store_for(self.url, self.config)

    def _pack_end(self, token: int) -> int:
        """Token index where the pack straddling ``token`` ends (``token`` if none does): a
        block fetch is extended to it, so each pack is served by its first block's GET."""
        ptrs, itemsize = self._pointers, self._itemsize
        i = int(ptrs.searchsorted(token * itemsize, "left")) - 1
        if i < 0:
            return token
        return max(token, int(ptrs[i]) // itemsize + int(self._lengths[i]))

    def __getitem__(self, idx):
        # One pack's GETs (.bin, .loss.bin) go out in parallel: a miss costs one round trip.
        if isinstance(idx, slice):
            return super().__getitem__(idx)
        return self.get_many((pack_index(idx, self._n, self.prefix),))[0]

    _pack = __getitem__

    def _gather(self, parts) -> list:
        remote = [(array, list(zip(a, b))) for array, a, b in parts if isinstance(array, RemoteArray)]
        pinned = {}
        if len(remote) > 1:  # each array's missing blocks in its own thread, at the same time
            pool = fetch_pool(4, "arrays")
            jobs = {id(array): pool.submit(array.fetch_for, ranges) for array, ranges in remote}
            pinned = {key: job.result() for key, job in jobs.items()}
        out = []
        for array, starts, stops in parts:
            if isinstance(array, RemoteArray):
                out.append(array.gather(list(zip(starts, stops)), pinned.get(id(array))))
            else:
                out.append([array[a:b] for a, b in zip(starts, stops)])
        return out

    # ------------------------------------------------------------------ remote specifics

    @property
    def local_index_prefix(self) -> Optional[str]:
        """Where this node's verified copies of the index files are."""
        return self._cache_prefix

    def block_stats(self) -> Dict[str, Dict[str, int]]:
        """Block-cache hits and misses of each remotely read file in this process."""
        self._ensure_maps()
        out = {}
        for suffix, arr in ((BIN_SUFFIX, self._tokens), (".loss.bin", self._loss), (SEQ_BIN_SUFFIX, self._starts)):
            if isinstance(arr, RemoteArray):
                out[suffix] = {"hits": arr.hits, "misses": arr.misses, "block_size": arr.block_size}
        return out

    def clear_block_cache(self) -> None:
        """Forget every cached block of this process (the next reads fetch again)."""
        if not self.is_mapped:
            return
        for arr in (self._tokens, self._loss, self._starts):
            if isinstance(arr, RemoteArray):
                arr.clear()

    def __getstate__(self):
        return {"prefix": self.prefix, "check_packs": self.check_packs, "config": self.config}

    def __setstate__(self, state) -> None:
        self.__init__(state["prefix"], check_packs=state["check_packs"], config=state["config"])

    def __repr__(self) -> str:
        return f"Remote{super().__repr__()}"
