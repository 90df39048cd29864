"""Nothing rendered that the source does not hold: tool definitions and tool-call arguments in a
rendering, compared structurally with the record's own (``docs/INPUTS.md``, "Every field accounted for").

The mapping (:mod:`.shapes`) accounts for every key a record gives; this is the converse, run on
every rendering of every record (:func:`.rendering.check_rendered` calls it, or queues it for
the encoder to make every few records in one loop), not on a sample.
Each tool definition the template wrote as JSON -- an object holding ``"name": NAME`` and a
``parameters`` or ``description`` -- must be held by the record's own definition of ``NAME``
(its ``tools`` / ``functions`` as the record gives them, a JSON string parsed, ``null`` counting
as absent at every depth): every key the rendering shows is one the source has, with the same
value. A template may show less (Mistral's keeps ``name``, ``description``, ``parameters``), never
more: Parquet's struct nulls rendered as ``"altitude": null`` fail here, naming the tool. The
same holds around a definition: one the template writes inside a ``{"type": "function",
"function": ...}`` wrapper must have a wrapper the record's holds (its own wrapper's keys, or the
mapping's ``{"type": "function"}`` around a bare definition) -- a key a template adds beside the
definition is refused as one added inside it is.
Each tool call written as JSON (the call's ``name`` with ``arguments``, or Llama 3.1's
``parameters`` holding values) is compared in order: the n-th call of ``NAME`` shown must have
arguments held by the record's n-th call of ``NAME`` (as the mapping received it, before any
of its work: :attr:`.shapes.Conversation.source_calls`), so kept nulls, an added key, swapped
arguments or a call the record does not make fail here, naming the tool and the argument.

The record's definitions are read here, independently of the mapping (its own null removal, its
own unwrapping), so a mapping that let nulls or another tool's fields through is caught rather
than agreed with. A template that renders definitions in a form that is not JSON gives nothing
to compare (no verdict), as the text check (:func:`.rendering.check_rendered`) covers its names.

It runs on every record, so texts come first: a definition or call found character for character
as the record gives it (an element of a ``tools`` string, a call's arguments string, an object as
``tojson`` writes it), holding no ``null``, is held without decoding anything; a definition read
before (by its tool's name, :data:`_SEEN`, bounded) stands for its value, as public sets draw
every record's tools from one catalogue; only what no text matches is decoded and walked. Each
way gives the full comparison's verdict (``tests/preprocess/test_accounting.py``). Its cost is
measured by ``python -m bench.accounting_cost`` (docs/PREPROCESSING.md, "What accounting costs").
"""

from __future__ import annotations

import functools
import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

from ...errors import MetadataError
from ...jsondoc import RECORD_JSON_MAX_BYTES, parse_record_json, raw_decode, scan_value
from .errors import input_error

_TRIES = 4   # object starts tried backwards from a name (the nearest opens a definition)


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def source_wrappers(tools) -> Dict[str, List[dict]]:
    """``{name: [wrapper, ...]}`` of the record's ``tools`` value (as :func:`source_definitions`
    reads it): each definition's wrapper without its ``function`` (``{"type": "function"}`` for a
    bare definition, which the mapping wraps so)."""
    if isinstance(tools, str):
        tools = _parsed(tools)
    out: Dict[str, List[dict]] = {}
    for tool in (tools if isinstance(tools, list) else (tools,)):
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        wrapper = {k: v for k, v in tool.items() if k != "function" and v is not None} if isinstance(fn, dict) \
            else {"type": "function"}
        name = (fn if isinstance(fn, dict) else tool).get("name")
        if isinstance(name, str):
            out.setdefault(name, []).append(wrapper)
    return out


