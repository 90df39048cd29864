"""The mapping of one record: what every shape's reader shares -- errors naming ``file:line``
and the field, texts and text parts, fields no shape uses, reasoning (a field, or inline tags),
a record-level system prompt, tool calls and their arguments, tools lists. Each shape's own
module (:mod:`.registry` lists them) walks its record through a :class:`Mapper`."""

from __future__ import annotations

import functools
import re
from typing import Dict, FrozenSet, List, Optional

from ....errors import MetadataError, MetadataLimitError
from ....jsondoc import parse_record_json
from ..errors import duplicate_key, input_error
from .base import (check_json_texts, check_text, drop_nulls, may_hold_null, present, split_inline_reasoning,
                   surrogate_free)
from .conversation import Conversation, SchemaOptions
from .keys import DECODED_TWICE, REASONING_SWITCHES, SYSTEM_KEYS

_WHITESPACE_STARTS = frozenset(" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                               + "".join(chr(c) for c in range(0x2000, 0x200B)))
#: the message fields an assistant's reasoning may come in (one of them a message)
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
_TEXT_PARTS = ("text", "input_text", "output_text")
_INDEX = re.compile(r"\[\d+\]")
_TOOL_CALL_FIELDS = frozenset({"id", "type", "function", "name", "arguments", "index"})
#: the keys of a tool definition's wrapper, ``{"type": "function", "function": {...}}``
_WRAPPER_FIELDS = frozenset({"type", "function"})


@functools.lru_cache(maxsize=8)
def _maybe_reasoning(opening: str) -> FrozenSet[str]:
    """First characters of a content that may open with a reasoning block (whitespace, the tag's)."""
    return _WHITESPACE_STARTS | {opening[:1]}


class Mapper:
    """The mapping of one record (keeps ``path:line`` for its errors)."""

    def __init__(self, path: str, line: int, opts: SchemaOptions, ignored: Optional[Dict[str, int]] = None) -> None:
        self.path, self.line, self.opts = path, line, opts
        self.ignored = ignored   # counts of fields ignored by --ignore-field, as "ignore-field:messages[].id"
        self.nulls = True        # the record may hold a null (False: its JSON text has none)
        self.raw = None          # the record's bytes as read, if any (for :meth:`surrogate_free`)
        self._free: Optional[bool] = None
        self.maybe_reasoning = _maybe_reasoning(opts.reasoning_tags[0])
        self.messages: List[dict] = []
        self.fields: list = []
        self.untrained: set = set()
        self.inline: Dict[int, str] = {}
        self.plain = True   # every message so far was taken by a fast path as {"role", "content"}
        self.calls: list = []   # each tool call as the record gives it, before any mapping

    def surrogate_free(self) -> bool:
        """True when no value of the record can hold a lone surrogate (:func:`.base.surrogate_free`
        of its bytes, asked once, and only of a record that gives JSON values: tool calls, tools)."""
        if self._free is None:
            self._free = surrogate_free(self.raw)
        return self._free

    def error(self, message: str, where: Optional[str], reason: str, hint: Optional[str] = None):
        return input_error(message, self.path, self.line, field=where, reason=reason,
                           hint=hint or "fix the record, or pass --skip-bad to skip and count such records")

    def json_value(self, text: str, where: str, not_json: str):
        """The JSON value a string of the record holds (tool-call arguments, a tools list, xLAM
        answers), within the record limits (:func:`~megatron_sft_idx.jsondoc.parse_record_json`).

        Raises:
            InputError: ``not_json`` (reason ``bad_tool_call``) for text that is not JSON;
                reason ``json_too_deep`` for JSON beyond the limits; ``duplicate_key`` for an
                object naming a key twice.
        """
        try:
            return parse_record_json(text, what=where)
        except MetadataLimitError as exc:
            raise self.error(f"'{where}' holds JSON beyond the record limits ({exc.detail})",
                             where, "json_too_deep" if exc.limit == "depth" else "bad_tool_call") from None
        except MetadataError as exc:
            if getattr(exc, "duplicate", None) is not None:
                raise duplicate_key(exc.duplicate, self.path, self.line, where) from None
            raise self.error(not_json, where, "bad_tool_call") from None

    def done(self, tools, source=None) -> Conversation:
        """The conversation; ``source``: the record's tools value as given (checked against the
        rendering by :mod:`.accounting`)."""
        if not self.messages:
            raise self.error("empty conversation", None, "empty_conversation")
        plain = self.plain and not tools and not self.inline and not self.untrained
        return Conversation(self.messages, tools, self.fields, frozenset(self.untrained), self.inline, None, plain,
                            source if tools else None, tuple(self.calls))

    def plain_text(self, role: str, content, where, text_field: str) -> bool:
        """The fast path of a ``{"role", "content"}`` message with a string content: True when taken
        (an assistant content that may open with reasoning goes the full way)."""
        if type(content) is not str or (role == "assistant" and content[:1] in self.maybe_reasoning):
            return False
        if not content.isascii():
            check_text(content, self.path, self.line, (where if isinstance(where, str) else f"messages[{where}]")
                       + text_field)
        self.messages.append({"role": role, "content": content})
        self.fields.append(where)
        return True

    def add(self, message: dict, where: str, weight=None) -> None:
        self.plain = False
        if weight is not None:
            if weight not in (0, 1) or isinstance(weight, bool):
                raise self.error(f"'weight' must be 0 or 1, got {weight!r}", where + ".weight", "unknown_field")
            if weight == 0:
                self.untrained.add(len(self.messages))
        self.messages.append(message)
        self.fields.append(where)

    # ------------------------------------------------------------------ texts

    def text(self, value, where: str, required: bool = True) -> str:
        """A string field (or OpenAI text parts, joined by newlines), refused when it holds a lone
        surrogate; ``None`` is '' unless ``required``."""
        if value is None and not required:
            return ""
        if isinstance(value, list):
            return "\n".join(self.part(p, f"{where}[{i}]") for i, p in enumerate(value))
        if not isinstance(value, str):
            raise self.error(f"'{where}' must be a string or a list of text parts, got {type(value).__name__}",
                             where, "missing_key")
        return check_text(value, self.path, self.line, where)

    def part(self, part, where: str) -> str:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            what = f"a '{kind}' part" if isinstance(kind, str) else "not a text part"
            raise self.error(f"'{where}' is {what}: this run trains on text only", where, "unsupported_content",
                             "remove non-text parts (images, audio, files), or pass --skip-bad")
        extra = [k for k, v in part.items() if k not in ("type", "text") and v is not None]
        if extra:
            raise self.error(f"'{where}' has field '{extra[0]}' the run does not use", f"{where}.{extra[0]}",
                             "unknown_field")
        return check_text(part["text"], self.path, self.line, where + ".text")

    def count(self, rule: str, field: str) -> None:
        """Count ``field`` (``messages[3].name``) as ignored by ``rule``, as ``rule:messages[].name``."""
        if self.ignored is not None:
            name = f"{rule}:{_INDEX.sub('[]', field)}"
            self.ignored[name] = self.ignored.get(name, 0) + 1

    def unknown(self, message: dict, known: FrozenSet[str], where: str) -> None:
        for key, value in message.items():
            if key in known or value is None:
                continue
            if key in self.opts.ignore_fields:
                self.count("ignore-field", f"{where}.{key}")
                continue
            raise self.error(f"'{where}' has field '{key}' the run does not use", f"{where}.{key}",
                             "unknown_field", f"if '{key}' carries nothing the model should see, pass "
                             f"--ignore-field {key}; else fix the record or pass --skip-bad")

    # ------------------------------------------------------------------ reasoning

    def switch(self, message: dict, key: str, where: str) -> bool:
        """True when the reasoning field ``key`` of ``message`` holds a switch word, not reasoning
        (``"reasoning": "off"``, :data:`.keys.REASONING_SWITCHES`): read as the flag, counted as
        ``metadata:<field>``; never trained as the turn's reasoning."""
        value = message.get(key)
        if isinstance(value, str) and value.strip().lower() in REASONING_SWITCHES:
            self.count("metadata", f"{where}.{key}")
            return True
        return False

    def reasoning(self, message: dict, content: str, where: str, out: dict) -> str:
        """Move the message's reasoning (a field, or inline tags) to ``out['reasoning_content']``;
        returns the content without it. Whitespace-only reasoning is no reasoning, and a switch
        word (``"off"``) is the flag it says (:meth:`switch`)."""
        # a blank field is how columnar exports write an absent one: then inline tags are the reasoning
        given = [(k, message[k]) for k in REASONING_FIELDS if message.get(k) is not None
                 and not (isinstance(message[k], str) and not message[k].strip()) and not self.switch(message, k, where)]
        if len(given) > 1:
            raise self.error(f"'{where}' gives its reasoning twice ('{given[0][0]}' and '{given[1][0]}')",
                             f"{where}.{given[1][0]}", "unknown_field")
        opening, closing = self.opts.reasoning_tags
        split = split_inline_reasoning(content, opening, closing)
        if given:
            key, value = given[0]
            text = self.text(value, f"{where}.{key}")
            if split is not None and text.strip():
                raise self.error(f"'{where}' gives its reasoning twice ('{key}' and {opening} in the content)",
                                 f"{where}.{key}", "unknown_field")
            if text.strip():
                out["reasoning_content"] = text
                return content
        if split is not None:
            thought, answer = split
            if thought.strip():
                out["reasoning_content"] = thought
            self.inline[len(self.messages)] = content
            return answer
        return content

    # ------------------------------------------------------------------ tool calls and tools

    def tool_call(self, call, where: str) -> dict:
        self.calls.append(call)   # as given: the accounting reads its arguments itself
        if not isinstance(call, dict):
            raise self.error(f"'{where}' must be an object", where, "bad_tool_call")
        self.unknown(call, _TOOL_CALL_FIELDS, where)
        kind = call.get("type")
        if kind not in (None, "function"):
            raise self.error(f"'{where}' is a '{kind}' tool call; only function calls are supported", where + ".type",
                             "bad_tool_call")
        function = call.get("function", call)
        fwhere = where + ".function" if "function" in call else where
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise self.error(f"'{fwhere}' needs a function name", fwhere + ".name", "bad_tool_call")
        if function is not call:
            self.unknown(function, frozenset({"name", "arguments"}), fwhere)
        out = {"type": "function", "function": {"name": check_text(function["name"], self.path, self.line,
                                                                   fwhere + ".name"),
                                                "arguments": self.arguments(function.get("arguments"),
                                                                            fwhere + ".arguments")}}
        if call.get("id") is not None:
            out["id"] = self.text(call["id"], where + ".id")
        return out

    def arguments(self, value, where: str) -> dict:
        """A dict; a string must hold a JSON object (parsed, key order kept). Absent: ``{}``."""
        if value is None:
            return {}
        if isinstance(value, str):
            value = self.json_value(value, where, f"'{where}' is a string that is not JSON; tool-call arguments "
                                                  "must be a JSON object")
            if isinstance(value, str):
                value = self.decoded_twice(value, where)
        if not isinstance(value, dict):
            raise self.error(f"'{where}' must be a JSON object, got {type(value).__name__}", where, "bad_tool_call")
        text = None
        if self.nulls:
            nulls, text = may_hold_null(value)
            if nulls:
                value = drop_nulls(value)
        if not self.surrogate_free():
            check_json_texts(value, self.path, self.line, where, text)
        return value

    def decoded_twice(self, text: str, where: str) -> dict:
        """Arguments given as a JSON string whose value is itself a JSON string: the producer
        encoded the object twice (public function-calling samples do). Decoded once more when
        that gives an object, counted by rule and field; anything else is refused.

        Raises:
            InputError: the inner string is not JSON, or not an object (``bad_tool_call``).
        """
        value = self.json_value(text, where, f"'{where}' is a JSON string holding a string that is not JSON; "
                                             "tool-call arguments must be a JSON object")
        if not isinstance(value, dict):
            raise self.error(f"'{where}' is a JSON string holding a JSON {type(value).__name__}, not an object; "
                             "tool-call arguments must be a JSON object", where, "bad_tool_call")
        if self.ignored is not None:
            name = f"{DECODED_TWICE}:{_INDEX.sub('[]', where)}"
            self.ignored[name] = self.ignored.get(name, 0) + 1
        return value

    def tools(self, value, where: str) -> Optional[List[dict]]:
        """A tools list (or its JSON string), each entry as ``{"type": "function", "function": {...}}``;
        a key beside the definition in its wrapper is refused (``unknown_field``) unless
        ``--ignore-field`` names it (then dropped, counted)."""
        if not present(value):
            return None
        if isinstance(value, str):
            value = self.json_value(value, where, f"'{where}' is a string that is not JSON")
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list):
            raise self.error(f"'{where}' must be a list of tool definitions", where, "bad_tool_call")
        out = []
        for i, tool in enumerate(value):
            w = f"{where}[{i}]"
            text = None
            if self.nulls:
                nulls, text = may_hold_null(tool)
                if nulls:
                    tool = drop_nulls(tool)
            if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
                fn = tool["function"]
                if len(tool) > 2:   # a key beside the definition reaches the template too: refused or ignored
                    self.unknown(tool, _WRAPPER_FIELDS, w)
                    tool = {"type": "function", "function": fn}
            elif isinstance(tool, dict) and "type" not in tool and isinstance(tool.get("name"), str):
                fn = tool
                tool = {"type": "function", "function": fn}
            else:
                raise self.error(f"'{w}' is not a function definition (a 'name', or 'type': 'function' with a "
                                 "'function')", w, "bad_tool_call")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise self.error(f"'{w}' needs a function name", w + ".name", "bad_tool_call")
            if not self.surrogate_free():   # (the wrapper added only ASCII keys)
                check_json_texts(tool, self.path, self.line, w, text)
            out.append(tool)
        return out or None

    # ------------------------------------------------------------------ system prompt

    def system(self, record: dict, has_turn) -> None:
        """A record-level system prompt (:data:`SYSTEM_KEYS`) -> a first system message; refused
        beside a system turn (``has_turn()``, asked only when the record gives one: most records
        do not, and their turns are not walked for it) or another such key."""
        if record.keys().isdisjoint(SYSTEM_KEYS):
            return
        given = [k for k in SYSTEM_KEYS if present(record.get(k))]
        if not given:
            return
        key = given[0]
        if len(given) > 1:
            raise self.error(f"record has '{given[0]}' and '{given[1]}': keep one system prompt", given[1],
                             "ambiguous_record")
        if has_turn():
            raise self.error(f"record has a '{key}' field and a system turn: keep one", key, "ambiguous_record")
        self.add({"role": "system", "content": self.text(record[key], key)}, key)

    def function_call_value(self, value: str, where: str) -> List[dict]:
        """LLaMA-Factory's ``function_call`` value: JSON ``{"name", "arguments"}`` or a list of them."""
        calls = self.json_value(value, where, f"'{where}' is not JSON; a function_call turn holds {{\"name\", "
                                              "\"arguments\"}} or a list of them")
        calls = calls if isinstance(calls, list) else [calls]
        if not calls:
            raise self.error(f"'{where}' holds no function call", where, "bad_tool_call")
        return [self.tool_call(c, f"{where}[{j}]") for j, c in enumerate(calls)]
