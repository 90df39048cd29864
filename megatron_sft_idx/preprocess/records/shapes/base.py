"""What every shape's mapping shares: values read as text (a lone surrogate refused), absent
values (``None`` and empty ones), nulls dropped from JSON values, turns, inline reasoning split."""

from __future__ import annotations

import json
from typing import Optional, Tuple

from ..errors import input_error


def present(value) -> bool:
    """Whether ``value`` is given: not ``None``, ``""``, ``[]`` or ``{}`` (Parquet and Arrow rows
    hold every struct field, so an absent one arrives as one of these)."""
    return value is not None and value != "" and value != [] and value != {}


def holds_text(value) -> bool:
    """True when a non-empty string is anywhere in ``value`` (a key of a nested object too)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if v:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def turns(value, path: str, line: int, key: str) -> list:
    """``value``: a record's non-empty list of turns (messages) under ``key``.

    Raises:
        InputError: not a list (``missing_key``), or empty (``empty_conversation``).
    """
    if not isinstance(value, list):
        raise input_error(f"'{key}' must be a list of turns", path, line, field=key, reason="missing_key")
    if not value:
        raise input_error("empty conversation", path, line, field=key, reason="empty_conversation")
    return value


def split_inline_reasoning(content: str, opening: str, closing: str) -> Optional[Tuple[str, str]]:
    """``(reasoning, answer)`` when ``content`` opens (after whitespace) with ``opening`` and closes
    it; else None. The answer loses the whitespace that follows ``closing``."""
    stripped = content.lstrip()
    if not stripped.startswith(opening):
        return None
    end = stripped.find(closing, len(opening))
    if end < 0:
        return None
    return stripped[len(opening):end], stripped[end + len(closing):].lstrip()


def check_text(value: str, path: str, line: int, where: str) -> str:
    """``value``, refused if it holds a lone surrogate (not encodable as UTF-8, so a tokenizer
    would raise on it)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise input_error(f"'{where}' holds a lone UTF-16 surrogate {value[exc.start]!r} at character "
                              f"{exc.start}", path, line, field=where, reason="invalid_unicode",
                              hint="the text is not valid Unicode; fix the producer or pass --skip-bad") from None
    return value


def check_json_texts(value, path: str, line: int, where: str, text: Optional[str] = None) -> None:
    """Every string (key or value) inside a JSON value passes :func:`check_text` (one C-level
    serialisation proves it for the whole value; only a failure walks it to name the text).
    ``text``: that serialisation when the caller has it, of ``value`` or of a value ``value``
    was made from by removing entries (what holds for it holds for ``value``)."""
    try:
        (json.dumps(value, ensure_ascii=False) if text is None else text).encode("utf-8")
        return
    except (UnicodeEncodeError, TypeError, ValueError):
        pass
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            check_text(v, path, line, where)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def surrogate_free(raw) -> bool:
    """True when no string decoded from the JSON Lines record ``raw`` (bytes, as read) can hold a
    lone surrogate, at any depth of JSON strings inside it: its bytes are read as UTF-8 (an
    object's ``{`` then no NUL: :func:`~megatron_sft_idx.jsondoc.parse_record_json`) and hold no
    0xED byte (a surrogate's UTF-8 lead byte, which ``surrogatepass`` would let through) and no
    ``\\u`` at all. Not only ``\\ud``: a JSON string inside the record, decoded again, can spell
    an escape whose backslash, ``u`` or ``d`` is itself an escape (``\\u005Cud800``,
    ``\\\\\\u0075d800``); every such spelling, at every depth, leaves a backslash before a ``u`` in
    the record's bytes. Then :func:`check_json_texts` has nothing to find and is not made;
    anything else is checked as before (a false alarm costs only the check)."""
    return type(raw) is bytes and raw[:1] == b"{" and raw[1:2] != b"\0" and b"\xed" not in raw and b"\\u" not in raw


def may_hold_null(value) -> Tuple[bool, Optional[str]]:
    """``(may hold null, serialisation)``: False when ``value`` certainly holds no ``None`` (its
    one C-level serialisation has no ``null``), so :func:`drop_nulls` need not walk it; the
    serialisation (None when there is none) is handed to :func:`check_json_texts`, which needs
    the same one."""
    try:
        text = json.dumps(value, ensure_ascii=False, check_circular=False)
    except (TypeError, ValueError):
        return True, None
    return "null" in text, text


def drop_nulls(value):
    """``value`` without the ``null`` entries of its objects, at every depth (null counts as absent:
    Parquet, Arrow and ``save_to_disk`` unify a column's struct type across rows, so every tool
    definition would arrive with every other tool's parameter names set to null). Returns ``value``
    itself when it holds none."""
    if isinstance(value, dict):
        out = {k: drop_nulls(v) for k, v in value.items() if v is not None}
        return value if len(out) == len(value) and all(out[k] is value[k] for k in out) else out
    if isinstance(value, list):
        out = [drop_nulls(v) for v in value]
        return value if all(a is b for a, b in zip(out, value)) else out
    return value
