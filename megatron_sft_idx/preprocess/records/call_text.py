"""Tool calls a template writes as text, not JSON: their forms, and the read-back that compares
each rendered call with the record's own (``docs/INPUTS.md``, "Tool calls in any serialisation").

Templates serialise a call however their family was trained: JSON objects (Llama 3.1, Qwen2.5/3,
Mistral; :mod:`.accounting` reads those back), or text -- Qwen3.5/3.6's
``<function=NAME><parameter=KEY>\\nVALUE\\n</parameter></function>``, GLM-4.5+'s
``NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>``, MiniMax's ``<invoke name="NAME">``
with ``<parameter name="KEY">`` or ``<KEY>`` elements. No spelling is assumed here: the template
itself renders the call. :func:`call_renderer` gives, for a call ``(name, arguments)``, the text
the template writes from the call's name to the end of its last argument (the *call text*: what
the template writes for the call itself, without what it writes around a turn's calls), found by
rendering the call alone and twice in a row and keeping what the two agree on.

:func:`check_text_calls` is the converse check of the rendering for such templates, made on every
record: each call the record makes (read from the record as given -- an arguments object or its
JSON string, decoded twice where the producer encoded it twice, ``null`` absent at every depth --
not from the mapping's result) must appear, in order, as exactly the call text the template writes
for it. A mapping that kept a ``null`` (Qwen3.5 would write ``None``), added or dropped a key,
swapped two calls' arguments or renamed a call fails here, naming the tool
(``rendered_not_in_source``). Values a template writes as text compare as their text: the
template's own rendering of the source value is the reference, so ``True`` and ``true`` are each
right for the template that writes them.
"""

from __future__ import annotations

import json
from typing import Callable, Dict, Optional, Sequence, Tuple

from ...jsondoc import parse_record_json
from .errors import input_error

_ASK = {"role": "user", "content": "xqprobe ask"}
_CACHE_LIMIT = 4096


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _common_prefix(a: str, b: str) -> str:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return a[:i]


def call_renderer(render, string_arguments: bool) -> Callable[[str, dict], Optional[str]]:
    """``text(name, arguments) -> str | None``: the call text the template behind
    ``render(messages, tools=None)`` writes for one call (``string_arguments``: the template is
    given arguments as a JSON string, :func:`.rendering.adapt`'s form); None when the template
    rejects it. Results are cached (public sets repeat their calls)."""
    cache: Dict[Tuple[str, str], Optional[str]] = {}

    def call(name: str, arguments: dict) -> dict:
        given = json.dumps(arguments, ensure_ascii=False) if string_arguments else arguments
        return {"type": "function", "id": "pr0be0001", "function": {"name": name, "arguments": given}}

    def text(name: str, arguments: dict) -> Optional[str]:
        key = (name, json.dumps(arguments, ensure_ascii=False))
        if key in cache:
            return cache[key]
        try:
            once = render([_ASK, {"role": "assistant", "content": "", "tool_calls": [call(name, arguments)]}])
        except Exception:   # the template rejects this call: the record's own rendering says so
            return None
        at = once.find(name, once.find(_ASK["content"]) + len(_ASK["content"]))
        out = None if at < 0 else once[at:]
        try:
            twice = render([_ASK, {"role": "assistant", "content": "",
                                   "tool_calls": [call(name, arguments), call(name, arguments)]}])
            first = twice.find(name, twice.find(_ASK["content"]) + len(_ASK["content"]))
            second = twice.find(name, first + len(name) + 1) if first >= 0 else -1
            if out is not None and second > first:
                # the longest text both agree on: the call, not what closes the turn or opens the next call
                seg = twice[first:second]
                out = _common_prefix(out, seg)
        except Exception:   # one call per turn (the template refuses two): the call and its turn's end
            pass
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = out
        return out
    return text


def _source_call(call) -> Tuple[Optional[str], object]:
    """``(name, arguments)`` of a call as the record gives it (OpenAI ``{"function": {...}}``,
    ShareGPT's and xLAM's ``{"name", "arguments"}``): arguments decoded from a JSON string (twice
    where encoded twice), nulls absent; ``(None, None)`` for what the mapping refuses."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return None, None
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = parse_record_json(arguments, what="tool-call arguments")
            if isinstance(arguments, str):
                arguments = parse_record_json(arguments, what="tool-call arguments")
        except ValueError:
            return None, None
    if arguments is None:
        arguments = {}
    return fn["name"], _without_nulls(arguments) if isinstance(arguments, dict) else None


def check_text_calls(text: str, calls: Sequence, call_text, path: str, line: int) -> None:
    """Each call of ``calls`` (the record's, as it gives them) appears in ``text``, in order, as
    the call text ``call_text(name, arguments)`` (:func:`call_renderer`) writes for it.

    Raises:
        InputError: a call whose rendering is not the template's rendering of the record's call
            (``rendered_not_in_source``), naming the tool.
    """
    pos = 0
    for n, call in enumerate(calls):
        name, arguments = _source_call(call)
        if name is None or arguments is None:
            continue   # (the mapping refuses it)
        want = call_text(name, arguments)
        if not want:
            continue   # (the template refuses it alone: its error is the record's)
        at = text.find(want, pos)
        if at < 0:
            raise input_error(f"the rendering shows call {n + 1} (tool '{name}') with arguments other than "
                              "the record's call holds (its text is not the template's rendering of the "
                              "record's own call)", path, line, field=f"tool_calls.{name}.arguments",
                              reason="rendered_not_in_source",
                              hint="the template (or the mapping) changed the call's arguments; report "
                                   "it, or pass --skip-bad to skip and count such records")
        pos = at + len(want)


def text_forms(value) -> Tuple[str, ...]:
    """How a JSON scalar or key a template writes as text may appear: a string as written (or
    JSON-escaped, by the caller's fallback), ``true`` as ``true`` (``tojson``) or ``True``
    (Python's ``str``), a number as JSON and Python write it."""
    if isinstance(value, str):
        return (value,)
    if value is True or value is False:
        return (json.dumps(value), str(value))
    if value is None:
        return ("null", "None")
    if type(value) is int:
        return (repr(value),)
    forms = {json.dumps(value), repr(value), str(value)}
    return tuple(sorted(forms))


def text_leaves(value) -> list:
    """Each key and scalar of a JSON value in document order, as :func:`text_forms` (the call
    forms of a template that writes arguments as text, nested values as XML or JSON)."""
    out = []

    def walk(v):
        if isinstance(v, dict):
            for key, item in v.items():
                out.append(text_forms(str(key)))
                walk(item)
        elif isinstance(v, list):
            for item in v:
                walk(item)
        else:
            out.append(text_forms(v))
    walk(value)
    return out
