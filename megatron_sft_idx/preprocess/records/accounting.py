"""Nothing rendered that the source does not hold: tool definitions and tool-call arguments in a
rendering, compared structurally with the record's own (``docs/INPUTS.md``, "Every field accounted for").

The mapping (:mod:`.shapes`) accounts for every key a record gives; this is the converse, run on
every rendering of every record (:func:`.rendering.check_rendered` calls it), not on a sample.
Each tool definition the template wrote as JSON -- an object holding ``"name": NAME`` and a
``parameters`` or ``description`` -- must be held by the record's own definition of ``NAME``
(its ``tools`` / ``functions`` as the record gives them, a JSON string parsed, ``null`` counting
as absent at every depth): every key the rendering shows is one the source has, with the same
value. A template may show less (Mistral's keeps ``name``, ``description``, ``parameters``), never
more: Parquet's struct nulls rendered as ``"altitude": null`` fail here, naming the tool.
Each tool call written as JSON (the call's ``name`` with ``arguments``, or Llama 3.1's
``parameters`` holding values) is compared in order: the n-th call of ``NAME`` shown must have
arguments held by the record's n-th call of ``NAME`` (as the mapping received it, before any
of its work: :attr:`.shapes.Conversation.source_calls`), so kept nulls, an added key, swapped
arguments or a call the record does not make fail here, naming the tool and the argument.

The record's definitions are read here, independently of the mapping (its own null removal, its
own unwrapping), so a mapping that let nulls or another tool's fields through is caught rather
than agreed with. A template that renders definitions in a form that is not JSON gives nothing
to compare (no verdict), as the text check (:func:`.rendering.check_rendered`) covers its names.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

from ...errors import MetadataError
from ...jsondoc import parse_record_json, raw_decode
from .errors import input_error

_TRIES = 4   # object starts tried backwards from a name (the nearest opens a definition)


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def source_definitions(tools) -> Dict[str, List[dict]]:
    """``{name: [definition, ...]}`` of the record's ``tools`` value (a list, one object, or a
    JSON string of either; each bare or wrapped as ``{"type": "function", "function": ...}``),
    as the record holds them (nulls kept: :func:`check_rendered_tools` removes them where it
    must). Anything else gives nothing (the mapping refuses it)."""
    if isinstance(tools, str):
        tools = _parsed(tools)
    tools = tools if isinstance(tools, list) else [tools]
    out: Dict[str, List[dict]] = {}
    for tool in tools:
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tool = tool["function"]
        if isinstance(tool, dict) and isinstance(tool.get("name"), str):
            out.setdefault(tool["name"], []).append(tool)
    return out


@functools.lru_cache(maxsize=256)
def _parsed(text: str):
    """A tools (or arguments) JSON string, parsed once per process (published sets repeat the
    same tools); None when it is not JSON. The value is shared: never changed."""
    try:
        return parse_record_json(text, what="tools")
    except MetadataError:   # (its limits' error too)
        return None


def _decoded(text: str):
    """A call's arguments string, parsed; parsed once more when it holds a JSON string of an
    object (arguments encoded twice, which the mapping accepts: docs/INPUTS.md)."""
    value = _parsed(text)
    if isinstance(value, str):
        inner = _parsed(value)
        if isinstance(inner, dict):
            return inner
    return value


def held(shown, source) -> bool:
    """True when ``shown`` (from a rendering) is held by ``source``: an object's keys are the
    source's, each value held; a list as long, element by element; a scalar equal and of the
    same type (``1`` is not ``true``; the caller's fast path, plain equality of a whole
    definition, lets Python's ``1 == 1.0 == True`` through)."""
    if isinstance(shown, dict):
        return isinstance(source, dict) and all(k in source and held(v, source[k]) for k, v in shown.items())
    if isinstance(shown, list):
        return (isinstance(source, list) and len(shown) == len(source)
                and all(held(a, b) for a, b in zip(shown, source)))
    return type(shown) is type(source) and shown == source


def _object_at(text: str, at: int) -> Tuple[Optional[dict], int, int]:
    """The JSON object that encloses position ``at`` of ``text``, with where it starts and ends,
    trying the nearest object starts before it; ``(None, 0, 0)`` when none decodes."""
    start = at
    for _ in range(_TRIES):
        start = text.rfind("{", 0, start)
        if start < 0:
            break
        try:
            value, end = raw_decode(text, start)
        except ValueError:
            continue
        if end > at and isinstance(value, dict):
            return value, start, end
    return None, 0, 0


# a ``"name": "..."`` key of a JSON object: one scan of the rendering finds every tool's (a JSON
# string cannot hold it unescaped, so none is found inside a string value)
_NAME_KEY = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _named_objects(text: str, names, own: Sequence[Tuple[int, int]]):
    """``(name, start, end)`` of each ``"name": NAME`` key in ``text``, in order, for ``NAME`` in
    ``names`` (written with non-ASCII kept or escaped alike), but not where ``own`` says a
    message's own text was rendered (``(start, end)`` spans: JSON a user pastes is not a call)."""
    for m in _NAME_KEY.finditer(text):
        name = m.group(1)
        if "\\" in name:
            try:
                name = raw_decode(text, m.start(1) - 1)[0]
            except ValueError:
                continue
        if name in names:
            at = m.start()
            if not own or not any(a <= at < b for a, b in own):
                yield name, at, m.end()


def _definition(shown, name: str) -> bool:
    """True when ``shown`` is a tool definition of ``name``, not a call: a call holds ``arguments``,
    or (Llama 3.1's form) ``parameters`` holding argument values rather than a schema."""
    if not isinstance(shown, dict) or shown.get("name") != name or "arguments" in shown:
        return False
    parameters = shown.get("parameters")
    return "description" in shown or (isinstance(parameters, dict) and ("properties" in parameters
                                                                        or "type" in parameters))


def source_arguments(calls) -> Dict[str, list]:
    """``{name: [arguments, ...]}`` of the record's tool calls as it gives them (OpenAI's
    ``{"function": {"name", "arguments"}}``, ShareGPT's ``function_call`` and xLAM's ``answers``
    entries ``{"name", "arguments"}``): each an object, its JSON string, or None, unparsed
    (:func:`_arguments_held` reads them). A call the mapping refuses gives nothing here."""
    out: Dict[str, list] = {}
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.setdefault(fn["name"], []).append(fn.get("arguments"))
    return out


_ENCODE = json.JSONEncoder(ensure_ascii=False).encode
_ENCODE_ASCII = json.JSONEncoder().encode


def _arguments_held(values, source, nulls: bool) -> bool:
    """True when the argument values a rendering shows (``values``; ``nulls``: its text shows a
    ``null``) are held by the record's (``source``: an object, its JSON string, or None), ``null``
    counting as absent at every depth. Fast paths, each exact: the source string is the
    rendering's values encoded (as producers and ``tojson`` write them) and holds no null; or no
    null is shown, so the source's own nulls cannot matter."""
    if isinstance(source, str):
        if "null" not in source and (_ENCODE(values) == source or _ENCODE_ASCII(values) == source):
            return True
        source = _decoded(source)
    if source is None:
        source = {}
    if not nulls:   # nothing shown is null: the source's nulls are never compared
        return held(values, source)
    return held(values, _without_nulls(source))


_NO_CALL = object()


def _call_values(shown, name: str):
    """The argument values of ``shown`` when it is a call of ``name`` (``arguments``, or Llama
    3.1's ``parameters``; arguments written as a JSON string parsed), else ``_NO_CALL``."""
    if not isinstance(shown, dict) or shown.get("name") != name:
        return _NO_CALL
    values = shown["arguments"] if "arguments" in shown else shown.get("parameters", _NO_CALL)
    if isinstance(values, str):   # a JSON string (a template that tojson's the string form)
        try:
            parsed, end = raw_decode(values, 0)
        except ValueError:
            return _NO_CALL   # not JSON: the text check covers its keys and values
        return parsed if end == len(values) else _NO_CALL
    return values


def check_rendered_tools(text: str, tools, path: str, line: int, calls=(),
                         own: Sequence[Tuple[int, int]] = ()) -> None:
    """Every tool definition ``text`` shows as JSON is held by the record's own (``tools``: the
    record's value, as given), and the n-th call of a tool it shows as JSON has arguments held by
    the record's n-th call of that tool (``calls``: each as the record gives it), so a call the
    record does not make, a key or value it does not hold, or two calls' arguments swapped is
    refused. ``own``: ``(start, end)`` spans of ``text`` where a message's own text (a user's,
    a tool result's, a reply's content) was rendered: JSON there is the message's, not a
    definition or call the template wrote, and is not read as one.

    Raises:
        InputError: a definition or call arguments with a key or value the record does not hold
            (``rendered_not_in_source``), naming the tool and the key.
    """
    if not tools and not calls:
        return
    definitions = source_definitions(tools) if tools else {}
    arguments = source_arguments(calls) if calls else {}
    shown_calls: Dict[str, int] = {}   # calls of each tool shown so far
    for name, at, after in _named_objects(text, definitions.keys() | arguments.keys(), own):
        defs, args = definitions.get(name), arguments.get(name)
        if at and text.startswith("{", at - 1):   # a call's exact text first: no decoding, no walk (_call_as_written)
            if args and _call_as_written(text, after, args, shown_calls.get(name, 0)):
                shown_calls[name] = shown_calls.get(name, 0) + 1
                continue
        shown, start, end = _object_at(text, at)
        nulls = text.find("null", start, end) >= 0
        if _definition(shown, name):
            if defs and not nulls and shown in defs:
                continue   # the common case, compared in C: as the record holds it, and no null shown
            if "description" in shown or not args or (defs and any(held(shown, _without_nulls(d)) for d in defs)):
                if defs:   # (else Llama's call form, below)
                    _check_definition(shown, nulls, defs, name, path, line)
                continue
        values = _call_values(shown, name) if args is not None else _NO_CALL
        if values is _NO_CALL:
            continue   # not a call as JSON (or the record makes none of it: the text check's)
        n = shown_calls[name] = shown_calls.get(name, 0) + 1
        if n > len(args) or not _arguments_held(values, args[n - 1], nulls):
            source = _without_nulls(_decoded(args[n - 1]) if isinstance(args[n - 1], str) else args[n - 1]) \
                if n <= len(args) else None
            extra = (next((k for k in values if not isinstance(source, dict) or k not in source
                           or not held(values[k], source[k])), None) if isinstance(values, dict) else None)
            raise input_error(f"the rendering shows call {n} of tool '{name}' with "
                              f"{'argument ' + repr(extra) + ' as' if extra else 'arguments'} the record's "
                              "call does not hold", path, line,
                              field=f"tool_calls.{name}.arguments" + (f".{extra}" if extra else ""),
                              reason="rendered_not_in_source",
                              hint="the template (or the mapping) changed the call's arguments; report "
                                   "it, or pass --skip-bad to skip and count such records")


def _call_as_written(text: str, after: int, args: list, shown: int) -> bool:
    """True when the call whose ``"name": NAME`` ends at ``after`` goes on, character for
    character, as ``, "arguments": A}`` with ``A`` the record's next call of ``NAME``'s arguments
    as given (its JSON string, or its object as JSON writes it) holding no null: the object
    decodes to that name and those arguments, so they are held."""
    if shown >= len(args) or not text.startswith(', "arguments": ', after):
        return False
    source = args[shown]
    if isinstance(source, dict):
        source = _ENCODE(source)
    elif not isinstance(source, str):
        return False
    at = after + 15
    return "null" not in source and text.startswith(source, at) and text.startswith("}", at + len(source))


def _check_definition(shown: dict, nulls: bool, defs: List[dict], name: str, path: str, line: int) -> None:
    if not nulls and any(shown == d for d in defs):
        return   # the common case, in C: as the record holds it, and no null shown
    if not any(held(shown, _without_nulls(d)) for d in defs):
        clean = [_without_nulls(d) for d in defs]
        extra = next((k for k in shown if all(k not in d or not held(shown[k], d[k]) for d in clean)), None)
        raise input_error(f"the rendering shows tool '{name}' with "
                          f"{repr(extra) + ' as' if extra else 'what'} the record does not hold",
                          path, line, field=f"tools.{name}" + (f".{extra}" if extra else ""),
                          reason="rendered_not_in_source",
                          hint="the template (or the mapping) added to the tool definition; "
                               "report it, or pass --skip-bad to skip and count such records")
