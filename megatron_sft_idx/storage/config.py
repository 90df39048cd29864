"""How remote shards are read: cache directory, block size, memory, retries, deadlines.

Every field has an environment variable, so a training launcher can set it for every
rank and DataLoader worker without touching code; an explicit argument wins over the
environment, which wins over the default::

    MEGATRON_SFT_IDX_CACHE         directory of the per-node index cache (and, under
                                   tokenizers/, of the shipped tokenizers' copies)
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
    MEGATRON_SFT_IDX_PART_SIZE     multipart upload part size (default 64M; at least 5M)
    MEGATRON_SFT_IDX_REQUEST_TIMEOUT    seconds one request (one attempt: connect, headers and
                                   body) may take, plus its bytes at MIN_THROUGHPUT (default 20)
    MEGATRON_SFT_IDX_OPERATION_TIMEOUT  seconds one operation (a read, a download, a listing, an
                                   upload: every attempt and pause) may take, plus its bytes at
                                   MIN_THROUGHPUT (default 300)
    MEGATRON_SFT_IDX_MIN_THROUGHPUT bytes per second a transfer is allowed at least (default 1M)
    MEGATRON_SFT_IDX_MAX_LIST_PAGES pages (1000 keys each) one listing may take (default 10000)
    MEGATRON_SFT_IDX_COPY_LIMIT    objects up to this size are copied server-side by one request,
                                   larger ones part by part (default 5G, S3's single-copy limit)
    MEGATRON_SFT_IDX_LEASE_SECONDS how long a lock in object storage holds without a renewal
                                   (default 60; renewed every third of it): a killed holder's
                                   lock is taken over once its lease has run out. At least
                                   1.5 x the request timeout and 1 s, checked when a lock is
                                   taken (:meth:`StorageConfig.lease_floor`)

The deadlines are wall-clock (docs/STORAGE.md): a server that stalls, or trickles a
response a byte at a time, ends in a RemoteTimeoutError within them.

Credentials and the endpoint are the client's own: the standard AWS variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``
/ ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``) for ``s3://``; the MSC config file
(``MSC_CONFIG`` or ``~/.msc_config.yaml``) for ``msc://``.
"""

from __future__ import annotations

import math
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


#: What each setting may be, by field: ``(kind, least, most)``; kind ``size`` (bytes, K/M/G
#: suffixes), ``count`` (a whole number) or ``seconds`` (a positive finite number). A value
#: outside the range -- ``inf``, ``nan``, ``1e999``, a negative or absurd number -- is refused in
#: one line naming the variable (or the argument), never an ``OverflowError``.
RANGES = {
    "block_size": ("size", 4096, 1 << 30),
    "seq_bin_limit": ("size", 0, 1 << 50),
    "part_size": ("size", 5 * MIB, 5 << 30),          # S3's bounds on a multipart part
    "min_throughput": ("size", 1, 1 << 40),
    "cache_blocks": ("count", 1, 1 << 20),
    "retries": ("count", 1, 1000),
    "concurrency": ("count", 1, 1024),
    "max_list_pages": ("count", 1, 1 << 30),
    "request_timeout": ("seconds", 0, 30 * 86400),
    "operation_timeout": ("seconds", 0, 30 * 86400),
    "copy_limit": ("size", 5 * MIB, 5 << 30),         # S3's bounds on one CopyObject / UploadPartCopy
    "lease_seconds": ("seconds", 0, 86400),
}
#: The environment variable of each setting (module doc).
ENV_VARS = {"BLOCK_SIZE": "block_size", "SEQ_BIN_LIMIT": "seq_bin_limit", "PART_SIZE": "part_size",
            "MIN_THROUGHPUT": "min_throughput", "CACHE_BLOCKS": "cache_blocks", "RETRIES": "retries",
            "CONCURRENCY": "concurrency", "MAX_LIST_PAGES": "max_list_pages",
            "REQUEST_TIMEOUT": "request_timeout", "OPERATION_TIMEOUT": "operation_timeout",
            "COPY_LIMIT": "copy_limit", "LEASE_SECONDS": "lease_seconds"}
_EXAMPLES = {"size": "e.g. 4194304, 4M, 512K", "count": "a whole number, e.g. 8", "seconds": "e.g. 20 or 2.5"}
#: The shortest lease whatever the request timeout: a lease renews every third of itself, so a
#: shorter one would put several renewals a second on the store.
LEASE_MIN_SECONDS = 1.0


def parse_size(text, name: str = "size") -> int:
    """Bytes from ``"4194304"``, ``"4M"``, ``"512K"``, ``"1G"``, ``"4MiB"``.

    Raises:
        ShardError: naming ``name``: not a finite, non-negative number of bytes.
    """
    raw = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in _UNITS and raw[-1:] else ""
    try:
        number = float(raw[: len(raw) - len(unit)])
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0 or number * _UNITS[unit] >= 1 << 62:
        raise ShardError(f"{name} is not a size in bytes", field=name, actual=text,
                         expected=_EXAMPLES["size"]) from None
    return int(number * _UNITS[unit])


