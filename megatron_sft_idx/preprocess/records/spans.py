"""Assistant spans from ONE rendering of the conversation, exact to the prefix-render rule.

The reference rule (:meth:`ChatTokenizer.prefix_spans`) renders ``2k+1`` prefixes of a
conversation with k assistant turns: turn k spans from the end of
``render(messages[:k], add_generation_prompt=True)`` to the end of
``render(messages[:k+1])``, minus trailing whitespace. For a template that renders
messages one after another, ``render(messages[:j])`` is the full rendering cut where
the template first looks at message j. So the full rendering is produced once
through ``Template.generate`` with every message wrapped in a dict that records, on
its first access, how many characters the consumer has already taken from the
generator (a generator runs only when pulled, so that count is exact).

The result is used only when it can vouch for itself:

* per template, :func:`qualify` compares the method with the reference on fixed
  probe conversations (roles, system prompts, empty and whitespace contents, special
  tokens) and also requires ``len(render(messages[:j])) == L_j`` for every j >= 1 and a
  generation prompt that is one constant string; a template that fails uses the reference
  for every conversation. Then each *feature* the data may hold beyond role and content --
  tool definitions, tool calls, parallel tool calls, tool results, reasoning -- is
  qualified on its own probes (adapted to the template as the data is, :func:`.rendering.adapt`):
  a feature is trusted only when the method gave the reference's spans on at least one of its
  probes and on none differed (a template that picks a tool-call turn's end token by looking
  at the next message, ``loop.nextitem``, fails here);
* per conversation, :meth:`SpanLocator.locate` returns None (so the caller uses
  the reference) when the conversation holds a feature that is not qualified (or one
  the probes do not know: an extra message key, an unknown role), when the template asked
  for anything that depends on later
  messages (``len(messages)``, ``loop.last``/``loop.length``, negative indices,
  ``reversed``), looked at an earlier message again after a later one (a look back or
  a second pass: the earlier turn's output may not be finished), looked at messages out of order,
  or when a located span fails the cheap checks (the generation prompt sits at the
  span start, the stripped assistant content lies inside the span);
* the batched encoder cross-checks a deterministic sample of conversations against
  the reference and stops the run on any difference.

A template that counts the messages or looks back before rendering (the thinking templates:
``messages|length``, a pass over every message to find the last user turn) is recorded through
its *main pass* instead (:mod:`.main_pass`: where its loop hands each message to the body) and
qualified the same way, the reference's thinking rules applied on both sides (the generation
prompt's opened block counted as prompt, the notes compared); per conversation,
:func:`.main_pass.history_turns` and :meth:`.main_pass.MainPassRecorder.looked_ahead` send what the
rules do not cover to the reference; a trained turn whose reasoning a later user turn drops from
the history is spanned as the rendering shows it, with the reference's ``dropped`` note. A
template qualified the first way uses the main pass for the conversations holding a feature only
that method qualified (:attr:`SpanLocator.wider`).

What the recorder cannot see is output a template holds back (in a namespace variable or
a ``set`` block) and writes after it looked at a later message; the generation-prompt and
content checks, the probes and the sampled cross-check are what catch such templates, and
``--span-method prefix`` turns the method off.
"""

from __future__ import annotations

from typing import FrozenSet, List, Optional, Tuple

from .errors import InputError
from .main_pass import MainPassRecorder, history_reasoning, history_turns, recording_template, wrap as wrap_main_pass
from .policy import DEFAULT_POLICY, LossPolicy, without_opened_block
from .rendering import adapt
from .shapes import Conversation

#: the features qualified separately from the plain probes (see the module docstring)
FEATURES = ("tools", "calls", "parallel", "results", "reasoning")
_REASONING_KEYS = frozenset({"reasoning_content", "thinking", "reasoning"})
_PROBE_TEXTS = ("Hello there.", "", "  padded  ", "line one\nline two\n", "<|im_end|>", "x", " ",
                "\n\nlead", "trail\n\n", "ünïcødé 日本 😀", "user", "assistant", "{{ not jinja }}")