def source_definitions(tools) -> Tuple[Dict[str, List[dict]], Dict[str, Tuple[str, ...]]]:
    """``({name: [definition, ...]}, {name: (text, ...)})`` of the record's ``tools`` value (a
    list, one object, or a JSON string of either; each bare or wrapped as ``{"type": "function",
    "function": ...}``): the definitions as the record holds them (nulls kept:
    :func:`check_rendered_tools` removes them where it must; anything else gives nothing, the
    mapping refuses it), and, where ``tools`` is a JSON string, the exact text of each bare
    definition in it that holds no ``null`` (a template that ``tojson``'s it writes that text
    again, so it is found without decoding the rendering)."""
    texts: Dict[str, Tuple[str, ...]] = {}
    if isinstance(tools, str):
        elements = _elements(tools)
        if elements is None:
            tools = _parsed(tools)
        else:
            tools = []
            for value, written in elements:
                tools.append(value)
                if type(value) is dict and "null" not in written and "arguments" not in value:
                    name = value.get("name")
                    if type(name) is str:
                        texts[name] = texts[name] + (written,) if name in texts else (written,)
    out: Dict[str, List[dict]] = {}
    for tool in (tools if isinstance(tools, list) else (tools,)):
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        if isinstance(fn, dict):
            tool = fn
        name = tool.get("name")
        if isinstance(name, str):
            if name in out:
                out[name].append(tool)
            else:
                out[name] = [tool]
    return out, texts


_SPACE = re.compile(r"[ \t\n\r]*")   # JSON's whitespace

#: ``{name: ((text, value), ...)}``: JSON objects opening with ``"name": NAME`` lately read, from
#: renderings or ``tools`` strings, with their values: public sets draw each record's tools from
#: a catalogue, so the same definition is read again and again. Bounded (:data:`_SEEN_NAMES` names,
#: :data:`_SEEN_EACH` texts a name, and in characters). A value is a function of its text alone, so no verdict
#: depends on what ran before; the values are shared: never changed.
_SEEN: Dict[str, Tuple[Tuple[str, dict], ...]] = {}
_SEEN_NAMES, _SEEN_EACH = 4096, 4
_SEEN_NAME = 256                # characters of a name remembered; a longer one's objects are never kept
_SEEN_TEXT = 16 << 10           # a longer object is decoded each time, never kept
_SEEN_BUDGET = 4 << 20          # characters of text kept in all (their values take a few times that)
_seen_size = [0]


def _read_object(text: str, start: int, name: str) -> Tuple[Optional[dict], int]:
    """``(value, end)`` of the JSON object at ``start`` of ``text``, which opens with a
    ``"name": NAME`` key: its text read before (:data:`_SEEN`), found character for character,
    else decoded and remembered; ``(None, start)`` when no object decodes there."""
    seen = _SEEN.get(name, ())
    for written, value in seen:
        if text.startswith(written, start):
            return value, start + len(written)
    try:
        value, end = scan_value(text, start)
    except (StopIteration, ValueError, RecursionError):   # (no value there; a broken one; too deep)
        return None, start
    if type(value) is not dict:
        return None, start
    if len(name) <= _SEEN_NAME:
        _remember(name, seen, text, start, end, value)
    return value, end


def _remember(name: str, seen: tuple, text: str, start: int, end: int, value: dict) -> None:
    """Keep ``text[start:end]`` and its value under ``name`` in :data:`_SEEN`, within its bounds
    (emptied whole when one is reached). A name's first object is not kept, only the name: a set
    whose every tool is new costs a key, not a copy."""
    if name not in _SEEN:
        if len(_SEEN) >= _SEEN_NAMES:
            _SEEN.clear()
            _seen_size[0] = 0
        _SEEN[name] = ()
    elif end - start <= _SEEN_TEXT:
        if _seen_size[0] + end - start > _SEEN_BUDGET:
            _SEEN.clear()
            _seen_size[0] = 0
        _SEEN[name] = ((text[start:end], value),) + seen[:_SEEN_EACH - 1]
        _seen_size[0] += end - start


#: characters of a ``tools`` or arguments string kept with its parse (:func:`_parsed`, 256 at
#: most): a longer one is parsed each time it comes
_CACHED_TEXT = 64 << 10


