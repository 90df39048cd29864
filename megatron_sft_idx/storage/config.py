"""How remote shards are read: cache directory, block size, memory, retries.

Every field has an environment variable, so a training launcher can set it for every
rank and DataLoader worker without touching code; an explicit argument wins over the
environment, which wins over the default::

    MEGATRON_SFT_IDX_CACHE         directory of the per-node index cache
                                   (default: $XDG_CACHE_HOME/megatron_sft_idx, else
                                   ~/.cache/megatron_sft_idx)
    MEGATRON_SFT_IDX_BLOCK_SIZE    bytes of .bin per ranged GET (default 1 MiB; suffixes
                                   K/M/G accepted); .loss.bin blocks cover the same tokens.
                                   A full shuffle wants small blocks (64K-256K: a miss per
                                   pack); the block-local order large ones (4M-16M)
    MEGATRON_SFT_IDX_CACHE_BLOCKS  blocks kept in memory per data file per process (default 16)
    MEGATRON_SFT_IDX_SEQ_BIN_LIMIT .seq.bin files up to this size are cached on local disk,
                                   larger ones are read by ranged GETs (default 256 MiB)
    MEGATRON_SFT_IDX_RETRIES       attempts per request before giving up (default 8)
    MEGATRON_SFT_IDX_CONCURRENCY   parallel requests of get_many() and uploads (default 8)

Credentials and the endpoint are the client's own: the standard AWS variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``
/ ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``) for ``s3://``; the MSC config file
(``MSC_CONFIG`` or ``~/.msc_config.yaml``) for ``msc://``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Optional

from ..errors import ShardError

MIB = 1 << 20
ENV_PREFIX = "MEGATRON_SFT_IDX_"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def default_cache_dir() -> str:
    """The per-user default for the index cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_sft_idx")


def parse_size(text, name: str = "size") -> int:
    """Bytes from ``"4194304"``, ``"4M"``, ``"512K"``, ``"1G"``, ``"4MiB"``. Raises ShardError."""
    raw = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in _UNITS and raw[-1:] else ""
    try:
        value = int(float(raw[: len(raw) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise ShardError("not a size", field=name, actual=text, expected="e.g. 4194304, 4M, 512K") from None
    return value


@dataclass(frozen=True)
class StorageConfig:
    """Settings of the remote read path (pickled with a remote reader into every worker).

    Attributes:
        cache_dir: directory of the per-node index cache (None: env, else the per-user default).
        block_size: bytes of ``.bin`` fetched per ranged GET; ``.loss.bin`` blocks cover the
            same tokens (``block_size / itemsize`` bytes), so a pack that fits one ``.bin``
            block costs one request per data file.
        cache_blocks: blocks kept in memory per data file, per process (LRU).
        seq_bin_limit: ``.seq.bin`` up to this size is cached on disk like the indexes.
        retries: attempts per request (throttling, resets, 5xx) before a RemoteStorageError.
        backoff: first retry delay in seconds; doubles per attempt, with jitter.
        backoff_max: ceiling of one delay.
        concurrency: parallel requests of ``get_many`` prefetches and of uploads.
        part_size: multipart upload part size (S3 minimum 5 MiB).
    """

    cache_dir: Optional[str] = None
    block_size: int = 1 * MIB
    cache_blocks: int = 16
    seq_bin_limit: int = 256 * MIB
    retries: int = 8
    backoff: float = 0.05
    backoff_max: float = 5.0
    concurrency: int = 8
    part_size: int = 64 * MIB
    _env_applied: bool = field(default=False, repr=False, compare=False)

    @classmethod
    def resolve(cls, config: Optional["StorageConfig"] = None, **overrides) -> "StorageConfig":
        """``config`` (or the defaults) with the environment applied, then ``overrides``
        (``None`` values are ignored). Raises ShardError for a malformed value."""
        base = config if config is not None else cls()
        if not base._env_applied:
            base = replace(base, **_from_env(base), _env_applied=True)
        explicit = {k: v for k, v in overrides.items() if v is not None}
        out = replace(base, **explicit)
        out._validate()
        return out

    @property
    def cache_root(self) -> str:
        return self.cache_dir or default_cache_dir()

    def _validate(self) -> None:
        if self.block_size < 4096 or self.block_size % 4096:
            raise ShardError("block size must be a positive multiple of 4096 bytes", field="block_size",
                             actual=self.block_size, hint="e.g. MEGATRON_SFT_IDX_BLOCK_SIZE=4M")
        for name in ("cache_blocks", "retries", "concurrency"):
            if getattr(self, name) < 1:
                raise ShardError(f"{name} must be at least 1", field=name, actual=getattr(self, name))
        if self.part_size < 5 * MIB:
            raise ShardError("multipart part size must be at least 5 MiB (the S3 minimum)",
                             field="part_size", actual=self.part_size)


def _from_env(base: StorageConfig) -> dict:
    out = {}
    env = os.environ
    if env.get(ENV_PREFIX + "CACHE") and base.cache_dir is None:
        out["cache_dir"] = env[ENV_PREFIX + "CACHE"]
    sizes = {"BLOCK_SIZE": "block_size", "SEQ_BIN_LIMIT": "seq_bin_limit", "PART_SIZE": "part_size"}
    for var, name in sizes.items():
        if env.get(ENV_PREFIX + var):
            out[name] = parse_size(env[ENV_PREFIX + var], ENV_PREFIX + var)
    counts = {"CACHE_BLOCKS": "cache_blocks", "RETRIES": "retries", "CONCURRENCY": "concurrency"}
    for var, name in counts.items():
        if env.get(ENV_PREFIX + var):
            try:
                out[name] = int(env[ENV_PREFIX + var])
            except ValueError:
                raise ShardError("not an integer", field=ENV_PREFIX + var, actual=env[ENV_PREFIX + var]) from None
    return out


__all__ = ["StorageConfig", "default_cache_dir", "parse_size", "MIB"]
