"""The one JSON reader of the project, and strict reading of the artifacts it reads back.

Every JSON the package parses -- shard metadata, ``store.json``, receipts, plan and order
metadata, manifests, caches, sidecars, a saved dataset's ``state.json``, and the JSON inside
input records (a JSON Lines line, tool-call ``arguments``, xLAM ``answers``/``tools``) -- becomes
a value in :func:`parse_json`, within named limits: a size, a nesting depth and strict types
(RFC 8259: no ``NaN``/``Infinity``; every number finite as a double; for artifacts, every
integer within int64). Nothing else calls ``json.loads`` (tests/project/test_json_reader.py).
A value beyond the limits is the caller's error class naming the file, never a
``RecursionError``.

The limits, by use (docs/FORMAT.md "Limits", docs/INPUTS.md "Limits"):

* metadata and the artifacts a run reads back: ``MAX_METADATA_LENGTH`` bytes,
  ``MAX_METADATA_DEPTH`` deep, every integer within int64 (manifests: ``MAX_MANIFEST_BYTES``;
  the index cache's receipt: ``RECEIPT_MAX_BYTES``);
* an input record: its size bounded by the reader (``--max-record-bytes``), at most
  :data:`RECORD_MAX_DEPTH` deep, integers of any size (token ids are checked later), and one
  meaning per key: an object that names a key twice is refused (JSON leaves it to the reader
  which one counts; a record is never trained by one reader's choice);
* a JSON string inside a record: :data:`RECORD_JSON_MAX_BYTES`, :data:`RECORD_MAX_DEPTH` deep,
  no key twice in an object;
* a tokenizer's own serialised configuration: :data:`TOKENIZER_MAX_BYTES`.

:class:`Doc` wraps one JSON object of one file; each accessor returns a value only when it has
the expected type and range, and otherwise raises one :class:`~megatron_sft_idx.errors.ShardError`
subclass naming the file and the field (a dotted path such as ``partitions[3]`` or
``splits[0].arrays.pack_loads``). A ``bool`` is never taken for an integer, nor an integer for
a string.

Example::

    doc = Doc(load_json(path), path)
    count = doc.int("sequences", lo=0)          # MetadataError naming path and 'sequences' otherwise
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

from .errors import MetadataError, MetadataLimitError, ShardError
from .format import MAX_METADATA_DEPTH, MAX_METADATA_LENGTH, METADATA_INT_RANGE

_MISSING = object()
HEX = {32: re.compile(r"[0-9a-f]{32}"), 64: re.compile(r"[0-9a-f]{64}")}

#: Containers nested at most this deep in one input record, and in each JSON string a record
#: holds (tool-call ``arguments``, ``tools``, xLAM ``answers``): a chat record with tool calls
#: nests about 7 deep before the arguments begin. Rendering and checking walk a value
#: recursively, so the bound stays well below Python's recursion limit (1000).
RECORD_MAX_DEPTH = 256
#: Bytes of one JSON string inside an input record. A JSON Lines record is itself bounded by
#: ``--max-record-bytes`` (the reader never buffers a longer line); a Parquet or Arrow row is not
#: read line by line, so its JSON strings are bounded here.
RECORD_JSON_MAX_BYTES = 64 << 20
#: A tokenizer's serialised configuration (``tokenizer.json``-sized, vocabulary included).
TOKENIZER_MAX_BYTES = 1 << 30


# --------------------------------------------------------------------------- JSON within limits

#: Longest integer literal that can hold an int64 ("-9223372036854775808"): longer ones are
#: refused by their length, never converted (int() of a long digit string is quadratic).
_MAX_INT_LITERAL = len(str(METADATA_INT_RANGE[0]))


class _OverLimit(Exception):
    """Raised from inside json's number hooks; not a ValueError, so it is never taken for a syntax error."""