def _elements(text: str) -> Optional[Tuple[Tuple[object, str], ...]]:
    """``((value, exact text), ...)`` of the elements of a JSON array string, read one by one
    (as the decoder reads an array; an object opening with its ``"name"`` through
    :func:`_read_object`, so a definition read before is not decoded again); None when ``text``
    is not one JSON array of at most :data:`~...jsondoc.RECORD_JSON_MAX_BYTES` (the caller parses
    it whole: one object, or not JSON). Not cached whole: a cache of whole strings keeps their
    values alive and the garbage collector then walks them on every record (a whole run's cost
    in the worst case), while the elements are remembered one by one. The values are shared:
    never changed."""
    i = _SPACE.match(text).end()
    if not text.startswith("[", i) or len(text) > RECORD_JSON_MAX_BYTES:
        return None
    out = []
    i = _SPACE.match(text, i + 1).end()
    if text.startswith("]", i):
        return () if _SPACE.match(text, i + 1).end() == len(text) else None
    while True:
        name = text[i + 10:text.find('"', i + 10)] if text.startswith('{"name": "', i) else "\\"
        if "\\" not in name:   # (a name written with an escape is decoded with its object)
            value, end = _read_object(text, i, name)
            if value is None:
                return None
        else:
            try:
                value, end = raw_decode(text, i)
            except ValueError:
                return None
        out.append((value, text[i:end]))
        i = _SPACE.match(text, end).end()
        if text.startswith(",", i):
            i = _SPACE.match(text, i + 1).end()
        elif text.startswith("]", i) and _SPACE.match(text, i + 1).end() == len(text):
            return tuple(out)
        else:
            return None


def _parsed(text: str):
    """A tools (or arguments) JSON string, parsed (once per process for a short one: published
    sets repeat the same tools); None when it is not JSON. The value is shared: never changed."""
    return _parsed_kept(text) if len(text) <= _CACHED_TEXT else _parse(text)


def _parse(text: str):
    try:
        return parse_record_json(text, what="tools")
    except MetadataError:   # (its limits' error too)
        return None


_parsed_kept = functools.lru_cache(maxsize=256)(_parse)


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
# string cannot hold it unescaped, so none is found inside a string value); written with non-ASCII
# kept or escaped alike
_NAME_KEY = re.compile(r'"name"\s*:\s*"([^"\\]*(?:\\.[^"\\]*)*)"')   # (unrolled: a third faster)


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


_ENCODE_ASCII = json.JSONEncoder().encode
if json.encoder.c_make_encoder is not None:   # (CPython's; JSONEncoder.encode builds one a call)
    _C_ENCODER = json.encoder.c_make_encoder(None, None, json.encoder.encode_basestring, None, ": ", ", ",
                                             False, False, False)

    def _written(value) -> Optional[str]:
        """``value`` as ``json.dumps(value, ensure_ascii=False)`` (``tojson``) writes it; None when
        it is not JSON (a NaN, a value of no JSON type)."""
        try:
            return "".join(_C_ENCODER(value, 0))
        except (TypeError, ValueError, RecursionError):
            return None
else:   # pragma: no cover
    def _written(value) -> Optional[str]:
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            return None


def _arguments_held(values, source, nulls: bool) -> bool:
    """True when the argument values a rendering shows (``values``; ``nulls``: its text shows a
    ``null``) are held by the record's (``source``: an object, its JSON string, or None), ``null``
    counting as absent at every depth. Fast paths, each exact: the source string is the
    rendering's values encoded (as producers and ``tojson`` write them) and holds no null; or no
    null is shown, so the source's own nulls cannot matter."""
    if isinstance(source, str):
        if "null" not in source and (_written(values) == source or _ENCODE_ASCII(values) == source):
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
    definitions, written = source_definitions(tools) if tools else ({}, {})
    arguments = source_arguments(calls) if calls else {}
    shown_calls: Dict[str, int] = {}   # calls of each tool shown so far
    wrappers: List[Optional[Dict[str, List[dict]]]] = [None]   # (read when a wrapper is not the plain one)

    def wrapped(start: int, end: int, name: str) -> None:
        if wrappers[0] is None:
            wrappers[0] = source_wrappers(tools)
        _check_wrapper(text, start, end, name, wrappers[0], path, line)

    for m in _NAME_KEY.finditer(text):   # (one loop, few calls: this runs on every tool record)
        name = m.group(1)
        if "\\" in name:
            try:   # a name written escaped (non-ASCII as \uXXXX)
                name = raw_decode(text, m.start(1) - 1)[0]
            except ValueError:
                continue
        defs, args = definitions.get(name), arguments.get(name)
        if defs is None and args is None:
            continue   # not a tool of the record's
        at = m.start()
        if own and any(a <= at < b for a, b in own):
            continue   # inside a message's own text: the message's JSON, not the template's
        if at and text[at - 1] == "{":   # exact texts first: no decoding, no walk
            if args and text.startswith(', "arguments": ', m.end()) \
                    and _call_as_written(text, m.end(), args, shown_calls.get(name, 0)):
                shown_calls[name] = shown_calls.get(name, 0) + 1
                continue
            if defs:   # a definition as the record holds it, no null shown: its text, or compared in C
                if name in written and text.startswith(written[name], at - 1):
                    end = at - 1 + len(next(w for w in written[name] if text.startswith(w, at - 1)))
                    if not _plainly_wrapped(text, at - 1, end):
                        wrapped(at - 1, end, name)
                    continue
                shown, end = _read_object(text, at - 1, name)
                if shown in defs and "arguments" not in shown and text.find("null", at, end) < 0:
                    if not _plainly_wrapped(text, at - 1, end):
                        wrapped(at - 1, end, name)
                    continue
        shown, start, end = _object_at(text, at)
        nulls = text.find("null", start, end) >= 0
        if _definition(shown, name):
            if defs and not nulls and shown in defs:
                if not _plainly_wrapped(text, start, end):
                    wrapped(start, end, name)
                continue   # as the record holds it, and no null shown
            if "description" in shown or not args or (defs and any(held(shown, _without_nulls(d)) for d in defs)):
                if defs:   # (else Llama's call form, below)
                    _check_definition(shown, nulls, defs, name, path, line)
                    if not _plainly_wrapped(text, start, end):
                        wrapped(start, end, name)
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


