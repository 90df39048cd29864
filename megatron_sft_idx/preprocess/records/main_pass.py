"""Where each message's output begins in ONE rendering by a template that counts or looks back.

Thinking templates (Qwen3, Qwen3.5 / 3.6, GLM-4.7 / 5, MiniMax-M2) read the whole message list
before they render anything -- ``messages|length``, a pass over every message (forward or
reversed) to find the last user turn -- and then render the messages in one forward loop, the
*main pass*. :mod:`.spans`' recorder cannot follow them (their first look at a message is in the
pre-pass), so this module records the main pass itself: the template is compiled once more with
jinja's ``LoopContext`` replaced by :class:`_LoopContext`, which notes how many characters had
been produced when the loop handed each message to its body; a loop without ``loop.*`` pulls its
items straight from the message list's own iterator (:class:`_Pass`), which notes the same. The
main pass is the last pass over the messages; it must have run to its end, visit messages
``s..n-1`` in order (``s`` 0, or 1 after a system message the template renders beforehand), and
no pass may start inside another (a nested pass would make a message's output depend on all
the others).

What that position means -- that ``render(messages[:j])`` is the rendering up to it, but for the
documented thinking rules -- is not something a recording can see: it is qualified per template
and per feature on probe conversations by :class:`.spans.SpanLocator` (with the rules the
reference applies: the generation prompt's opened block counted as prompt, the final turn's
block taken as the history shows it), and :func:`history_turns` keeps away, per conversation, from
the one thing those templates do with what they read first: render an assistant message after the
last user turn otherwise than before it (reasoning kept or dropped, an empty block inserted). A
conversation where a later user turn turns such a message into history under a trained turn goes to
the reference; a trained turn with reasoning (a field, or one block opening its content) a later
user turn makes history is spanned as the rendering shows it, and the locator reads from that
rendering whether the template dropped the reasoning (the reference's ``dropped`` note: the turn's
span holds neither its reasoning nor an opening tag, on a template whose probes showed that drop).
"""

from __future__ import annotations

import functools
from typing import FrozenSet, List, Optional, Sequence, Tuple

from .shapes import split_inline_reasoning
from .template_compile import recompile

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class MainPassRecorder:
    """Characters produced so far, and every pass over the message list of one rendering."""

    __slots__ = ("consumed", "passes", "unsafe", "current", "ahead")

    def __init__(self) -> None:
        self.consumed = 0
        self.passes: List["_Pass"] = []
        self.unsafe = False
        self.current: Optional[int] = None   # the message the loop body of the latest pass renders
        self.ahead: set = set()   # messages whose body (in the latest pass) looked at what follows them

    def looked_ahead(self, messages, turns: Sequence[int], tags: Sequence[str]) -> bool:
        """True when the main pass rendered a trained turn of ``turns`` that has reasoning and is
        not the last message after looking at what follows it (``loop.last``, ``loop.nextitem``, a
        later index: QwQ's template strips the reasoning of every turn but the last): the reference
        may take such a turn's reasoning as dropped from the history, a note the locator gives only
        for the turns a later user turn makes history (the caller leaves those out of ``turns``)."""
        last = len(messages) - 1
        return any(k < last and k in self.ahead and _reasons(messages[k], tags) for k in turns)

    def starts(self, messages) -> Optional[List[int]]:
        """Where each message's output begins (the main pass's positions; a leading system message
        the main pass skips begins at 0), or None when the passes do not show one main pass."""
        if self.unsafe or not self.passes or not self.passes[-1].done:
            return None
        main = self.passes[-1].starts
        n = len(messages)
        s = n - len(main)
        if s not in (0, 1) or (s == 1 and messages[0]["role"] != "system"):
            return None
        if any(index != s + i for i, (index, _) in enumerate(main)):
            return None
        return [0] * s + [at for _, at in main]


class _Indexed(dict):
    """A message that knows its index (plain dict access: no bookkeeping)."""

    __slots__ = ("_index",)


class _Pass:
    """One iteration over the message list (or a slice of it): the position where each item was
    handed out, unless a :class:`_LoopContext` hands them to the loop body itself."""

    __slots__ = ("rec", "items", "i", "starts", "managed", "done")

    def __init__(self, rec: MainPassRecorder, items: list) -> None:
        self.rec, self.items, self.i, self.starts, self.managed, self.done = rec, items, 0, [], False, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= list.__len__(self.items):
            self.done = True
            raise StopIteration
        item = list.__getitem__(self.items, self.i)
        self.i += 1
        if not self.managed:
            self.starts.append((item._index, self.rec.consumed))
            self.rec.current = item._index
        return item


class _Messages(list):
    """The message list: every iteration is a recorded :class:`_Pass`; a pass started before the
    previous one ran to its end (nested, or left by a ``break``) marks the rendering unsafe."""

    __slots__ = ("_rec",)

    def __iter__(self):
        rec = self._rec
        if rec.passes and not rec.passes[-1].done:
            rec.unsafe = True
        rec.current = None
        rec.ahead = set()
        p = _Pass(rec, self)
        rec.passes.append(p)
        return p

    def __getitem__(self, key):
        if isinstance(key, slice):
            out = _Messages(list.__getitem__(self, key))
            out._rec = self._rec
            return out
        rec = self._rec
        if rec.current is not None and (not isinstance(key, int) or key < 0 or key > rec.current):
            rec.ahead.add(rec.current)
        return list.__getitem__(self, key)