class _Recorder:
    """Shared state of one rendering: characters consumed, first access per message, flags."""

    __slots__ = ("consumed", "first", "current", "unsafe")

    def __init__(self, n: int) -> None:
        self.consumed = 0
        self.first = [-1] * n
        self.current = None
        self.unsafe = False

    def enter(self, message: "_Message") -> None:
        """First access of ``message``: record where its output begins; the message before it
        becomes a tripwire (a later look back at it means its output may not be finished)."""
        self.first[message._index] = self.consumed
        if self.current is not None:
            self.current.__class__ = _Past
        message.__class__ = _Current
        self.current = message


class _Message(dict):
    """A message not yet looked at: its first access is recorded (then it becomes _Current)."""

    __slots__ = ("_rec", "_index")

    def _enter(self):
        self._rec.enter(self)

    def __getitem__(self, key):
        self._enter()
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self._enter()
        return dict.get(self, key, default)

    def __contains__(self, key):
        self._enter()
        return dict.__contains__(self, key)

    def __iter__(self):
        self._enter()
        return dict.__iter__(self)

    def __len__(self):
        self._enter()
        return dict.__len__(self)

    def keys(self):
        self._enter()
        return dict.keys(self)

    def values(self):
        self._enter()
        return dict.values(self)

    def items(self):
        self._enter()
        return dict.items(self)


class _Current(dict):
    """The message being rendered: plain dict access, no bookkeeping (the hot path)."""

    __slots__ = ("_rec", "_index")


class _Past(_Message):
    """A message whose successor has been looked at: any access marks the rendering unsafe."""

    __slots__ = ()

    def _enter(self):
        self._rec.unsafe = True


class _Messages(list):
    """The message list; anything that reveals how many messages follow marks the rendering unsafe."""

    __slots__ = ("_rec",)

    def __len__(self):
        self._rec.unsafe = True
        return list.__len__(self)

    def __reversed__(self):
        self._rec.unsafe = True
        return list.__reversed__(self)

    def __getitem__(self, key):
        if isinstance(key, slice):
            if any(v is not None and (not isinstance(v, int) or v < 0) for v in (key.start, key.stop, key.step)):
                self._rec.unsafe = True
            out = _Messages(list.__getitem__(self, key))
            out._rec = self._rec
            return out
        if not isinstance(key, int) or key < 0:
            self._rec.unsafe = True
        return list.__getitem__(self, key)

    def __bool__(self):
        return list.__len__(self) > 0


def _wrap(messages, rec: _Recorder) -> _Messages:
    out = _Messages()
    out._rec = rec
    for i, m in enumerate(messages):
        w = _Message(m)
        w._rec = rec
        w._index = i
        list.append(out, w)
    return out


