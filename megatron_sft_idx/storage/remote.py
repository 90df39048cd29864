"""The storage source of a shard in object storage: what the reader composes for a URL.

``MMapIndexedDataset("s3://bucket/train_000")`` opens a :class:`RemoteShardFiles` as its
source (the reader chooses it at open; this module knows nothing of datasets). At open it
lists the five objects (one LIST, or five HEADs where listing is not allowed) and makes
sure the small index files are in the node's cache (:mod:`.index_cache`): the reader then
runs its own checks on them, as on local files -- headers, metadata, sizes against headers
and metadata, the last pack's end. ``.bin`` and ``.loss.bin`` (and a ``.seq.bin`` above
``seq_bin_limit``) become :class:`~.blocks.RemoteArray`\\ s, so a pack costs at most one
ranged GET per data file on a cache miss and none on a hit; :meth:`RemoteShardFiles.gather`
fetches a whole batch's blocks with parallel GETs. A dataset over it pickles as its URL and
:class:`StorageConfig`, so every DataLoader worker and rank reopens it (from the cache) itself.

``RemoteIndexedDataset`` was a name for :class:`~megatron_sft_idx.reader.MMapIndexedDataset` (which
opens URLs itself); looking it up here warns and fails (:mod:`megatron_sft_idx._moved`): this module
never imports the reader.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from .._files import ShardFiles
from .._moved import moved_getattr
from ..errors import IncompleteShardError, ShardError, ShardNotFoundError
from ..format import ALL_SUFFIXES, BIN_SUFFIX, IDX_SUFFIX, LOSS_SUFFIX, SEQ_BIN_SUFFIX, SEQ_IDX_SUFFIX, \
    SFT_SUFFIXES, ShardPaths
from ._stores import ObjectInfo, ObjectStore, store_for
from .blocks import RemoteArray, fetch_pool
from .config import StorageConfig
from .index_cache import open_cached
from .urls import ObjectURL

__all__ = ["RemoteShardFiles", "stat_shard", "remote_shard_exists", "storage_config"]


def stat_shard(store: ObjectStore, url: ObjectURL) -> Dict[str, ObjectInfo]:
    """``{suffix: ObjectInfo}`` of the shard files that exist at ``url`` (``s3://``: one LIST,
    or five HEADs when the credentials may read objects but not list the bucket)."""
    return store.stat_files(url, ALL_SUFFIXES)


def remote_shard_exists(prefix: str, config: Optional[StorageConfig] = None) -> bool:
    """True when ``prefix.idx`` and ``prefix.bin`` exist in the store."""
    url = ObjectURL.parse(prefix)
    infos = stat_shard(store_for(url, StorageConfig.resolve(config)), url)
    return IDX_SUFFIX in infos and BIN_SUFFIX in infos


def storage_config(config: Optional[StorageConfig] = None, cache_dir: Optional[str] = None,
                   block_size: Optional[int] = None, object_storage_config=None) -> StorageConfig:
    """The :class:`StorageConfig` a remote shard is read with: ``config`` (default: from the
    environment) with ``cache_dir`` / ``block_size`` overridden; megatron-core's
    ``ObjectStorageConfig`` is accepted too, with the same meaning (``path_to_idx_cache`` is the
    cache directory, ``bin_chunk_nbytes`` the block size)."""
    if object_storage_config is not None:  # upstream's contract, same meaning
        cache_dir = cache_dir or getattr(object_storage_config, "path_to_idx_cache", None)
        block_size = block_size or getattr(object_storage_config, "bin_chunk_nbytes", None)
    return StorageConfig.resolve(config, cache_dir=cache_dir, block_size=block_size)


class RemoteShardFiles(ShardFiles):
    """The source of a shard at an ``s3://`` or ``msc://`` URL: the objects' sizes from one
    listing, descriptors of the node's verified copies of the index files (verified from these
    descriptors when reused, see :mod:`.index_cache`), the data files read by blocks.

    Raises:
        ShardNotFoundError, IncompleteShardError (as a local open says them); ShardError (the
        index cache is unusable); RemoteStorageError, RemoteTimeoutError, ResponseMismatchError,
        ObjectChangedError, ChecksumError (a downloaded index file does not match the
        metadata), MissingExtraError (boto3 / MSC not installed).
    """

    remote = True
    batched = True  # one pack's (and one batch's) GETs go out in parallel

    def __init__(self, prefix, config: StorageConfig) -> None:
        self.url = ObjectURL.parse(prefix)
        self.config = config
        prefix = str(self.url)
        paths = ShardPaths.from_prefix(prefix)
        self.infos = infos = stat_shard(self.store(), self.url)
        sizes = {s: i.size for s, i in infos.items()}
        self._cached = frozenset()
        self._arrays: Dict[str, RemoteArray] = {}
        super().__init__(prefix, paths, {}, sizes)
        if IDX_SUFFIX not in infos:  # as a local open says it
            if not infos:
                raise ShardNotFoundError("no shard at this URL (no .idx, .bin or SFT companions)", path=prefix)
            raise IncompleteShardError(f"{prefix}.idx is missing but {sorted(infos)} exist",
                                       path=paths.idx, field="files")
        sft = [s for s in SFT_SUFFIXES if s in infos]
        if BIN_SUFFIX not in infos or len(sft) not in (0, len(SFT_SUFFIXES)):
            return  # the reader names what is missing
        cached = [IDX_SUFFIX]
        if sft:
            cached.append(SEQ_IDX_SUFFIX)
            if infos[SEQ_BIN_SUFFIX].size <= config.seq_bin_limit:
                cached.append(SEQ_BIN_SUFFIX)
        try:
            self.local_index_prefix, self._fds = open_cached(self.store(), self.url, infos, cached,
                                                             config.cache_root)
        except OSError as exc:
            raise ShardError(f"cannot use the index cache: {exc.strerror or exc}", path=exc.filename,
                             hint="clear the index cache directory, or set MEGATRON_SFT_IDX_CACHE") from None
        self._cached = frozenset(cached)

    def store(self) -> ObjectStore:
        """This process's store (a forked worker gets its own client, not the parent's)."""
        return store_for(self.url, self.config)

    def data_array(self, suffix: str, dtype, count: int, record_end: Optional[Callable[[int], int]] = None,
                   token_itemsize: int = 1):
        """A cached file's map, or a :class:`RemoteArray` whose block fetches are extended to
        ``record_end(token)`` (where the pack straddling that token ends), so each pack is
        served by its first block's GET. ``.loss.bin`` blocks (one byte per token) cover the
        same tokens as ``.bin``'s (``token_itemsize`` bytes per token)."""
        if suffix in self._cached:
            return super().data_array(suffix, dtype, count)
        info = self.infos[suffix]
        block = self.config.block_size
        if suffix == LOSS_SUFFIX:
            block //= token_itemsize
        extend = record_end if suffix != SEQ_BIN_SUFFIX else None
        array = RemoteArray(self.store, self.url.with_suffix(suffix), info.size, info.etag, dtype, block,
                            self.config.cache_blocks, self.config.concurrency, extend)
        self._arrays[suffix] = array
        return array

    def gather(self, parts) -> list:
        """For each ``(array, starts, stops)``: the slices ``array[a:b]``, the missing blocks of
        every remote array fetched at once, each array's in its own thread."""
        remote = [(array, list(zip(a, b))) for array, a, b in parts if isinstance(array, RemoteArray)]
        pinned = {}
        if len(remote) > 1:
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

    def block_stats(self) -> Dict[str, Dict[str, int]]:
        return {suffix: {"hits": arr.hits, "misses": arr.misses, "block_size": arr.block_size}
                for suffix, arr in self._arrays.items()}

    def clear_blocks(self) -> None:
        for arr in self._arrays.values():
            arr.clear()


# RemoteIndexedDataset: the reader's old name here, which would be an import back up.
__getattr__ = moved_getattr(__name__)
