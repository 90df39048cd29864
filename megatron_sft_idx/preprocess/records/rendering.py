"""What a chat template renders: its traits, the conversation adapted to them, and the check
that every message's text is in the rendering.

Templates read the same conversation differently. :func:`probe` asks the template itself, once,
on fixed probe conversations:

* which assistant field it renders reasoning from (``reasoning_content`` as Qwen3 and DeepSeek
  read it, ``thinking``, ``reasoning``), or none (then reasoning goes inline, as the producer
  wrote it or as ``<think>\\nR\\n</think>\\n\\nA``);
* whether it renders tool calls, and whether it wants ``arguments`` as a dict (Hugging Face's
  convention, which Llama 3.1, Qwen and Mistral serialise with ``tojson``) or as a JSON string
  (DeepSeek-V3's template concatenates it); and whether it writes them as JSON (``"key": value``)
  or as text (Qwen3.5's, GLM's and MiniMax's XML: :mod:`.call_text`), decided by where the probe
  call's name, key and value land in the rendering, not by a spelling;
* whether it renders a ``tools`` list.

:func:`adapt` hands the template what it reads, and refuses tool data a template cannot render
(never a rendering without the calls). :func:`check_rendered` then proves, on every rendering,
that each message's text appears in order (system messages and tool definitions anywhere, since
templates move them): content, reasoning of trained turns, each tool call's name and argument
keys and values (as JSON), each tool result, and each message's ``name`` in its message's place
(who spoke, in multi-party data; a tool result's ``name`` that names a call of the turn it
answers is that call's name, checked with the call). A template that renders something nowhere
-- an unknown role skipped, content dropped next to tool calls, a system prompt kept only for a
final user turn, reasoning stripped, a speaker's name dropped -- is an error naming the source
field (``--ignore-field name`` drops the names before rendering, counted).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import List, Optional, Sequence, Tuple

from .accounting import check_rendered_tools
from .call_text import check_text_calls, text_leaves
from .errors import input_error
from .policy import LossPolicy
from .shapes import HISTORY_REASONING, Conversation, call_ids

_INDEX = re.compile(r"\[\d+\]")

_FIELDS = ("reasoning_content", "thinking", "reasoning")
_ID = "pr0be0001"  # nine alphanumerics: Mistral's templates require exactly that


@dataclass(frozen=True)
class TemplateTraits:
    reasoning_field: Optional[str]   # the assistant field the template renders reasoning from
    tool_arguments: Optional[str]    # "dict" | "string" | None: the template renders no tool calls
    renders_tools: bool              # a ``tools`` list reaches the rendering
    call_form: str = "json"          # "json": arguments written as JSON; "text": keys and values as text
    calls_without_content: bool = False   # calls rendered only in a turn whose content is null (DeepSeek-V3)
    call_id_length: int = 0          # a call (and its result) renders only with an id of exactly this many
    #                                  characters (Mistral's: 9); 0: without one too (shapes.call_ids)


def _renders(render, messages, needles: Sequence[str], tools=None) -> bool:
    try:
        text = render(messages, tools=tools)
    except Exception:  # the template rejects the probe: it does not render this
        return False
    return all(n in text for n in needles)


def probe(render) -> TemplateTraits:
    """The traits of the template behind ``render(messages, tools=None) -> str``."""
    user = {"role": "user", "content": "xqprobe ask"}
    field = None
    for name in _FIELDS:
        reply = {"role": "assistant", "content": "xqprobe answer", name: "xqprobe thought"}
        if _renders(render, [user, reply], ["xqprobe thought", "xqprobe answer"]):
            field = name
            break
    schema = {"type": "function", "function": {"name": "xqprobe_tool", "description": "xqprobe tool",
                                               "parameters": {"type": "object", "properties": {}}}}
    renders_tools = _renders(render, [user, {"role": "assistant", "content": "xqprobe answer"}], ["xqprobe_tool"],
                             tools=[schema])
    # (JSON first, content "" first: the bytes of the families before; a null content last, for
    # DeepSeek-V3's template, which renders a turn's calls only when its content is null)
    for content in ("", None):
        for call_form, quote in (("json", '"'), ("text", "")):
            for name, arguments in (("dict", {"xqkey": "xqvalue"}), ("string", '{"xqkey": "xqvalue"}')):
                call = {"type": "function", "id": _ID, "function": {"name": "xqprobe_call", "arguments": arguments}}
                messages = [user, {"role": "assistant", "content": content, "tool_calls": [call]},
                            {"role": "tool", "content": "xqprobe result", "tool_call_id": _ID},
                            {"role": "assistant", "content": "xqprobe answer"}]
                needles = ["xqprobe_call", f"{quote}xqkey{quote}", f"{quote}xqvalue{quote}", "xqprobe result"]
                tools = None if _renders(render, messages, needles) else [schema]
                if tools is None or (renders_tools and _renders(render, messages, needles, tools)):
                    return TemplateTraits(field, name, renders_tools, call_form, content is None,
                                          _call_id_length(render, messages, needles, tools))
    return TemplateTraits(field, None, renders_tools)


def _call_id_length(render, messages, needles, tools) -> int:
    """The length of the ids the template requires of a call and its result, when it renders the
    probe (``messages``, which render with a 9-character id) only with an id, and of the lengths
    1 to 64 only with that one; else 0 (an id is optional, or of no fixed length: nothing is minted)."""
    def with_id(value):
        out = []
        for m in messages:
            m = dict(m)
            if "tool_calls" in m:
                m["tool_calls"] = [{k: v for k, v in dict(c, id=value).items() if v is not None}
                                   for c in m["tool_calls"]]
            if "tool_call_id" in m:
                m["tool_call_id"] = value
                if value is None:
                    del m["tool_call_id"]
            out.append(m)
        return out

    if _renders(render, with_id(None), needles, tools):
        return 0
    lengths = [n for n in range(1, 65) if _renders(render, with_id(("xq" + "0" * 64)[:n]), needles, tools)]
    return lengths[0] if len(lengths) == 1 else 0


def adapt(conv: Conversation, traits: TemplateTraits, policy: LossPolicy, path: str, line: int) -> Conversation:
    """``conv`` with ``rendered`` set to the messages the template is given.

    Raises:
        InputError: tool calls or a tools list the template does not render.
    """
    if conv.rendered is not None:
        return conv
    if traits.call_id_length and call_ids.needs_ids(conv.messages, traits.call_id_length):
        conv = replace(conv, rendered=None,
                       **dict(zip(("messages", "applied"), call_ids.assign(conv, traits.call_id_length, path, line))))
    special = sorted({k for k, m in enumerate(conv.messages) if "reasoning_content" in m or "tool_calls" in m}
                     | set(conv.inline))
    if conv.tools and not traits.renders_tools:
        raise input_error(f"the chat template renders no tool definitions, and 'tools' holds {len(conv.tools)}",
                          path, line, field="tools", reason="template_no_tool_support",
                          hint="use a chat template with tool support (--chat-template), or --skip-bad")
    if not special:
        return conv.with_rendered(conv.messages)
    out = list(conv.messages)
    opening, closing = policy.tags
    for k in special:
        m = dict(out[k])
        if "tool_calls" in m:
            if traits.tool_arguments is None:
                raise input_error(f"the chat template does not render tool calls, and {conv.where(k)} holds "
                                  f"{len(m['tool_calls'])}", path, line, field=conv.where(k),
                                  reason="template_no_tool_support",
                                  hint="use a chat template with tool support (--chat-template), or --skip-bad")
            if traits.tool_arguments == "string":
                m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.dumps(
                    c["function"]["arguments"], ensure_ascii=False))) for c in m["tool_calls"]]
            if traits.calls_without_content:
                if m["content"].strip() or k in conv.inline or "reasoning_content" in m:
                    raise input_error(f"the chat template renders tool calls only in a turn without content "
                                      f"(null), and {conv.where(k)} holds text beside its "
                                      f"{len(m['tool_calls'])} call(s)", path, line, field=conv.where(k),
                                      reason="template_no_tool_support",
                                      hint="use a chat template that renders a reply's text and its calls "
                                           "(--chat-template), or pass --skip-bad")
                m["content"] = None
        thought = m.pop("reasoning_content", None)
        if policy.reasoning == "drop":
            pass  # the answer alone
        elif traits.reasoning_field is not None:
            if thought is not None:
                m[traits.reasoning_field] = thought
        elif k in conv.inline:  # as the producer wrote it
            m["content"] = conv.inline[k]
        elif thought is not None:
            m["content"] = f"{opening}\n{thought}\n{closing}\n\n{m['content']}"
        out[k] = m
    return conv.with_rendered(out)


# --------------------------------------------------------------------------- the rendering check


def json_leaves(value) -> List[Tuple[str, ...]]:
    """Each key and scalar of a JSON value in document order, as the texts it may render as
    (``tojson`` keeps non-ASCII; ``json.dumps`` defaults escape it)."""
    out: List[Tuple[str, ...]] = []
    _leaves(value, out)
    return out


def _leaves(value, out: list) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            out.append(_forms(str(key)))
            if isinstance(item, (dict, list)):
                _leaves(item, out)
            else:
                out.append(_forms(item))
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)):
                _leaves(item, out)
            else:
                out.append(_forms(item))
    else:
        out.append(_forms(value))


def _forms(v) -> Tuple[str, ...]:
    """``json.dumps(v, ensure_ascii=False)`` and ``json.dumps(v)``, by the C encoders for strings
    (one form for an ASCII string without DEL, which only the ASCII encoder escapes: the two agree)."""
    if isinstance(v, str):
        a = encode_basestring(v)
        if v.isascii() and "\x7f" not in v:
            return (a,)
        b = encode_basestring_ascii(v)
        return (a,) if a == b else (a, b)
    if v is None or v is True or v is False:
        return _CONSTANTS[v]
    if type(v) is int:   # (json.dumps writes an int as repr does: no serialiser per leaf)
        return (repr(v),)
    return (json.dumps(v),)


_CONSTANTS = {None: ("null",), True: ("true",), False: ("false",)}

# what an item of the check is (:func:`items_of`): a name (looked for from its message's place,
# which it does not move), a message's own text (content, reasoning: it may hold a user's JSON),
# a tool call's argument
_NAME, _OWN, _ARG = 0, 1, 2


def items_of(conv: Conversation, reasoning_required: Sequence[int], policy: LossPolicy, text_calls: bool = False):
    """``(ordered, anywhere)``: ``(field, what, forms)`` of every text the rendering must hold
    (``text_calls``: the template writes call arguments as text, :mod:`.call_text`). A message's
    ``name`` is ordered, as ``"<role> name"``, before its message's texts (it is looked for from
    where the message begins, and does not move that place: a template may write it before or
    after the content). The check itself walks the same items without naming them
    (:func:`_items`); a name is made for the error alone (:func:`_described`)."""
    ordered, anywhere = _items(conv, reasoning_required, policy, text_calls)
    return ([_described(conv, item) for item in ordered], [_described(conv, item) for item in anywhere])


def _items(conv: Conversation, reasoning_required: Sequence[int], policy: LossPolicy, text_calls: bool):
    """:func:`items_of`'s items as ``(kind, k, j, forms)``: ``kind`` one of ``_NAME``, ``_OWN``,
    ``_ARG``; ``k`` the message (``-1 - i`` for tool ``i``); ``j`` the call (None, or ``-1`` for
    a message's own name, ``-2`` for its reasoning)."""
    leaves = text_leaves if text_calls else json_leaves
    ordered, anywhere = [], []
    called: set = set()   # names of the calls of the last assistant turn that made some
    keep_reasoning = policy.reasoning != "drop"
    for k, m in enumerate(conv.messages):
        role = m["role"]
        calls = m.get("tool_calls")
        if calls:
            called = {c["function"]["name"] for c in calls}
        name = m.get("name")
        if name and not (role == "tool" and name in called):
            ordered.append((_NAME, k, -1, (name,)))
        if role == "assistant" and "reasoning_content" in m and keep_reasoning and k in reasoning_required:
            ordered.append((_OWN, k, -2, (m["reasoning_content"].strip(),)))
        text = m["content"].strip()
        if text:
            (anywhere if role == "system" else ordered).append((_OWN, k, None, (text,)))
        for j, call in enumerate(calls or ()):
            ordered.append((_NAME, k, j, (call["function"]["name"],)))
            ordered += [(_ARG, k, j, forms) for forms in leaves(call["function"]["arguments"])]
    for i, tool in enumerate(conv.tools or ()):
        anywhere.append((_NAME, -1 - i, None, (tool["function"]["name"],)))
    return ordered, anywhere


def _described(conv: Conversation, item) -> Tuple[str, str, Tuple[str, ...]]:
    """``(field, what, forms)`` of an item of :func:`_items`, as errors name it."""
    kind, k, j, forms = item
    if k < 0:
        return f"tools[{-1 - k}]", "tool name", forms
    where, role = conv.where(k), conv.messages[k]["role"]
    if j == -1:
        return f"{where}.name", f"{role} name", forms
    if j == -2:
        return where, "reasoning", forms
    if j is None:
        return where, f"{role} content", forms
    return f"{where}.tool_calls[{j}]", "tool-call name" if kind == _NAME else "tool-call argument", forms


def check_rendered(text: str, conv: Conversation, reasoning_required: Sequence[int], policy: LossPolicy,
                   path: str, line: int, read_back: Optional[list] = None, call_text=None) -> None:
    """Every text of ``conv`` is in ``text``, in order (see the module docstring), and nothing the
    source does not hold: :func:`.accounting.check_rendered_tools`, the read-back of tool
    definitions and calls, made here, or queued on ``read_back`` when it is a list, for the caller
    to make a few records' at a time with :func:`read_back_all` (the same calls made in one loop
    cost a third less than between renders: docs/PREPROCESSING.md, "What accounting costs").
    ``call_text``: for a template that writes calls as text, :func:`.call_text.call_renderer`'s
    function; each call of the record is then also read back as that text
    (:func:`.call_text.check_text_calls`), here.

    Raises:
        InputError: the first text the rendering lacks (reason ``template_dropped_content``), or
            what the read-back refuses when it is made here.
    """
    if conv.plain and _plain_rendered(text, conv.messages):
        return
    ordered, anywhere = _items(conv, reasoning_required, policy, call_text is not None)
    own: List[Tuple[int, int]] = []   # where a message's text holding a "name" key was rendered
    pos = 0
    find = text.find
    for item in ordered:
        forms = item[3]
        if len(forms) == 1:   # (most items: _find's first step, inline)
            form = forms[0]
            at = find(form, pos)
            found = at + len(form) if at >= 0 else _find(text, forms, pos)
        else:
            found = _find(text, forms, pos)
        if found < 0:
            where, what, _ = _described(conv, item)
            raise _dropped(where, what, _find(text, forms, 0) >= 0, path, line)
        kind = item[0]
        if kind == _NAME:
            continue   # (in its message's place, which it does not move)
        pos = found
        if kind == _OWN:
            _own_span(text, forms, found, own)
    for item in anywhere:
        forms = item[3]
        found = _find(text, forms, 0)
        if found < 0:
            where, what, _ = _described(conv, item)
            raise _dropped(where, what, False, path, line)
        if item[0] == _OWN:
            _own_span(text, forms, found, own)
    # and nothing the source does not hold (JSON in a message's own text is not a call or definition)
    if call_text is not None and (conv.source_calls or any("tool_calls" in m for m in conv.messages)):
        check_text_calls(text, conv.source_calls, call_text, path, line, *_own_texts(conv))
    if read_back is None:
        check_rendered_tools(text, conv.source_tools, path, line, conv.source_calls, own)
    elif conv.source_tools or conv.source_calls:
        read_back.append((text, conv.source_tools, path, line, conv.source_calls, own))


def count_history_reasoning(text: str, conv: Conversation, policy: LossPolicy, applied: dict) -> None:
    """Count in ``applied`` (as ``history-reasoning:FIELD``, :data:`.shapes.HISTORY_REASONING`) each
    message whose reasoning ``text`` does not show: after :func:`check_rendered` passed, that is
    reasoning the template drops from the history by the documented rule (docs/INPUTS.md,
    "Thinking templates"), never trained. Not under ``--reasoning-loss drop`` (the policy's)."""
    if policy.reasoning == "drop" or conv.plain:
        return
    for k, m in enumerate(conv.messages):
        thought = m.get("reasoning_content")
        if thought and thought.strip() and _find_at(text, thought.strip(), 0) < 0:
            name = f"{HISTORY_REASONING}:{_INDEX.sub('[]', conv.where(k))}"
            applied[name] = applied.get(name, 0) + 1


def _own_texts(conv: Conversation) -> Tuple[List[str], Optional[str]]:
    """``(texts, first user text)``: every message's own text (content, reasoning), rendered as
    written, and the first user turn's (None: no user turn has text), for the count of calls
    (:func:`.call_text.check_text_calls`)."""
    texts = [v for m in conv.messages for v in (m.get("content"), m.get("reasoning_content")) if v]
    return texts, next((m["content"].strip() for m in conv.messages if m["role"] == "user" and m["content"].strip()),
                       None)


def read_back_all(queued: Sequence[tuple]) -> None:
    """Make the read-backs :func:`check_rendered` queued, in their order.

    Raises:
        InputError: the first one refused (reason ``rendered_not_in_source``).
    """
    for args in queued:
        check_rendered_tools(*args)


def _own_span(text: str, forms: Sequence[str], end: int, own: List[Tuple[int, int]]) -> None:
    """Add where a message's text (a user's, a tool result's, a reply's content, reasoning) ending
    at ``end`` was rendered as written, when it holds a ``"name"`` key: JSON a user pastes is the
    user's text, not a tool call or definition the template wrote
    (:func:`.accounting.check_rendered_tools`)."""
    for form in forms:
        if '"name"' in form and text.startswith(form, end - len(form)):
            own.append((end - len(form), end))
            return


def _plain_rendered(text: str, messages: List[dict]) -> bool:
    """The check's fast path for role/content messages: True when every content is found as
    written, in order (system anywhere); False sends the caller the full way (and its error)."""
    pos = 0
    for m in messages:
        c = m["content"]
        if m["role"] == "system":
            if c not in text and c.strip() not in text:
                return False
            continue
        at = _find_at(text, c, pos)
        if at < 0:  # (a template may strip it)
            c = c.strip()
            at = _find_at(text, c, pos)
            if at < 0:
                return False
        pos = at + len(c)
    return True


def _find_at(text: str, needle: str, pos: int) -> int:
    """``text.find(needle, pos)``, by its first 32 characters then a comparison: a long needle's
    full search costs a preprocessing pass over it, and the content is almost always at the first
    place its start is."""
    if len(needle) <= 32:
        return text.find(needle, pos)
    head = needle[:32]
    at = text.find(head, pos)
    while at >= 0 and not text.startswith(needle, at):
        at = text.find(head, at + 1)
    return at


def _find(text: str, forms: Sequence[str], pos: int) -> int:
    """End of the first occurrence at or after ``pos`` of any of ``forms``, or -1. A form not found
    as written is looked for JSON-escaped too: templates ``tojson`` some texts (Llama 3.1 renders a
    tool result as a JSON string)."""
    best = _first(text, forms, pos)
    if best < 0:
        best = _first(text, [e for f in forms for e in {json.dumps(f, ensure_ascii=False)[1:-1],
                                                        json.dumps(f)[1:-1]} if e != f], pos)
    return best


def _first(text: str, forms: Sequence[str], pos: int) -> int:
    best = -1
    for form in forms:
        at = text.find(form, pos)
        if at >= 0 and (best < 0 or at + len(form) < best):
            best = at + len(form)
    return best


def _dropped(where: str, what: str, elsewhere: bool, path: str, line: int):
    how = "out of order" if elsewhere else "nowhere"
    if what.endswith(" name"):
        hint = ("use a chat template that renders who speaks (--chat-template), pass --ignore-field name if the "
                "names carry nothing the model should see (they are dropped and counted), or pass --skip-bad")
    else:
        hint = ("use a chat template that renders it (--chat-template), change the loss policy "
                "(--reasoning-loss drop drops reasoning on purpose), or pass --skip-bad")
    return input_error(f"the chat template renders the {what} of {where} {how}: the conversation would be "
                       "trained without it", path, line, field=where, reason="template_dropped_content", hint=hint)