_PLAIN_WRAPPER = '{"type": "function", "function": '
_FUNCTION_KEY = re.compile(r'"function"\s*:\s*\Z')


def _plainly_wrapped(text: str, start: int, end: int) -> bool:
    """True when the definition at ``text[start:end]`` stands bare, or inside exactly the wrapper
    every record's definition is given (``{"type": "function", "function": DEF}``, as ``tojson``
    writes it): nothing beside it to compare."""
    if text.startswith(_PLAIN_WRAPPER, start - len(_PLAIN_WRAPPER)):
        return text.startswith("}", end)
    return _FUNCTION_KEY.search(text, max(0, start - 64), start) is None


def _check_wrapper(text: str, start: int, end: int, name: str, wrappers: Dict[str, List[dict]], path: str,
                   line: int) -> None:
    """The wrapper around the definition of ``name`` at ``text[start:end]`` (the object whose
    ``function`` it is) is held by one of the record's wrappers of ``name``: every other key it
    shows the source's, with the same value.

    Raises:
        InputError: a key beside the definition the record does not hold (``rendered_not_in_source``)."""
    if _FUNCTION_KEY.search(text, max(0, start - 64), start) is None:
        return   # (a bare definition)
    shown, _, _ = _object_at(text, start - 1)
    if not isinstance(shown, dict) or not isinstance(shown.get("function"), dict) \
            or shown["function"].get("name") != name:
        return   # (not a wrapper this scan can read: the definition itself was compared)
    outer = {k: v for k, v in shown.items() if k != "function"}
    if any(held(outer, w) for w in wrappers.get(name, ())):
        return
    held_by = wrappers.get(name) or [{}]
    extra = next((k for k in outer if all(k not in w or not held(outer[k], w[k]) for w in held_by)), None)
    raise input_error(f"the rendering shows tool '{name}' in a wrapper with {repr(extra) + ' as' if extra else 'what'} "
                      "the record does not hold", path, line,
                      field=f"tools.{name}(wrapper)" + (f".{extra}" if extra else ""), reason="rendered_not_in_source",
                      hint="the template (or the mapping) added to the tool definition's wrapper; report it, or pass "
                           "--skip-bad to skip and count such records")


def _call_as_written(text: str, after: int, args: list, shown: int) -> bool:
    """True when the call whose ``"name": NAME`` ends at ``after`` goes on, character for
    character, as ``, "arguments": A}`` with ``A`` the record's next call of ``NAME``'s arguments
    as given (its JSON string, or its object as JSON writes it) holding no null: the object
    decodes to that name and those arguments, so they are held."""
    if shown >= len(args) or not text.startswith(', "arguments": ', after):
        return False
    source = args[shown]
    if isinstance(source, dict):
        source = _written(source)
    if not isinstance(source, str):
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