class SpanLocator:
    """One-render span location for one tokenizer's template (see the module docstring)."""

    def __init__(self, tok, policy: LossPolicy = DEFAULT_POLICY, lookback_only: bool = False) -> None:
        self.tok = tok
        self.policy = policy
        self.generation_prompt: Optional[str] = None
        self.qualified: FrozenSet[str] = frozenset()
        self.empty_prefix = tok.empty_prefix()
        #: the template counts or looks back, and its main pass is recorded (:mod:`.main_pass`)
        self.lookback = False
        self._main_pass = None
        #: the template drops the history's reasoning, as the reference notes it, on a probe the
        #: method agreed on (:meth:`locate` notes a drop only then)
        self.drops_history = False
        #: for a template qualified without its main pass: the main-pass method, for conversations
        #: holding a feature only that method qualified (MiniMax-M3's tool calls and results)
        self.wider: Optional["SpanLocator"] = None
        self.enabled = tok.compiled is not None and ((not lookback_only and self.qualify())
                                                     or self._qualify_lookback())
        if self.enabled and not self.lookback and not lookback_only and self.qualified != frozenset(FEATURES):
            wider = SpanLocator(tok, policy, lookback_only=True)
            if wider.enabled and not wider.qualified <= self.qualified:
                self.wider = wider

    def _qualify_lookback(self) -> bool:
        """:meth:`qualify` again, positions taken from the template's main pass (:mod:`.main_pass`)."""
        self._main_pass = recording_template(self.tok.compiled, self.tok.chat_template)
        if self._main_pass is None:
            return False
        self.lookback = True
        if self.qualify():
            return True
        self.lookback, self._main_pass = False, None
        return False

    def render_recorded(self, messages, tools=None, turns=()) -> Tuple[str, Optional[List[int]]]:
        """The full rendering and, when safe, the position where each message's output begins
        (``turns``: the trained turns, for :meth:`.main_pass.MainPassRecorder.looked_ahead`, but
        those whose reasoning :meth:`locate` reads from the rendering)."""
        if self.lookback:
            return self._render_main_pass(messages, tools, turns)
        rec = _Recorder(len(messages))
        parts = []
        extra = {} if tools is None else {"tools": tools}
        for chunk in self.tok.compiled.generate(messages=_wrap(messages, rec), add_generation_prompt=False,
                                                **extra, **self.tok.template_kwargs):
            rec.consumed += len(chunk)
            parts.append(chunk)
        text = "".join(parts)
        first = rec.first
        if rec.unsafe or min(first, default=0) < 0 or any(a > b for a, b in zip(first, first[1:])):
            return text, None
        return text, first

    def _render_main_pass(self, messages, tools, turns) -> Tuple[str, Optional[List[int]]]:
        rec = MainPassRecorder()
        parts = []
        extra = {} if tools is None else {"tools": tools}
        for chunk in self._main_pass.generate(messages=wrap_main_pass(messages, rec), add_generation_prompt=False,
                                              **extra, **self.tok.template_kwargs):
            rec.consumed += len(chunk)
            parts.append(chunk)
        text = "".join(parts)
        first = rec.starts(messages)
        if (first is None or any(a > b for a, b in zip(first, first[1:]))
                or rec.looked_ahead(messages, turns, self.policy.tags)):
            return text, None
        return text, first

    def locate(self, messages, turns: List[int], tools=None, every_feature: bool = False, plain: bool = False
               ) -> Tuple[str, Optional[List[Tuple[int, int]]], dict]:
        """``(full rendering, spans, notes)`` of the assistant messages at ``turns``; spans None
        when the one-render method cannot vouch for this conversation (use the reference; the
        text is then "" when nothing was rendered); ``notes`` as the reference's
        (:meth:`.chat.ChatTokenizer.prefix_spans`): ``opened``, the turns whose generation prompt's
        opened block was counted as prompt, and ``dropped``, the turns whose reasoning the template
        drops from the history (a later user turn follows; the turn's span shows neither its
        reasoning nor the opening tag); ``every_feature`` (the probes) skips the test that the
        conversation holds only qualified features; ``plain``: as :func:`features` takes it.

        Raises:
            Exception: whatever the template raises (the caller reports it as the reference does).
        """
        if not every_feature and not features(messages, tools, self.policy.tags[0], plain) <= self.qualified:
            return ("", None, {}) if self.wider is None else self.wider.locate(messages, turns, tools, plain=plain)
        history = frozenset()
        if self.lookback:
            history = history_turns(messages, turns, self.policy.tags)
            if history is None:
                return "", None, {}
        text, starts = self.render_recorded(messages, tools, [k for k in turns if k not in history])
        if starts is None:
            return text, None, {}
        g = self.generation_prompt
        opening = self.policy.tags[0]
        spans, opened, dropped = [], set(), set()
        for k in turns:
            if k == 0:
                # (with tools, the empty prefix would hold the tool definitions; a template that looks
                # back may refuse a conversation of one assistant message, as Qwen's do)
                if tools is not None or self.lookback:
                    return text, None, {}
                begin = len(self.empty_prefix)
                if not text.startswith(self.empty_prefix):
                    return text, None, {}
            elif text.startswith(g, starts[k]):
                begin = starts[k] + len(g)
            else:   # (the reference's rule: a generation prompt's opened block the turn omits is prompt)
                head = without_opened_block(text[:starts[k]] + g, *self.policy.tags) if self.lookback else None
                if head is None or not text.startswith(head):
                    return text, None, {}
                begin = len(head)
                opened.add(k)
            end = starts[k + 1] if k + 1 < len(messages) else len(text)
            if end < begin:
                return text, None, {}
            while end > begin and text[end - 1].isspace():
                end -= 1
            content = messages[k]["content"]
            if k in history:
                reasoning, answer = history_reasoning(messages[k], self.policy.tags)
                if text.find(reasoning, begin, end) < 0:
                    if text.find(opening, begin, end) >= 0 or not (every_feature or self.drops_history):
                        return text, None, {}   # (a block, but not the turn's reasoning: beyond the rules)
                    dropped.add(k)   # (the reference's rule: reasoning the template drops from the history)
                    content = answer
            if isinstance(content, str):
                content = content.strip()
                if content.startswith(opening) and text.endswith(opening, 0, len(text[:begin].rstrip())):
                    content = content[len(opening):].strip()   # (the block opened in the generation prompt)
                if text.find(content, begin, end) < 0:   # (no slice: a turn's text is not copied)
                    return text, None, {}
            if any(text.find(c["function"]["name"], begin, end) < 0 for c in messages[k].get("tool_calls") or ()):
                return text, None, {}
            spans.append((begin, end))
        return text, spans, {"opened": opened, "dropped": dropped}

    # ------------------------------------------------------------ per-template qualification

    def qualify(self) -> bool:
        """True when the method gives the reference's spans on every plain probe conversation the
        template accepts (at least three), with one constant generation prompt; then sets
        :attr:`qualified` to the features whose own probes it passes."""
        prompts, accepted = set(), 0
        for messages in _probe_conversations():
            try:
                plain = self.tok.render(messages)
                prompted = self.tok.render(messages, add_generation_prompt=True)
            except Exception:  # the template rejects this probe (e.g. roles must alternate)
                continue
            prompts.add(prompted[len(plain):] if prompted.startswith(plain) else None)
            accepted += 1
        if accepted < 3 or len(prompts) != 1 or None in prompts:
            return False
        self.generation_prompt = prompts.pop()
        probes = _probe_conversations()
        verdicts = [self._agrees(messages) for messages in probes]
        if self.lookback:   # (history_turns declines some shapes by rule; the method must agree on the
            # reference's spans of conversations of several turns, not only of one)
            several = sum(v == "agrees" and sum(m["role"] == "assistant" for m in messages) > 1
                          for v, messages in zip(verdicts, probes))
            if "differs" in verdicts or several < 3:
                return False
        elif any(v in ("differs", "declined") for v in verdicts):
            return False   # (declining a plain probe the reference renders: not a template it follows)
        passed = set()
        for feature in FEATURES:
            verdicts = {self._agrees(m, t) for m, t in self._feature_probes(feature)}
            if "agrees" in verdicts and "differs" not in verdicts:
                passed.add(feature)
        self.qualified = frozenset(passed)
        return True

    def _feature_probes(self, feature: str):
        """``(template messages, tools)`` of the probes of ``feature``, adapted to the template;
        none when the template renders no such data (the data is refused then, not encoded)."""
        out = []
        for messages, tools in _feature_conversations(feature):
            conv = Conversation(messages, tools, list(range(len(messages))))
            try:
                conv = adapt(conv, self.tok.traits, self.policy, "probe", 0)
            except InputError:
                continue
            out.append((conv.template_messages, conv.tools))
        return out

    def _agrees(self, messages, tools=None) -> str:
        """``agrees``: the method gives exactly the reference's spans and notes (and, for a template
        that does not look back, each message's output begins where the rendering of the messages
        before it ends); ``differs``: it gives other spans, or raises; ``declined``: it returns None
        where the reference gives spans (that conversation would go to the reference);
        ``rejected``: the template or the reference refuses the conversation, and the method
        declines it too."""
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            text = self.tok.render(messages, tools=tools)
        except Exception:
            return "rejected"  # both methods report the template's error
        notes: dict = {}
        try:
            want = self.tok.prefix_spans(Conversation(messages, tools, rendered=messages), turns, text, "probe", 0,
                                         policy=self.policy, notes=notes)
        except Exception:
            want = None
        try:
            got_text, got, got_notes = self.locate(messages, turns, tools, every_feature=True)
            starts = None if self.lookback else self.render_recorded(messages, tools)[1]
        except Exception:
            return "differs"
        if got is None:
            if got_text and got_text != text:
                return "differs"
            return "rejected" if want is None else "declined"
        if got_text != text or got != want or any(got_notes.get(n, set()) != notes.get(n, set())
                                                  for n in ("opened", "dropped")):
            return "differs"
        if self.lookback:
            self.drops_history = self.drops_history or bool(notes.get("dropped"))
            return "agrees"   # (its prefixes render otherwise by the documented rules: the spans are the proof)
        for j in range(1, len(messages)):
            try:
                if len(self.tok.render(messages[:j], tools=tools)) != starts[j]:
                    return "differs"
            except Exception:
                return "differs"
        return "agrees"


