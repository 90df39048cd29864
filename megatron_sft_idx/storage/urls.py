"""Object-storage URLs: ``s3://bucket/key`` and ``msc://profile/path``.

The one place a path is told from a URL (:func:`is_remote`), a URL parsed (:class:`ObjectURL`),
resolved against another (:func:`join_url`), refused where a command takes only local paths
(:func:`local_only`), or refused for levels that are no names (:func:`url_problem`,
:func:`check_url`, :func:`url_refusal`). Pure string work: nothing here imports a client, so the
local read path can ask :func:`is_remote` for free.

Object keys are literal: ``s3://b/st/..`` is the key ``st/..``, not the prefix ``s3://b``. A run
makes local names from URLs (a mirror's tree, a staged output's name, a tokenizer's copy), so an
empty, ``.`` or ``..`` level in a URL a run writes or mirrors -- and a store or work directory at
a bucket's root, which would list and write among every object of the bucket -- is refused before
any work, in one line naming the option (docs/STORAGE.md, "URLs a run refuses"). A local name
made from a URL is one plain level (:func:`plain_name`).
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

from ..errors import ShardError

__all__ = ["SCHEMES", "ObjectURL", "is_remote", "join_url", "local_only", "url_problem", "check_url",
           "url_refusal", "plain_name"]

SCHEMES = ("s3", "msc")
_PREFIXES = tuple(f"{s}://" for s in SCHEMES)


def local_only(options) -> str:
    """The one-line refusal of the first ``(flag, value)`` in ``options`` whose value (or one of
    its values) is an ``s3://`` / ``msc://`` URL where a command reads or writes only local
    files; ``''`` when there is none. Each command lists its local-only options (docs/TOOLS.md,
    "URLs")."""
    for flag, value in options:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if is_remote(v):
                return (f"{flag} {v}: this option takes a local path, not a URL; copy the data to local "
                        "disk first (shard prefixes, manifests and outputs may be URLs: docs/TOOLS.md \"URLs\")")
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


#: Levels of a URL that name no object level: a key is literal, a local path is not.
_NO_NAMES = ("", ".", "..")


def url_problem(url, root: bool = True) -> str:
    """Why ``url`` cannot be used where a run reads, writes or mirrors it (``''``: it can): an
    empty, ``.`` or ``..`` level of its key (one ``/`` ending it, a prefix, excepted) or bucket,
    a NUL anywhere; with ``root=False`` also an empty key (the bucket's root)."""
    text = os.fspath(url)
    try:
        parsed = ObjectURL.parse(text)
    except ShardError:
        return "not an s3://bucket/key or msc://profile/path URL"
    if "\0" in text:
        return "a NUL character, which no object key or local name holds"
    if parsed.bucket in (".", ".."):
        return f"a bucket or profile named {parsed.bucket!r}"
    key = parsed.key[:-1] if parsed.key.endswith("/") else parsed.key
    if not key:
        if root:
            return ""
        return ("the bucket's root: a store or work directory there would list and write among every object of "
                "the bucket; give a prefix of its own (s3://BUCKET/NAME)")
    for level in key.split("/"):
        if level in _NO_NAMES:
            what = "an empty level (//)" if not level else f"a {level!r} level"
            return (f"{what}: object keys are literal ({parsed.scheme}://{parsed.bucket}/{parsed.key} is the key "
                    f"{parsed.key!r}, not a path), so it names no place a run can mirror or write; name the prefix "
                    "itself")
    return ""


def check_url(url, what: str, root: bool = True) -> str:
    """``url`` (its text) when :func:`url_problem` finds nothing; ``what`` names it (``--store``).

    Raises:
        ShardError: naming ``url`` and ``what``, in one line."""
    problem = url_problem(url, root)
    if problem:
        raise ShardError(f"{what}: {problem}", path=os.fspath(url), field=what)
    return os.fspath(url)


def url_refusal(options) -> str:
    """The one-line refusal of the first ``(flag, value, root)`` in ``options`` whose value (or one
    of its values) is a URL :func:`url_problem` refuses (``root``: whether the bucket's root is
    allowed there); ``''`` when there is none. Local paths and empty values pass."""
    for flag, value, root in options:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v and is_remote(v):
                problem = url_problem(v, root)
                if problem:
                    return f"{flag} {v}: {problem}"
    return ""


def plain_name(name: str, what: str) -> str:
    """``name`` when it is one plain level of a local path (not empty, ``.`` or ``..``; no
    separator, no NUL): what a local name made from a URL must be.

    Raises:
        ShardError: naming ``what``."""
    if name in _NO_NAMES or "/" in name or os.sep in name or (os.altsep and os.altsep in name) or "\0" in name:
        raise ShardError(f"{what}: {name!r} is no name for a local file or directory", field=what, actual=name,
                         hint="name the object or prefix by a plain last level")
    return name