@functools.lru_cache(maxsize=None)
def _loop_context_class():
    """:class:`_LoopContext`, defined on first use: jinja2 comes with the ``preprocess`` extra, and
    the command-line tools import this module before they can say that an extra is missing."""
    from jinja2.runtime import LoopContext, missing   # (optional: the preprocess extra)

    class _LoopContext(LoopContext):
        """jinja's loop context, noting where the loop hands each message to its body (a loop that
        reads ``loop.last`` or ``loop.nextitem`` pulls the next message early: its position is not
        where it was pulled, but where the body gets it)."""

        def __init__(self, iterable, *args, **kwargs) -> None:
            super().__init__(iterable, *args, **kwargs)
            if isinstance(self._iterator, _Pass):
                self._iterator.managed = True

        def __next__(self):
            rv = super().__next__()
            it = self._iterator
            if isinstance(it, _Pass):
                it.starts.append((rv[0]._index, it.rec.consumed))
                it.rec.current = rv[0]._index
            return rv

        def _looks_ahead(self) -> None:
            it = self._iterator
            if isinstance(it, _Pass) and self._current is not missing:
                it.rec.ahead.add(self._current._index)

        @property
        def length(self) -> int:
            self._looks_ahead()
            return LoopContext.length.fget(self)

        @property
        def last(self) -> bool:
            self._looks_ahead()
            return LoopContext.last.fget(self)

        @property
        def nextitem(self):
            self._looks_ahead()
            return LoopContext.nextitem.fget(self)

    return _LoopContext


def recording_template(compiled, source: str):
    """``source`` compiled again as ``compiled`` was (:func:`.template_compile.recompile`; the
    tokenizer's own compiled template is shared with the reference and stays as it is), its loops
    recorded; None when that cannot be done (the caller then uses the reference)."""
    try:
        template = recompile(compiled, source)
        template.root_render_func.__globals__["LoopContext"] = _loop_context_class()
    except Exception:   # (a jinja without these internals: prefix renders, same bytes)
        return None
    return template


def wrap(messages, rec: MainPassRecorder) -> _Messages:
    out = _Messages()
    out._rec = rec
    for i, m in enumerate(messages):
        w = _Indexed(m)
        w._index = i
        list.append(out, w)
    return out


def history_turns(messages, turns: Sequence[int], tags: Sequence[str]) -> Optional[FrozenSet[int]]:
    """The trained turns whose reasoning a later user turn makes history (the template may drop
    it: :meth:`.spans.SpanLocator.locate` reads from the rendering whether it did, and notes it as
    the reference does), or None when the rendering of a trained turn's prefix may show as the
    latest exchange what the conversation shows as history, beyond the reference's rules: an
    assistant message right before the turn, or between it and the last user turn before it while
    a user turn follows; the turn's reasoning, a user turn following, in no form
    :func:`history_reasoning` reads; a turn before the last message whose content starts with
    whitespace (Qwen3 strips it from the final turn only, QwQ from the history only; the rule
    taking the final turn's empty block out takes the whitespace after it too). Which user
    messages the template counts as a new query is the template's (Qwen's skip one holding a
    wrapped ``<tool_response>``): the last query before a turn is taken as late as only a plain
    user message makes it, the last one overall as late as any user message makes it."""
    roles = [m["role"] for m in messages]
    users = [i for i, r in enumerate(roles) if r == "user"]
    last_user = users[-1] if users else -1
    last = len(messages) - 1
    history = []
    for k in turns:
        if k and roles[k - 1] == "assistant":
            return None
        content = messages[k].get("content")
        if k < last and isinstance(content, str) and content[:1].isspace():
            return None
        if last_user < k:
            continue
        query = max((i for i in users if i < k and _plain_query(messages[i])), default=-1)
        if any(roles[i] == "assistant" for i in range(query + 1, k)):
            return None
        if _reasons(messages[k], tags):
            if history_reasoning(messages[k], tags) is None:
                return None
            history.append(k)
    return frozenset(history)


def history_reasoning(message, tags: Sequence[str]) -> Optional[Tuple[str, str]]:
    """``(reasoning, answer)`` of a message with reasoning, both stripped: a field's and the
    content; or, written inline (a template with no reasoning field: QwQ), the one block the
    content opens with and what follows it. None when it is neither (a blank field, a field and
    a tag in the content, a block elsewhere or not closed, more than one)."""
    opening, closing = tags
    content = message.get("content")
    if not isinstance(content, str):
        return None
    field = [message[key] for key in _REASONING_KEYS if message.get(key)]
    if field:
        if len(field) > 1 or not isinstance(field[0], str) or not field[0].strip() or opening in content \
                or closing in content:
            return None
        return field[0].strip(), content.strip()
    text = content.strip()
    split = split_inline_reasoning(text, opening, closing)
    if split is None or text.count(opening) > 1 or text.count(closing) > 1 or not split[0].strip():
        return None
    return split[0].strip(), split[1].strip()


def _plain_query(message) -> bool:
    content = message.get("content")
    if not isinstance(content, str):
        return False
    text = content.strip()
    return not (text.startswith("<") and text.endswith(">"))


def _reasons(message, tags: Sequence[str]) -> bool:
    """The message has reasoning, as a field or inline (either tag in its content)."""
    content = message.get("content")
    return any(message.get(k) for k in _REASONING_KEYS) or (isinstance(content, str)
                                                             and any(t in content for t in tags))

