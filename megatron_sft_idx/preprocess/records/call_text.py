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
(``rendered_not_in_source``); and the rendering must show no call the record does not make,
counted by the template's call opener (:attr:`CallText.opener`, learned by probe calls), so a
call the mapping invents fails too. Values a template writes as text compare as their text: the
template's own rendering of the source value is the reference, so ``True`` and ``true`` are each
right for the template that writes them.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

from ...jsondoc import parse_record_json
from .errors import input_error

_ASK = {"role": "user", "content": "xqprobe ask"}
_CACHE_LIMIT = 4096
_PER_RENDER = 64   # calls rendered together by CallText.prefetch (a window's: bench/tool_corpus holds ~1.5 a record)


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


def _call(name: str, arguments: dict, string_arguments: bool) -> dict:
    given = json.dumps(arguments, ensure_ascii=False) if string_arguments else arguments
    return {"type": "function", "id": "pr0be0001", "function": {"name": name, "arguments": given}}


def _common_suffix(texts: Sequence[str]) -> str:
    n = 0
    while all(len(t) > n for t in texts) and len({t[len(t) - 1 - n] for t in texts}) == 1:
        n += 1
    return texts[0][len(texts[0]) - n:]


class CallText:
    """What a template that writes tool calls as text writes for them, learned from the template
    behind ``render(messages, tools=None)`` (``string_arguments``: it is given arguments as a JSON
    string, :func:`.rendering.adapt`'s form).

    * ``self(name, arguments) -> str | None``: the call text of one call (None when the template
      rejects it); cached, as public sets repeat their calls;
    * :attr:`opener`: the text the template writes before every call's name, whatever precedes
      the call (a reply's text, another call, nothing): Qwen3.5's ``<tool_call>\n<function=``,
      GLM's ``<tool_call>``, MiniMax's ``<invoke name="``; None when no such text was learned, or
      the template also writes it after the first user turn of a conversation without calls.
    """

    def __init__(self, render, string_arguments: bool) -> None:
        self.render, self.string_arguments = render, string_arguments
        self.cache: Dict[Tuple[str, str], Optional[str]] = {}
        self._opener: Optional[Tuple[Optional[str]]] = None
        self._frame: Optional[Tuple[Optional[Tuple[str, str]]]] = None

    def many(self, calls: Sequence[Tuple[str, dict]]) -> List[Optional[str]]:
        """The call texts of ``calls`` (``(name, arguments)`` pairs), as ``self`` gives each: those
        not cached from ONE rendering of them together (one call too), cut where the template's
        :attr:`frame` says (two renders a call otherwise: a fifth of the main job on tool data);
        each by itself when the frame is unknown or the cut does not hold."""
        keys = [(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls]
        todo = [i for i, key in enumerate(keys) if key not in self.cache]
        if todo and self.frame is not None:
            try:
                text = self.render([_ASK, {"role": "assistant", "content": "", "tool_calls": [
                    _call(*calls[i], self.string_arguments) for i in todo]}])
            except Exception:   # (one call per turn: each by itself)
                text = None
            cut = None if text is None else _cut(text, [calls[i][0] for i in todo], self.frame)
            for i, piece in zip(todo, cut or ()):
                self._keep(keys[i], piece)
        return [self.cache[key] if key in self.cache else self(*call) for key, call in zip(keys, calls)]

    def prefetch(self, records_calls: Sequence[Sequence], per_render: int = _PER_RENDER) -> None:
        """Learn the call texts of several records' calls (each a sequence of calls as the record
        gives them, :func:`_source_call`'s input) at once: :meth:`many` on up to ``per_render`` of
        them a rendering, so the records' read-backs (:func:`check_text_calls`) find them cached.
        A call text is the same learned alone or beside others (:meth:`many` cuts by the frame,
        or renders each alone); only the number of renders changes."""
        calls = [(name, arguments) for record in records_calls for name, arguments in map(_source_call, record)
                 if name is not None and arguments is not None]
        for start in range(0, len(calls), per_render):
            self.many(calls[start:start + per_render])

    @property
    def frame(self) -> Optional[Tuple[str, str, str]]:
        """``(head, glue, closer)``: what the template writes before a turn's first call's name
        (the whole rendering up to it), after a call's text up to the next call's name, and after
        a turn's last call to the end of the rendering; learned on two probe calls (names found
        nowhere else) and kept only when cutting their renderings gives each call's own text."""
        if self._frame is None:
            self._frame = (None,)   # (while it is learned: its probe calls are rendered the frame-less way)
            self._frame = (self._learn_frame(),)
        return self._frame[0]

    def _learn_frame(self) -> Optional[Tuple[str, str, str]]:
        one, two = ("xqprobe_one", {"xqkey": "xqvalue"}), ("xqprobe_two", {"xqkey": "xqother"})
        try:
            alone = self.render([_ASK, {"role": "assistant", "content": "", "tool_calls": [
                _call(*one, self.string_arguments)]}])
            both = self.render([_ASK, {"role": "assistant", "content": "", "tool_calls": [
                _call(*one, self.string_arguments), _call(*two, self.string_arguments)]}])
        except Exception:   # (a template that refuses two calls in a turn: no joint rendering)
            return None
        first, second = self(*one), self(*two)
        start = both.find(_ASK["content"]) + len(_ASK["content"])
        at = both.find(one[0], start)
        nxt = both.find(two[0], at + 1) if at >= 0 else -1
        tail = alone.find(one[0], start)
        if not first or not second or nxt < 0 or tail != at or alone[:at] != both[:at] \
                or not both.startswith(first, at) or not alone.startswith(first, tail):
            return None
        frame = (alone[:at], both[at + len(first):nxt], alone[tail + len(first):])
        return frame if frame[1] and _cut(both, [one[0], two[0]], frame) == [first, second] \
            and _cut(alone, [one[0]], frame) == [first] else None

    def _keep(self, key: Tuple[str, str], text: Optional[str]) -> None:
        if len(self.cache) >= _CACHE_LIMIT:
            self.cache.clear()
        self.cache[key] = text

    def __call__(self, name: str, arguments: dict) -> Optional[str]:
        key = (name, json.dumps(arguments, ensure_ascii=False))
        if key in self.cache:
            return self.cache[key]
        call = _call(name, arguments, self.string_arguments)
        try:
            once = self.render([_ASK, {"role": "assistant", "content": "", "tool_calls": [call]}])
        except Exception:   # the template rejects this call: the record's own rendering says so
            return None
        frame = self.frame   # (learned first: a call's text never depends on what was asked before)
        cut = None if frame is None else _cut(once, [name], frame)
        if cut is not None:   # (the name right after the head: not a name's letters in <think>, <function=)
            self._keep(key, cut[0])
            return cut[0]
        # no frame (or a rendering it does not cut): the call alone and twice in a row agree on it
        at = once.find(name, once.find(_ASK["content"]) + len(_ASK["content"]))
        out = None if at < 0 else once[at:]
        try:
            twice = self.render([_ASK, {"role": "assistant", "content": "", "tool_calls": [call, call]}])
            first = twice.find(name, twice.find(_ASK["content"]) + len(_ASK["content"]))
            second = twice.find(name, first + len(name) + 1) if first >= 0 else -1
            if out is not None and second > first:
                # the longest text both agree on: the call, not what closes the turn or opens the next call
                out = _common_prefix(out, twice[first:second])
        except Exception:   # one call per turn (the template refuses two): the call and its turn's end
            pass
        self._keep(key, out)
        return out

    @property
    def opener(self) -> Optional[str]:
        if self._opener is None:
            self._opener = (self._learn_opener(),)
        return self._opener[0]

    def _learn_opener(self) -> Optional[str]:
        """The common end of what precedes a probe call's name after the ask, an earlier call and a
        reply's text (leading whitespace removed); None when it is under two characters, the
        template refuses a probe, or a conversation without calls shows it after the ask."""
        one, two = (_call(n, {"xqkey": "xqvalue"}, self.string_arguments) for n in ("xqprobe_one", "xqprobe_two"))
        schema = {"type": "function", "function": {"name": "xqprobe_tool", "description": "xqprobe tool",
                                                   "parameters": {"type": "object", "properties": {}}}}
        before = []
        try:
            for content, calls, name in (("", [one], "xqprobe_one"), ("", [one, two], "xqprobe_two"),
                                         ("xqprobe said", [one], "xqprobe_one")):
                text = self.render([_ASK, {"role": "assistant", "content": content, "tool_calls": calls}])
                start = text.find(_ASK["content"]) + len(_ASK["content"])
                before.append(text[start:text.find(name, start)])
            plain = self.render([_ASK, {"role": "assistant", "content": "xqprobe said"}], tools=[schema])
        except Exception:   # (a template that refuses a probe: no count of its calls)
            return None
        opener = _common_suffix(before).lstrip()
        if len(opener) < 2 or opener in plain[plain.find(_ASK["content"]):]:
            return None
        return opener


def _cut(text: str, names: Sequence[str], frame: Tuple[str, str, str]) -> Optional[List[str]]:
    """The call texts in ``text`` (one turn of calls named ``names``, in order, after the ask) by
    ``frame`` (:attr:`CallText.frame`: the first name right after its head, each next one after
    its glue, the closer at the end), or None when it does not cut so."""
    head, glue, closer = frame
    at = len(head)
    if not text.startswith(head) or not text.startswith(names[0], at) or not text.endswith(closer):
        return None
    out = []
    for i in range(1, len(names)):
        nxt = text.find(glue + names[i], at + len(names[i - 1]))
        if nxt < 0:
            return None
        out.append(text[at:nxt])
        at = nxt + len(glue)
    out.append(text[at:len(text) - len(closer)])
    return out


def call_renderer(render, string_arguments: bool) -> CallText:
    """:class:`CallText` of the template behind ``render(messages, tools=None)``."""
    return CallText(render, string_arguments)


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


def check_text_calls(text: str, calls: Sequence, call_text, path: str, line: int,
                     texts: Sequence[str] = (), first_user: Optional[str] = None) -> None:
    """Each call of ``calls`` (the record's, as it gives them) appears in ``text``, in order, as
    the call text ``call_text(name, arguments)`` (:class:`CallText`) writes for it; and, where the
    template's call opener is known (:attr:`CallText.opener`), the rendering holds no other call:
    from the first user turn's text ``first_user`` on (its last occurrence before the first call:
    the system prompt and tool definitions, where a template may write the opener as an example,
    come before it), the opener occurs once per call, plus as often as the call texts and
    ``texts`` (the messages' own texts, rendered as written) hold it.

    Raises:
        InputError: a call whose rendering is not the template's rendering of the record's call,
            or a call the record does not make (``rendered_not_in_source``), naming the tool.
    """
    pos = 0
    wants, starts = [], set()
    given = [(n, *_source_call(call)) for n, call in enumerate(calls)]
    given = [(n, name, arguments) for n, name, arguments in given if name is not None and arguments is not None]
    texts = call_text.many([(name, arguments) for _, name, arguments in given]) if hasattr(call_text, "many") \
        else [call_text(name, arguments) for _, name, arguments in given]   # (the mapping refuses the others)
    for (n, name, _), want in zip(given, texts):
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
        wants.append(want)
        starts.add(at)
    opener = getattr(call_text, "opener", None)
    if opener is None or first_user is None or len(wants) != len(calls):
        return
    after = text.rfind(first_user, 0, min(starts, default=len(text)))
    if after < 0:
        return
    shown = text.count(opener, after)
    held = len(wants) + sum(w.count(opener) for w in wants) + sum(t.count(opener) for t in texts)
    if shown > held:
        at = text.find(opener, after)
        while at >= 0 and at + len(opener) in starts:   # (the first that opens no call of the record)
            at = text.find(opener, at + 1)
        invented = text[at + len(opener):][:60].split("\n")[0] if at >= 0 else ""
        raise input_error(f"the rendering shows {shown - held} tool call(s) more than the record makes "
                          f"({len(wants)}; the first other: {invented!r})", path, line, field="tool_calls",
                          reason="rendered_not_in_source",
                          hint="the mapping (or the template) added a call the record does not make; report it, "
                               "or pass --skip-bad to skip and count such records")


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