def features(messages, tools, opening: str, plain: bool = False) -> FrozenSet[str]:
    """What a conversation (as the template is given it) holds beyond role and content: the
    names of :data:`FEATURES`, and ``other`` for anything the probes do not know. ``plain``: the
    messages are role and content only, as given, of the roles system, user and assistant, and
    there are no tools (:attr:`.shapes.Conversation.plain`); then only reasoning written inline
    in a reply can be there, and no message's keys are walked."""
    if plain:
        return _INLINE_REASONING if any(m["role"] == "assistant" and opening in m["content"]
                                        for m in messages) else _NOTHING
    out = set()
    if tools:
        out.add("tools")
    for m in messages:
        role = m["role"]
        if role == "tool":
            out.add("results")
        elif role not in ("system", "user", "assistant"):
            out.add("other")
        for key in m:
            if key in ("role", "content"):
                continue
            if key == "tool_calls":
                out.add("parallel" if len(m[key]) > 1 else "calls")
            elif key in _REASONING_KEYS:
                out.add("reasoning")
            elif not (role == "tool" and key in ("tool_call_id", "name")):
                out.add("other")
        if role == "assistant" and isinstance(m.get("content"), str) and opening in m["content"]:
            out.add("reasoning")
    return frozenset(out)

_INLINE_REASONING, _NOTHING = frozenset({"reasoning"}), frozenset()


