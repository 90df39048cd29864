"""Object-storage URLs: ``s3://bucket/key`` and ``msc://profile/path``.

The one place a path is told from a URL (:func:`is_remote`), a URL parsed (:class:`ObjectURL`),
resolved against another (:func:`join_url`), or refused where a command takes only local paths
(:func:`local_only`). Pure string work: nothing here imports a client, so the local read path
can ask :func:`is_remote` for free.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

from ..errors import ShardError

__all__ = ["SCHEMES", "ObjectURL", "is_remote", "join_url", "local_only"]

SCHEMES = ("s3", "msc")
_PREFIXES = tuple(f"{s}://" for s in SCHEMES)


_LOCAL_ONLY = ("this option takes a local path, not a URL; copy the data to local disk first (shard prefixes, "
               "manifests and outputs may be URLs: docs/TOOLS.md \"URLs\")")


def local_only(options, why: str = _LOCAL_ONLY) -> str:
    """The one-line refusal (``"FLAG VALUE: why"``; ``"VALUE: why"`` for an empty flag) of the
    first ``(flag, value)`` in ``options`` whose value (or one of its values) is an ``s3://`` /
    ``msc://`` URL where a command reads or writes only local files; ``''`` when there is none.
    Each command lists its local-only options (docs/TOOLS.md, "URLs")."""
    for flag, value in options:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if is_remote(v):
                return f"{flag} {v}: {why}" if flag else f"{v}: {why}"
    return ""


def is_remote(path) -> bool:
    """True for an ``s3://`` or ``msc://`` URL (a str or anything ``os.fspath`` accepts)."""
    if isinstance(path, str):
        return path.startswith(_PREFIXES)
    if isinstance(path, os.PathLike):
        text = os.fspath(path)
        return isinstance(text, str) and text.startswith(_PREFIXES)
    return False


@dataclass(frozen=True)
class ObjectURL:
    """One object (or key prefix) in a bucket (``s3``) or an MSC profile (``msc``).

    ``bucket`` is the S3 bucket or the MSC profile name; ``key`` the object key /
    path inside it, without a leading slash.
    """

    scheme: str
    bucket: str
    key: str

    @classmethod
    def parse(cls, url) -> "ObjectURL":
        """Raises ShardError for anything that is not ``s3://bucket/key`` or ``msc://profile/path``."""
        text = os.fspath(url)
        scheme, sep, rest = text.partition("://")
        bucket, _, key = rest.partition("/")
        if not sep or scheme not in SCHEMES or not bucket:
            raise ShardError("not an object-storage URL", path=text, field="url",
                             expected="s3://bucket/key or msc://profile/path")
        return cls(scheme, bucket, key)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    def with_suffix(self, suffix: str) -> "ObjectURL":
        """The object whose key is this key plus ``suffix`` (``.idx``, ``.bin``, ...)."""
        return ObjectURL(self.scheme, self.bucket, self.key + suffix)

    def join(self, name: str) -> "ObjectURL":
        """``name`` (a relative key) under this URL taken as a directory."""
        base = self.key.rstrip("/")
        return ObjectURL(self.scheme, self.bucket, f"{base}/{name}" if base else name)

    @property
    def parent(self) -> "ObjectURL":
        return ObjectURL(self.scheme, self.bucket, self.key.rstrip("/").rpartition("/")[0])

    @property
    def name(self) -> str:
        return self.key.rstrip("/").rpartition("/")[2]

    def has_magic(self) -> bool:
        return any(c in self.key for c in "*?[")

    def matches(self, pattern: "ObjectURL") -> bool:
        """Glob match of the key (``*`` does not cross ``/``), as a shell would on paths."""
        if (self.scheme, self.bucket) != (pattern.scheme, pattern.bucket):
            return False
        ours, theirs = self.key.split("/"), pattern.key.split("/")
        return len(ours) == len(theirs) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(ours, theirs))


def join_url(base: str, relative: str) -> str:
    """``relative`` resolved against the directory of URL ``base`` (an absolute URL is kept)."""
    if is_remote(relative):
        return relative
    return str(ObjectURL.parse(base).parent.join(relative.lstrip("/")))