def _setting(name: str, value, field: str):
    """``value`` of the setting ``name`` when it is of its kind and in its range (:data:`RANGES`).

    Raises:
        ShardError: naming ``field`` (the variable or the argument), in one line.
    """
    kind, least, most = RANGES[name]
    if isinstance(value, str):
        text = value
        if kind == "size":
            value = parse_size(text, field)
        else:
            try:
                value = int(text) if kind == "count" else float(text)
            except ValueError:
                raise ShardError(f"{field} is not {'a whole number' if kind == 'count' else 'a number of seconds'}",
                                 field=field, actual=text, expected=_EXAMPLES[kind]) from None
    ok = not isinstance(value, bool) and (isinstance(value, int) or (kind == "seconds" and isinstance(value, float)
                                                                    and math.isfinite(value))) \
        and least <= value <= most and (kind != "seconds" or value > least)
    if not ok:
        bound = f"a positive number of seconds, at most {most}" if kind == "seconds" \
            else f"at least {least} and at most {most}"
        raise ShardError(f"{field} must be {bound}", field=field, actual=value,
                         expected=f"{least}..{most}", hint=f"{_EXAMPLES[kind]}; see docs/STORAGE.md")
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
        request_timeout: seconds one request may take, plus its bytes at ``min_throughput``
            (:meth:`request_seconds`); also the socket connect and read timeouts.
        operation_timeout: seconds one operation may take with all its attempts and pauses,
            plus its bytes at ``min_throughput`` (:meth:`operation_seconds`).
        min_throughput: bytes per second a transfer is allowed at least.
        max_list_pages: pages one listing may take before it is refused.
        copy_limit: a server-side copy of an object up to this size is one request; a larger
            one is copied in parts of ``part_size`` (S3 copies at most 5 GiB in one request).
        lease_seconds: the lease of a lock held in object storage (:mod:`.lease`).
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
    request_timeout: float = 20.0
    operation_timeout: float = 300.0
    min_throughput: int = 1 * MIB
    max_list_pages: int = 10_000
    copy_limit: int = 5 << 30
    lease_seconds: float = 60.0
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

    def request_seconds(self, nbytes: int = 0) -> float:
        """Wall-clock budget of one request moving ``nbytes`` (sent or received)."""
        return self.request_timeout + max(0, nbytes) / self.min_throughput

    def operation_seconds(self, nbytes: int = 0) -> float:
        """Wall-clock budget of one operation moving ``nbytes`` in all: every attempt and pause."""
        return self.operation_timeout + max(0, nbytes) / self.min_throughput

    def lease_floor(self) -> float:
        """The shortest ``lease_seconds`` a renewal can keep alive: the heartbeat renews a third
        into the lease, and that renewal -- one request, within ``request_timeout`` -- must land
        in the two thirds left (and never below :data:`LEASE_MIN_SECONDS`)."""
        return max(LEASE_MIN_SECONDS, 1.5 * self.request_timeout)

    def check_lease(self) -> None:
        """What a lock checks before it is taken (:class:`~.lease.ObjectLock`): the lease is at
        least :meth:`lease_floor`. (Checked there, not here: a run that takes no lock may raise the
        request timeout without the lease.)

        Raises:
            ShardError: naming the variable, the floor and why, in one line."""
        floor = self.lease_floor()
        if self.lease_seconds < floor:
            raise ShardError(f"{ENV_PREFIX}LEASE_SECONDS (lease_seconds) {self.lease_seconds:g} s is below the floor "
                             f"of {floor:g} s: a lock's lease is renewed a third into it, and the renewal (one "
                             f"request, up to {ENV_PREFIX}REQUEST_TIMEOUT = {self.request_timeout:g} s) must land "
                             "before the lease ends", field="lease_seconds", actual=self.lease_seconds,
                             expected=f">= {floor:g}", hint=f"raise {ENV_PREFIX}LEASE_SECONDS (default 60), or lower "
                                                            f"{ENV_PREFIX}REQUEST_TIMEOUT; see docs/STORAGE.md")

    def _validate(self) -> None:
        for name in RANGES:
            _setting(name, getattr(self, name), name)
        if self.block_size % 4096:
            raise ShardError("block size must be a positive multiple of 4096 bytes", field="block_size",
                             actual=self.block_size, hint="e.g. MEGATRON_SFT_IDX_BLOCK_SIZE=4M")


def _from_env(base: StorageConfig) -> dict:
    out = {}
    env = os.environ
    if env.get(ENV_PREFIX + "CACHE") and base.cache_dir is None:
        out["cache_dir"] = env[ENV_PREFIX + "CACHE"]
    for var, name in ENV_VARS.items():
        if env.get(ENV_PREFIX + var):
            out[name] = _setting(name, env[ENV_PREFIX + var], ENV_PREFIX + var)
    return out


__all__ = ["StorageConfig", "default_cache_dir", "parse_size", "MIB", "RANGES", "ENV_VARS", "LEASE_MIN_SECONDS"]