def _probe_conversations():
    """Fixed conversations covering roles, orders and awkward contents."""
    t = _PROBE_TEXTS
    out = []
    for i in range(len(t)):
        a, b, c = t[i], t[(i + 3) % len(t)], t[(i + 7) % len(t)]
        out.append([{"role": "system", "content": a}, {"role": "user", "content": b},
                    {"role": "assistant", "content": c}, {"role": "user", "content": a},
                    {"role": "assistant", "content": b}])
        out.append([{"role": "user", "content": c}, {"role": "assistant", "content": a}])
    out.append([{"role": "assistant", "content": "first"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "second"}])
    out.append([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "end"}])
    return out


_TOOL = {"type": "function", "function": {"name": "probe_lookup", "description": "Look a word up.",
                                          "parameters": {"type": "object", "properties": {
                                              "word": {"type": "string"}}, "required": ["word"]}}}


def _call(i: int, name: str = "probe_lookup", arguments=None) -> dict:
    # nine alphanumerics: Mistral's templates require exactly that
    return {"type": "function", "id": f"pr0be{i:04d}",
            "function": {"name": name, "arguments": {"word": "ünï x"} if arguments is None else arguments}}


def _feature_conversations(feature: str):
    """``(messages, tools)`` probes of one feature, in the mapping's vocabulary (before adapt)."""
    u = {"role": "user", "content": "Look it up."}
    a = {"role": "assistant", "content": "It means a greeting."}
    if feature == "tools":
        return [([u, a], [_TOOL]), ([{"role": "system", "content": "Be brief."}, u, a, dict(u, content="More?"),
                                     dict(a, content="")], [_TOOL])]
    if feature in ("calls", "parallel", "results"):
        n = 2 if feature == "parallel" else 1
        out = []
        for content in ("", "Let me check."):
            calls = [_call(i) for i in range(n)]
            results = [{"role": "tool", "content": f"result {i}", "tool_call_id": c["id"]}
                       for i, c in enumerate(calls)]
            turn = {"role": "assistant", "content": content, "tool_calls": calls}
            for tools in (None, [_TOOL]):
                out.append(([u, turn] + results + [a], tools))
                out.append(([u, turn] + results + [a, dict(u, content="Again."), dict(turn)] + results
                            + [dict(a, content="")], tools))
                if feature != "results":   # (a call turn a user turn follows: rendered as when it ends
                    # the conversation? A template choosing its end token by the next message does not)
                    out.append(([u, turn, dict(u, content="Thanks."), a], tools))
        return out
    thought = {"role": "assistant", "content": "Hi.", "reasoning_content": "They greet me.\nSo I greet back."}
    return [([u, thought], None), ([u, thought, dict(u, content="Again."), dict(thought, content="")], None),
            ([{"role": "system", "content": "Think."}, u, dict(thought, reasoning_content="x"), u, thought], None)]