class _Duplicate(Exception):
    """Raised from inside the record decoder's object hook: an object names ``key`` twice."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_object(pairs) -> dict:
    """The object of ``pairs`` (the decoder's), refused when a key comes twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen.add(key)
    return obj


def _parse_int(text: str) -> int:
    if len(text) > _MAX_INT_LITERAL:
        raise _OverLimit(f"an integer of {len(text.lstrip('-'))} digits is outside int64")
    value = int(text)
    if not METADATA_INT_RANGE[0] <= value <= METADATA_INT_RANGE[1]:
        raise _OverLimit(f"the integer {value} is outside int64")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _OverLimit(f"the number {text[:40]}{'...' if len(text) > 40 else ''} overflows a double")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON (RFC 8259)")


def _too_deep(obj: Any, limit: int) -> bool:
    """Whether containers nest deeper than ``limit`` (the top-level container is depth 1)."""
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        for child in (value.values() if isinstance(value, dict) else value):
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


#: the decoders :func:`parse_json` reads with, built once (``json.loads`` with hooks builds one a call),
#: by ``(int64, unique keys)``
_DECODERS = {(int64, unique): json.JSONDecoder(parse_int=_parse_int if int64 else None, parse_float=_parse_float,
                                               parse_constant=_refuse_constant,
                                               object_pairs_hook=_unique_object if unique else None)
             for int64 in (True, False) for unique in (True, False)}
_RECORD_DECODER = _DECODERS[False, True]   # (parse_record_json's)


def parse_json(raw: Union[bytes, bytearray, memoryview, str], path: Optional[str] = None, *,
               max_length: int = MAX_METADATA_LENGTH, max_depth: int = MAX_METADATA_DEPTH,
               int64: bool = True, what: str = "metadata", error: Type[ShardError] = MetadataError,
               limit_error: Optional[Type[ShardError]] = MetadataLimitError, hint: Optional[str] = None,
               unique_keys: bool = False) -> Any:
    """``raw`` (UTF-8 bytes, or text) as a JSON value, within the limits (module doc).

    Strict UTF-8 and RFC 8259 JSON (no ``NaN``/``Infinity``); at most ``max_length`` bytes;
    containers nested at most ``max_depth`` deep (a deeper document is refused, however deep:
    never a ``RecursionError``); every number finite as a double and, with ``int64``, every
    integer within int64 -- anywhere in the document; with ``unique_keys``, no object naming a key
    twice (an error whose ``duplicate`` is the key). ``what`` names the document in messages,
    ``path`` the file; ``error`` is raised for bytes that are not JSON and ``limit_error``
    (``error`` when None) for a limit exceeded. With ``unique_keys`` a key given twice in one
    object is refused (``error``, its field the key) instead of keeping the last value: for a
    file a person writes (a mixture), where a repeated key is a mistake.

    Every error carries ``detail`` (the reason alone, for a caller that words its own message);
    a limit error also ``limit``: ``"bytes"``, ``"depth"`` or ``"number"``.

    Raises:
        MetadataError (or ``error``): not UTF-8, or not JSON.
        MetadataLimitError (or ``limit_error``): a limit is exceeded.
    """
    def limit(why: str, kind: str = "number") -> ShardError:
        whose = "the format's limits" if int64 else "its limits"
        err = (limit_error or error)(f"{what} exceeds {whose}: {why}", path=path, field=what, hint=hint)
        err.limit, err.detail = kind, why   # which limit ("bytes", "depth" or "number"), and how
        return err

    if not isinstance(raw, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"JSON text must be str or bytes, not {type(raw).__name__}")
    if isinstance(raw, str):
        size = len(raw) if len(raw) * 4 <= max_length else len(raw.encode("utf-8", "surrogatepass"))
        text, brackets = raw, raw.count("[") + raw.count("{")
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        raw = bytes(raw)
        size, text, brackets = len(raw), None, raw.count(b"[") + raw.count(b"{")
    if size > max_length:
        raise limit(f"{size} bytes, more than {max_length}", "bytes")
    try:
        if text is None:
            text = raw.decode("utf-8")
        if text.startswith("\ufeff"):   # (as json.loads refuses it)
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        obj = _DECODERS[int64, unique_keys].decode(text)
    except _OverLimit as exc:
        raise limit(str(exc)) from None
    except _Duplicate as exc:
        why = f"an object names the key {exc.key!r} twice, so it has no one meaning"
        err = error(f"{what} is not one JSON reading: {why}", path=path, field=exc.key,
                    hint=hint or f"the {what} names a key twice; keep one")
        err.detail, err.duplicate = why, exc.key
        raise err from None
    except RecursionError:
        raise limit(f"containers nested deeper than {max_depth}", "depth") from None
    except (UnicodeDecodeError, ValueError) as exc:
        if hint is None:
            hint = "the .seq.idx metadata block is corrupt or cut short; rebuild the shard" if what == "metadata" \
                else f"the {what} is corrupt or cut short; rewrite it"
        err = error(f"{what} is not valid UTF-8 JSON ({exc.__class__.__name__}: {exc})", path=path, field=what,
                    hint=hint)
        err.detail = str(exc)   # the decoder's own words, for a caller that words its own message
        raise err from None
    # Fast path: fewer brackets in the text than the limit cannot nest deeper than it.
    if brackets > max_depth and _too_deep(obj, max_depth):
        raise limit(f"containers nested deeper than {max_depth}", "depth")
    return obj


def parse_record_json(raw: Union[bytes, str], what: str = "record", max_length: int = RECORD_JSON_MAX_BYTES) -> Any:
    """An input record, or a JSON string inside one, as a value within the record limits:
    at most ``max_length`` bytes and :data:`RECORD_MAX_DEPTH` deep; integers of any size (token
    ids are checked against the vocabulary later; a literal beyond Python's digit limit is not
    JSON), every other number finite.

    An object naming a key twice is refused (``{"role": "user", ..., "role": "assistant"}``
    has no one meaning: JSON decoders differ in which one counts).

    The caller names the record (``file:line``) in its own error, from the error's ``detail``,
    ``limit`` and ``duplicate`` (:func:`parse_json`).

    Raises:
        MetadataLimitError: beyond the limits (catch it before MetadataError).
        MetadataError: not UTF-8 JSON; a key twice in an object (``duplicate``: the key).
    """
    hint = "fix the record, or pass --skip-bad"
    if not isinstance(raw, str) and isinstance(raw, (bytes, bytearray, memoryview)):
        # Bytes decode as json.loads decodes them (a BOM, UTF-16/32; lone surrogates kept), so the
        # record mapping, not the decoder, names a lone surrogate by its field.
        raw = bytes(raw)
        if len(raw) > max_length:
            err = MetadataLimitError(f"{what} exceeds its limits: {len(raw)} bytes, more than {max_length}",
                                     field=what, hint=hint)
            err.limit, err.detail = "bytes", f"{len(raw)} bytes, more than {max_length}"
            raise err
        try:
            # (an object's "{" then a byte other than NUL: json.detect_encoding says UTF-8 there)
            raw = raw.decode("utf-8" if raw[:1] == b"{" and raw[1:2] != b"\0" else json.detect_encoding(raw),
                             "surrogatepass")
        except UnicodeDecodeError as exc:
            err = MetadataError(f"{what} is not valid UTF-8 JSON ({exc})", field=what, hint=hint)
            err.detail = str(exc)
            raise err from None
    if isinstance(raw, str) and len(raw) * 4 <= max_length and not raw.startswith("\ufeff"):
        # The common case without parse_json's generality: a record that parses, within the
        # limits, is the value parse_json returns; anything else goes to parse_json, for its error.
        try:
            obj = _RECORD_DECODER.decode(raw)
        except (_OverLimit, _Duplicate, RecursionError, ValueError):
            obj = None
        else:
            if raw.count("[") + raw.count("{") <= RECORD_MAX_DEPTH or not _too_deep(obj, RECORD_MAX_DEPTH):
                return obj
    return parse_json(raw, None, max_length=max_length, max_depth=RECORD_MAX_DEPTH, int64=False, what=what,
                      hint=hint, unique_keys=True)


def load_json(path: str, error: Type[ShardError] = MetadataError, *, max_length: int = MAX_METADATA_LENGTH,
              what: Optional[str] = None, limit_error: Optional[Type[ShardError]] = None,
              hint: Optional[str] = None) -> Any:
    """The JSON value in the file ``path``, within the metadata limits (or ``max_length`` bytes);
    ``what`` (the file's name by default) and ``hint`` as :func:`parse_json` takes them.

    Raises:
        OSError: the file cannot be read (the caller decides what a missing file means);
        ``error`` (a ShardError): not UTF-8 JSON, or beyond the limits (``limit_error`` for
            those, when given).
    """
    with open(path, "rb") as f:
        raw = f.read(max_length + 1)
    return parse_json(raw, path, max_length=max_length, what=what or os.path.basename(path), error=error,
                      limit_error=limit_error, hint=hint)


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


_RAW_DECODER = json.JSONDecoder()

#: :func:`raw_decode`'s scanner itself (C), for a loop that reads many values: ``scan_value(text,
#: start)`` is ``(value, end)``; it raises StopIteration when no JSON value starts there (or one
#: breaks off at a value), ValueError when one breaks off elsewhere (an unterminated string, a
#: missing delimiter), RecursionError when it nests too deep: a caller catches all three
scan_value = _RAW_DECODER.scan_once


def raw_decode(text: str, start: int = 0) -> Tuple[Any, int]:
    """The JSON value that starts at ``text[start]`` and the index where it ends, for JSON
    embedded in other text (a template's rendering of tool definitions): RFC JSON as
    :meth:`json.JSONDecoder.raw_decode` reads it, with nesting beyond the interpreter's limit
    refused like any other text that is not JSON.

    Raises:
        ValueError: no JSON value starts at ``start``, or it nests too deep.
    """
    try:
        return _RAW_DECODER.raw_decode(text, start)
    except RecursionError:
        raise ValueError(f"JSON at {start} nests too deep") from None
