"""Strict reading of the JSON artifacts the pipeline reads back: ``store.json``, receipts, plan metadata.

A run trusts nothing it reads back. :class:`Doc` wraps one JSON object of one file; each
accessor returns a value only when it has the expected type and range, and otherwise raises
one :class:`~megatron_sft_idx.errors.ShardError` subclass naming the file and the field (a
dotted path such as ``partitions[3]`` or ``splits[0].arrays.pack_loads``). A ``bool`` is never
taken for an integer, nor an integer for a string. The JSON itself is parsed within the
format's limits (:func:`megatron_sft_idx.metadata.parse_json`: size, nesting depth, int64).

Example::

    doc = Doc(load_json(path), path)
    count = doc.int("sequences", lo=0)          # MetadataError naming path and 'sequences' otherwise
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Type

from .errors import MetadataError, ShardError
from .format import MAX_METADATA_LENGTH
from .metadata import parse_json

_MISSING = object()
HEX = {32: re.compile(r"[0-9a-f]{32}"), 64: re.compile(r"[0-9a-f]{64}")}


def load_json(path: str, error: Type[ShardError] = MetadataError) -> Any:
    """The JSON value in the file ``path``, within the metadata limits.

    Raises:
        OSError: the file cannot be read (the caller decides what a missing file means);
        ``error`` (a ShardError): not UTF-8 JSON, or beyond the limits.
    """
    with open(path, "rb") as f:
        raw = f.read(MAX_METADATA_LENGTH + 1)
    try:
        return parse_json(raw, path)
    except ShardError as exc:
        raise error(exc.message, path=path, field=exc.field or "json") from None


def normal_json(obj) -> Any:
    """``obj`` as JSON reads it back (tuples as lists, keys sorted): what two artifacts are compared by."""
    return json.loads(json.dumps(obj, sort_keys=True))


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value, path: str, field: str, lo: Optional[int] = None, hi: Optional[int] = None,
              error: Type[ShardError] = MetadataError) -> int:
    """``value`` when it is an integer in ``[lo, hi]``.

    Raises:
        ``error``: not an integer, or out of range (naming ``path`` and ``field``).
    """
    if not is_int(value):
        raise error("must be an integer", path=path, field=field, expected="integer", actual=_show(value))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise error("is out of range", path=path, field=field,
                    expected=f"{'' if lo is None else lo}..{'' if hi is None else hi}", actual=value)
    return value


def _show(value):
    """A value as an error shows it: short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Doc:
    """One JSON object of the artifact ``path``, at ``where`` inside it (``""``: the top).

    Raises:
        ``error``: ``obj`` is not a JSON object.
    """

    def __init__(self, obj, path: str, where: str = "", error: Type[ShardError] = MetadataError) -> None:
        self.path, self.where, self.error = path, where, error
        if not isinstance(obj, dict):
            raise error("must be a JSON object", path=path, field=where or "(top level)",
                        expected="object", actual=type(obj).__name__)
        self.obj = obj

    def field(self, key) -> str:
        inner = f"[{key}]" if isinstance(key, int) else str(key)
        if not self.where:
            return inner
        return self.where + (inner if isinstance(key, int) else "." + inner)

    def fail(self, message: str, key=None, **kw) -> ShardError:
        return self.error(message, path=self.path, field=self.field(key) if key is not None else self.where, **kw)

    def raw(self, key: str, default=_MISSING):
        if key not in self.obj:
            if default is not _MISSING:
                return default
            raise self.fail("is missing", key)
        return self.obj[key]

    def int(self, key: str, lo: Optional[int] = None, hi: Optional[int] = None, none: bool = False,
            default=_MISSING) -> Optional[int]:
        value = self.raw(key, default)
        if value is None and (none or default is None):
            return None
        return check_int(value, self.path, self.field(key), lo, hi, self.error)

    def number(self, key: str, lo: float, hi: float) -> float:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise self.fail("must be a number in range", key, expected=f"{lo}..{hi}", actual=_show(value))
        return value

    def str(self, key: str, choices: Optional[Sequence[str]] = None, pattern: Optional[re.Pattern] = None,
            none: bool = False, default=_MISSING) -> Optional[str]:
        value = self.raw(key, default)
        if value is None and (none or default is None):
            return None
        if not isinstance(value, str):
            raise self.fail("must be a string", key, expected="string", actual=_show(value))
        if choices is not None and value not in choices:
            raise self.fail("is not one of the known values", key, expected=list(choices), actual=_show(value))
        if pattern is not None and not pattern.fullmatch(value):
            raise self.fail("is malformed", key, expected=pattern.pattern, actual=_show(value))
        return value

    def bool(self, key: str, default=_MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.fail("must be true or false", key, expected="boolean", actual=_show(value))
        return value

    def doc(self, key: str, none: bool = False) -> Optional["Doc"]:
        value = self.raw(key)
        if value is None and none:
            return None
        return Doc(value, self.path, self.field(key), self.error)

    def list(self, key: str, length: Optional[int] = None, none: bool = False, default=_MISSING) -> Optional[List]:
        value = self.raw(key, default)
        if value is None and (none or default is None):
            return None
        if not isinstance(value, list):
            raise self.fail("must be a list", key, expected="list", actual=_show(value))
        if length is not None and len(value) != length:
            raise self.fail("has the wrong length", key, expected=length, actual=len(value))
        return value

    def docs(self, key: str) -> List["Doc"]:
        """A list of JSON objects."""
        return [Doc(item, self.path, f"{self.field(key)}[{i}]", self.error) for i, item in enumerate(self.list(key))]

    def mapping(self, key: str, check: Callable[[Any, str], Any], default=_MISSING) -> Dict[str, Any]:
        """An object whose values each pass ``check(value, field)`` (which raises, or returns the value)."""
        value = self.raw(key, default)
        if not isinstance(value, dict):
            raise self.fail("must be a JSON object", key, expected="object", actual=_show(value))
        return {k: check(v, f"{self.field(key)}.{k}") for k, v in value.items()}

    def ints(self, key: str, lo: Optional[int] = None, hi: Optional[int] = None, default=_MISSING) -> Dict[str, int]:
        """An object of integers in ``[lo, hi]``, e.g. counts by reason."""
        return self.mapping(key, lambda v, f: check_int(v, self.path, f, lo, hi, self.error), default)

    def strs(self, key: str, default=_MISSING) -> Dict[str, str]:
        def check(value, field):
            if not isinstance(value, str):
                raise self.error("must be a string", path=self.path, field=field, actual=_show(value))
            return value
        return self.mapping(key, check, default)
