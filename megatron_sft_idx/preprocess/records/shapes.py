"""Input shapes -> the chat template's message vocabulary, and what is refused (``docs/INPUTS.md``).

Every record kind is mapped here, once, into a :class:`Conversation` in Hugging Face
chat-template conventions, which public templates consume:

* roles ``system | user | assistant | tool``;
* assistant tool calls as ``tool_calls=[{"type": "function", "function": {"name", "arguments"}, "id"?}]``
  with ``arguments`` a dict (a JSON-object string is parsed; anything else is refused);
* tool results as ``{"role": "tool", "content", "tool_call_id"?, "name"?}``;
* a top-level ``tools`` list of ``{"type": "function", "function": {...}}`` (bare function schemas,
  as LLaMA-Factory's ShareGPT ``tools`` and OpenAI's legacy ``functions`` hold them, are wrapped);
* reasoning as ``reasoning_content`` (from ``reasoning_content`` / ``reasoning`` / ``thinking``, or
  written inline as ``<think>...</think>`` at the start of the content, or of a ShareGPT
  ``function_call`` value as LLaMA-Factory allows); where it goes in the rendering is decided
  per template by :mod:`.rendering`.

============  ================================================================================
kind          record
============  ================================================================================
chat          ``{"messages": [...], "tools"?, "functions"?, "system"?}`` (OpenAI / Hugging Face)
sharegpt      ``{"conversations": [{"from", "value"}...], "system"?, "tools"?}`` (LLaMA-Factory)
alpaca        ``{"instruction", "input"?, "output", "system"?, "history"?, "tools"?}``
xlam          ``{"query", "answers", "tools"}`` (xLAM / APIGen function calling: the calls and tools as
              JSON strings or lists)
prompt        ``{PROMPT_KEY, COMPLETION_KEY}``: strings, or lists of messages (TRL conversational)
tokens        ``{"input_ids", "loss_mask" | "answer_start_idx"}``
============  ================================================================================

Nothing is dropped silently: a role, a message field, a content part or a tool call the run
cannot represent is an :class:`InputError` naming ``file:line`` and the field (a counted skip
under ``--skip-bad``). Record-level keys no shape uses (``id``, ``source``, ...) are metadata
and ignored; message-level keys are not (``--ignore-field NAME`` says one carries nothing the
model should see). ``None`` values count as absent (Parquet and Arrow rows hold every struct field).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Tuple

from ...errors import MetadataError, MetadataLimitError
from ...jsondoc import parse_record_json
from .errors import input_error

KINDS = ("chat", "sharegpt", "alpaca", "xlam", "nemotron", "prompt", "tokens")
REASONING_TAGS = ("<think>", "</think>")

#: OpenAI / Hugging Face roles -> template roles (``developer`` is OpenAI's newer ``system``;
#: ``function`` its legacy tool result; ``ipython`` Llama 3's name for a tool result).
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool", "function": "tool", "ipython": "tool"}
#: ShareGPT ``from`` values (lower-cased) -> template roles; ``function_call`` turns carry tool calls.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool"}
_PLAIN_CHAT = {"system": "system", "user": "user", "assistant": "assistant"}
_PLAIN_SHAREGPT = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_WHITESPACE_STARTS = frozenset(" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                               + "".join(chr(c) for c in range(0x2000, 0x200B)))
_REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "function_call",
                             "weight"} | set(_REASONING_FIELDS))
_TURN_FIELDS = frozenset({"from", "value", "weight"})
_TEXT_PARTS = ("text", "input_text", "output_text")
_INDEX = re.compile(r"\[\d+\]")
_TOOL_CALL_FIELDS = frozenset({"id", "type", "function", "name", "arguments", "index"})
#: the keys that mark the other shapes (each entry: keys that together mark one; the last one is
#: named): a record holding them beside its own is ambiguous, not metadata
_XLAM_KEYS = ("query", "answers")
_SHAPE_KEYS = {"chat": (("conversations",), ("instruction",), ("history",), _XLAM_KEYS),
               "sharegpt": (("messages",), ("instruction",), ("history",), _XLAM_KEYS),
               "alpaca": (("messages",), ("conversations",), _XLAM_KEYS),
               "xlam": (("messages",), ("conversations",), ("instruction",)),
               "nemotron": (("messages",), ("conversations",), ("instruction",), _XLAM_KEYS)}
#: record-level keys that hold a system prompt, in the order they are looked for (Llama-Nemotron's
#: post-training data and OpenHermes name it ``system_prompt``); a record may give one of them
SYSTEM_KEYS = ("system", "system_prompt")
#: the record-level keys each shape reads (beside these, a key is metadata, ignored by a named rule,
#: or refused: see :func:`account_keys`)
SHAPE_FIELDS = {"chat": frozenset({"messages", "tools", "functions"} | set(SYSTEM_KEYS)),
                "sharegpt": frozenset({"conversations", "tools"} | set(SYSTEM_KEYS)),
                "alpaca": frozenset({"instruction", "input", "output", "history", "tools"} | set(SYSTEM_KEYS)),
                "xlam": frozenset({"query", "answers", "tools"}),
                "nemotron": frozenset({"input", "output", "tools"} | set(SYSTEM_KEYS)),
                "tokens": frozenset({"input_ids", "loss_mask", "answer_start_idx"})}
#: record-level keys documented as metadata (docs/INPUTS.md): ignored, and counted by name in the
#: summary. Public SFT sets carry these beside the conversation (ids, provenance, licences,
#: Llama-Nemotron's ``category``/``generator``/``used_in_training``/``version`` and its
#: ``reasoning: "on" | "off"`` flag, which the system prompt states to the model).
METADATA_KEYS = frozenset({
    "id", "idx", "uuid", "conversation_id", "conv_id", "sample_id", "source", "sources", "dataset", "subset",
    "split", "category", "categories", "task", "task_type", "tags", "license", "lang", "language", "generator",
    "model", "models", "used_in_training", "version", "url", "hash", "timestamp", "created_at",
    "score", "scores", "quality", "rating", "difficulty", "num_turns", "length", "domain", "topic",
    "metadata", "meta"})
#: record-level flags that are metadata only with one of these values (Llama-Nemotron's
#: ``reasoning: "on" | "off"``); with other text they are refused like any unknown key
METADATA_FLAGS = {"reasoning": frozenset({"on", "off"})}
#: the rules a record-level key is ignored by (the summary counts ``rule:key``)
IGNORE_RULES = ("metadata", "ignore-field", "no-text")
#: rules that read a value in a second documented form, counted like the ignore rules (as
#: ``rule:field``) and reported apart (the summary's ``rules_applied``): tool-call arguments given
#: as a JSON string of a JSON string of an object, as public function-calling samples ship them,
#: decoded one level more (docs/INPUTS.md)
DECODED_TWICE = "decoded-twice"
APPLIED_RULES = (DECODED_TWICE,)


@dataclass
class Conversation:
    """One conversation in the template's vocabulary, plus what the loss policy needs.

    ``messages`` hold only the keys that are set (templates test ``'tool_calls' in message``).
    ``fields`` name each message's source (``conversations[3]``, ``input``) for errors;
    ``untrained`` are messages the producer excluded from the loss (``weight: 0``, the prompt of a
    conversational prompt/completion record); ``inline`` maps an assistant message whose content
    opened with a reasoning block (even an empty one) to its content as written; ``rendered`` is
    set by :func:`.rendering.adapt`.
    """

    messages: List[dict]
    tools: Optional[List[dict]] = None
    fields: List = field(default_factory=list)   # a name, or an int i for "messages[i]" (formatted when needed)
    untrained: FrozenSet[int] = frozenset()
    inline: Dict[int, str] = field(default_factory=dict)
    rendered: Optional[List[dict]] = None   # the messages as the template is given them (rendering.adapt)
    plain: bool = False                     # every message is {"role", "content"} as given: nothing to adapt
    source_tools: object = None             # the record's tools value as given (accounting.check_rendered_tools)
    source_calls: tuple = ()                # each tool call as the record gives it (accounting.check_rendered_tools)

    @property
    def template_messages(self) -> List[dict]:
        return self.messages if self.rendered is None else self.rendered

    def where(self, k: int) -> str:
        """The source field of message ``k`` (``conversations[3]``, ``input``, ``messages[2]``)."""
        f = self.fields[k] if k < len(self.fields) else k
        return f if isinstance(f, str) else f"messages[{f}]"

    def cut(self, k: int) -> "Conversation":
        """The conversation up to and including message ``k``."""
        return Conversation(self.messages[:k + 1], self.tools, self.fields[:k + 1],
                            frozenset(i for i in self.untrained if i <= k),
                            {i: c for i, c in self.inline.items() if i <= k},
                            None if self.rendered is None else self.rendered[:k + 1], self.plain, self.source_tools,
                            self.source_calls)


@dataclass(frozen=True)
class SchemaOptions:
    """What the mapping needs from the run's settings."""

    prompt_key: str = "prompt"
    completion_key: str = "completion"
    prompt_format: str = "chat"          # chat | raw: how prompt/completion strings are encoded
    ignore_fields: Tuple[str, ...] = ()  # message fields that carry nothing the model should see
    reasoning_tags: Tuple[str, str] = REASONING_TAGS


@functools.lru_cache(maxsize=8)
def _maybe_reasoning(opening: str) -> FrozenSet[str]:
    """First characters of a content that may open with a reasoning block (whitespace, the tag's)."""
    return _WHITESPACE_STARTS | {opening[:1]}


def as_conversation(value, path: str = "<messages>", line: int = 0,
                    opts: Optional[SchemaOptions] = None) -> Conversation:
    """A Conversation from itself, or from a list of OpenAI-style messages (mapped as a chat
    record's ``messages`` are).

    Raises:
        InputError: what :func:`map_record` refuses.
    """
    if isinstance(value, Conversation):
        return value
    return _Mapper(path, line, opts or SchemaOptions()).chat({"messages": list(value)})


def detect(record: dict, prompt_key: str) -> Optional[str]:
    """The kind of ``record`` by its keys (``--input-format auto``), or None."""
    for key, kind in (("messages", "chat"), ("conversations", "sharegpt"), ("input_ids", "tokens"),
                      (prompt_key, "prompt"), ("instruction", "alpaca")):
        if key in record:
            return kind
    if all(k in record for k in _XLAM_KEYS):
        return "xlam"
    if isinstance(record.get("input"), list) and "output" in record:
        return "nemotron"
    return None


def map_record(kind: str, record: dict, path: str, line: int, opts: SchemaOptions, detected: bool = False,
               ignored: Optional[Dict[str, int]] = None, nulls: bool = True):
    """``(kind, payload)``: ``("chat", Conversation)``, ``("prompt", (prompt, completion))`` for a
    raw prompt/completion, or ``("tokens", (input_ids, loss_mask, answer_start_idx))``. A ``detected``
    kind (``--input-format auto``) is refused when the record also holds another shape's keys.
    Every record-level key is accounted for (:func:`account_keys`); ``ignored`` counts, per
    ``rule:key``, the keys ignored by a rule. ``nulls=False`` says the record holds no null
    (its JSON text has no ``null``), so none is looked for.

    Raises:
        InputError: see the module docstring; ``reason`` is the skip-count key.
    """
    m = _Mapper(path, line, opts, ignored)
    m.nulls = nulls
    # (a kind named by --input-format is the user's choice; only a detected one can be ambiguous)
    if detected and kind in _SHAPE_KEYS and any(keys[-1] in record for keys in _SHAPE_KEYS[kind]):
        other = [keys[-1] for keys in _SHAPE_KEYS[kind] if all(_present(record.get(k)) for k in keys)]
        if other:
            raise m.error(f"record holds '{other[0]}' beside the {kind} shape's keys: which one is meant?",
                          other[0], "ambiguous_record", "give each record one shape (--input-format names it)")
    if kind != "prompt":  # (a prompt record's keys are accounted for by Mapper.prompt, which names them)
        account_keys(record, SHAPE_FIELDS[kind], opts, path, line, ignored)
    if kind == "chat":
        return "chat", m.chat(record)
    if kind == "sharegpt":
        return "chat", m.sharegpt(record)
    if kind == "alpaca":
        return "chat", m.alpaca(record)
    if kind == "xlam":
        return "chat", m.xlam(record)
    if kind == "nemotron":
        return "chat", m.nemotron(record)
    if kind == "tokens":
        return "tokens", token_record(record, path, line)
    kind, payload = m.prompt(record)
    account_keys(record, frozenset({opts.prompt_key, opts.completion_key}), opts, path, line, ignored)
    return kind, payload


def _present(value) -> bool:
    return value is not None and value != "" and value != [] and value != {}


def _holds_text(value) -> bool:
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


def ignore_rule(key: str, value, opts: SchemaOptions) -> Optional[str]:
    """The rule a record-level key outside its shape is ignored by (:data:`IGNORE_RULES`), or None
    when none covers it: it holds text, and dropping it would lose what the producer wrote."""
    if key in opts.ignore_fields:
        return "ignore-field"
    if key in METADATA_KEYS or (key in METADATA_FLAGS and isinstance(value, str)
                                and value.lower() in METADATA_FLAGS[key]):
        return "metadata"
    return None if _holds_text(value) else "no-text"


def account_keys(record: dict, used: FrozenSet[str], opts: SchemaOptions, path: str, line: int,
                 ignored: Optional[Dict[str, int]]) -> None:
    """Account for every record-level key: read by the shape (``used``), absent (``null``, empty),
    or ignored by a named rule -- documented metadata, ``--ignore-field``, holding no text -- and
    counted in ``ignored`` as ``rule:key``.

    Raises:
        InputError: a key holding text that no rule covers (``unknown_field``), naming it.
    """
    for key, value in record.items():
        if key in used or not _present(value) or not _present(drop_nulls(value)):
            continue
        rule = ignore_rule(key, value, opts)
        if rule is None:
            raise input_error(f"record-level key '{key}' holds text the run does not use", path, line, field=key,
                              reason="unknown_field",
                              hint=f"if '{key}' carries nothing the model should see, pass --ignore-field {key} "
                                   "(it is counted in the summary); else map it into the conversation, or pass "
                                   "--skip-bad")
        if ignored is not None:
            name = f"{rule}:{key}"
            ignored[name] = ignored.get(name, 0) + 1


def _may_hold_null(value) -> Tuple[bool, Optional[str]]:
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


class _Mapper:
    """The mapping of one record (keeps ``path:line`` for its errors)."""

    def __init__(self, path: str, line: int, opts: SchemaOptions, ignored: Optional[Dict[str, int]] = None) -> None:
        self.path, self.line, self.opts = path, line, opts
        self.ignored = ignored   # counts of fields ignored by --ignore-field, as "ignore-field:messages[].id"
        self.nulls = True        # the record may hold a null (False: its JSON text has none)
        self.maybe_reasoning = _maybe_reasoning(opts.reasoning_tags[0])
        self.messages: List[dict] = []
        self.fields: list = []
        self.untrained: set = set()
        self.inline: Dict[int, str] = {}
        self.plain = True   # every message so far was taken by a fast path as {"role", "content"}
        self.calls: list = []   # each tool call as the record gives it, before any mapping

    def error(self, message: str, where: Optional[str], reason: str, hint: Optional[str] = None):
        return input_error(message, self.path, self.line, field=where, reason=reason,
                           hint=hint or "fix the record, or pass --skip-bad to skip and count such records")

    def json_value(self, text: str, where: str, not_json: str):
        """The JSON value a string of the record holds (tool-call arguments, a tools list, xLAM
        answers), within the record limits (:func:`~megatron_sft_idx.jsondoc.parse_record_json`).

        Raises:
            InputError: ``not_json`` (reason ``bad_tool_call``) for text that is not JSON;
                reason ``json_too_deep`` for JSON beyond the limits.
        """
        try:
            return parse_record_json(text, what=where)
        except MetadataLimitError as exc:
            raise self.error(f"'{where}' holds JSON beyond the record limits ({exc.detail})",
                             where, "json_too_deep" if exc.limit == "depth" else "bad_tool_call") from None
        except MetadataError:
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

    def unknown(self, message: dict, known: FrozenSet[str], where: str) -> None:
        for key, value in message.items():
            if key in known or value is None:
                continue
            if key in self.opts.ignore_fields:
                if self.ignored is not None:
                    name = f"ignore-field:{_INDEX.sub('[]', where)}.{key}"
                    self.ignored[name] = self.ignored.get(name, 0) + 1
                continue
            raise self.error(f"'{where}' has field '{key}' the run does not use", f"{where}.{key}",
                             "unknown_field", f"if '{key}' carries nothing the model should see, pass "
                             f"--ignore-field {key}; else fix the record or pass --skip-bad")

    # ------------------------------------------------------------------ reasoning

    def reasoning(self, message: dict, content: str, where: str, out: dict) -> str:
        """Move the message's reasoning (a field, or inline tags) to ``out['reasoning_content']``;
        returns the content without it. Whitespace-only reasoning is no reasoning."""
        # a blank field is how columnar exports write an absent one: then inline tags are the reasoning
        given = [(k, message[k]) for k in _REASONING_FIELDS if message.get(k) is not None
                 and not (isinstance(message[k], str) and not message[k].strip())]
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
            nulls, text = _may_hold_null(value)
            if nulls:
                value = drop_nulls(value)
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
        """A tools list (or its JSON string), each entry as ``{"type": "function", "function": {...}}``."""
        if not _present(value):
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
                nulls, text = _may_hold_null(tool)
                if nulls:
                    tool = drop_nulls(tool)
            if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
                fn = tool["function"]
            elif isinstance(tool, dict) and "type" not in tool and isinstance(tool.get("name"), str):
                fn = tool
                tool = {"type": "function", "function": fn}
            else:
                raise self.error(f"'{w}' is not a function definition (a 'name', or 'type': 'function' with a "
                                 "'function')", w, "bad_tool_call")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise self.error(f"'{w}' needs a function name", w + ".name", "bad_tool_call")
            check_json_texts(tool, self.path, self.line, w, text)   # (the wrapper added only ASCII keys)
            out.append(tool)
        return out or None

    # ------------------------------------------------------------------ shapes

    def system(self, record: dict, has_turn: bool) -> None:
        """A record-level system prompt (:data:`SYSTEM_KEYS`) -> a first system message; refused
        beside a system turn (``has_turn``) or another such key."""
        given = [k for k in SYSTEM_KEYS if _present(record.get(k))]
        if not given:
            return
        key = given[0]
        if len(given) > 1:
            raise self.error(f"record has '{given[0]}' and '{given[1]}': keep one system prompt", given[1],
                             "ambiguous_record")
        if has_turn:
            raise self.error(f"record has a '{key}' field and a system turn: keep one", key, "ambiguous_record")
        self.add({"role": "system", "content": self.text(record[key], key)}, key)

    def chat(self, record: dict) -> Conversation:
        messages = turns(record.get("messages"), self.path, self.line, "messages")
        self.system(record, any(isinstance(m, dict) and m.get("role") in ("system", "developer") for m in messages))
        out, fields, maybe = self.messages, self.fields, self.maybe_reasoning
        for i, m in enumerate(messages):
            if type(m) is dict and len(m) == 2:  # the common case, taken fast
                role, content = m.get("role"), m.get("content")
                if (type(role) is str and type(content) is str and content.isascii() and role in _PLAIN_CHAT
                        and (role != "assistant" or content[:1] not in maybe)):
                    out.append({"role": role, "content": content})
                    fields.append(i)
                    continue
                role = _PLAIN_CHAT.get(role) if type(role) is str else None
                if role is not None and self.plain_text(role, content, i, ".content"):
                    continue
            self.chat_message(m, f"messages[{i}]")
        tools = self.tools(record.get("tools"), "tools")
        legacy = self.tools(record.get("functions"), "functions")
        if tools and legacy:
            raise self.error("record has both 'tools' and 'functions': keep one", "functions", "ambiguous_record")
        return self.done(tools or legacy, record.get("tools") if tools else record.get("functions"))

    def chat_message(self, m, where: str) -> None:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise self.error(f"{where} needs a string 'role'", where, "missing_key")
        self.unknown(m, _MESSAGE_FIELDS, where)
        source = check_text(m["role"], self.path, self.line, where + ".role")
        role = CHAT_ROLES.get(source)
        if role is None:
            raise self.error(f"{where} has role '{source}', which no template vocabulary holds", where + ".role",
                             "unknown_role", f"roles are {', '.join(sorted(CHAT_ROLES))}; fix the record or "
                             "pass --skip-bad")
        calls = m.get("tool_calls")
        if m.get("function_call") is not None:
            if calls is not None:
                raise self.error(f"{where} has both 'tool_calls' and 'function_call'", where + ".function_call",
                                 "ambiguous_record")
            calls = [{"type": "function", "function": m["function_call"]}]
        if calls is not None and role != "assistant":
            raise self.error(f"{where} is a '{source}' message with tool calls; only assistant messages make "
                             "them", where + ".tool_calls", "bad_tool_call")
        if m.get("content") is None and calls is None:
            raise self.error(f"{where} needs string 'role' and 'content' (content may be null only on an "
                             "assistant message with tool calls)", where + ".content", "missing_key")
        content = self.text(m.get("content"), where + ".content", required=False)
        out = {"role": role}
        if role == "assistant":
            content = self.reasoning(m, content, where, out)
        else:
            hit = next((k for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if hit:
                raise self.error(f"{where} is a '{source}' message with '{hit}'; only assistant messages reason",
                                 f"{where}.{hit}", "unknown_field")
        out["content"] = content
        if calls is not None:
            if not isinstance(calls, list) or not calls:
                raise self.error(f"'{where}.tool_calls' must be a non-empty list", where + ".tool_calls",
                                 "bad_tool_call")
            out["tool_calls"] = [self.tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if m.get("tool_call_id") is not None:
            if role != "tool":
                raise self.error(f"{where} is a '{source}' message with 'tool_call_id'", where + ".tool_call_id",
                                 "unknown_field")
            out["tool_call_id"] = self.text(m["tool_call_id"], where + ".tool_call_id")
        if m.get("name") is not None:
            out["name"] = self.text(m["name"], where + ".name")
        elif source == "function":
            raise self.error(f"{where} is a legacy 'function' result without 'name'", where + ".name", "missing_key")
        self.add(out, where, m.get("weight"))

    def sharegpt(self, record: dict) -> Conversation:
        conversations = turns(record.get("conversations"), self.path, self.line, "conversations")
        self.system(record, any(isinstance(t, dict) and str(t.get("from", "")).lower() == "system"
                                for t in conversations))
        for i, t in enumerate(conversations):
            if type(t) is dict and len(t) == 2 and type(t.get("from")) is str:  # the common case, taken fast
                role = _PLAIN_SHAREGPT.get(t["from"])
                if role is not None and self.plain_text(role, t.get("value"), f"conversations[{i}]", ".value"):
                    continue
            self.plain = False
            where = f"conversations[{i}]"
            if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
                raise self.error(f"{where} needs string 'from' and 'value'", where, "missing_key")
            self.unknown(t, _TURN_FIELDS, where)
            source = check_text(t["from"], self.path, self.line, where + ".from")
            role = SHAREGPT_ROLES.get(source.lower())
            if role is None:
                raise self.error(f"{where} is from '{source}', which no template vocabulary holds", where + ".from",
                                 "unknown_role", f"ShareGPT roles are {', '.join(sorted(SHAREGPT_ROLES))}")
            value = self.text(t["value"], where + ".value")
            out = {"role": role}
            if source.lower() == "function_call":  # (LLaMA-Factory lets a thought block open the calls)
                split = split_inline_reasoning(value, *self.opts.reasoning_tags)
                if split is not None:
                    thought, value = split
                    if thought.strip():
                        out["reasoning_content"] = thought
                out["content"] = ""
                out["tool_calls"] = self.function_call_value(value, where + ".value")
            elif role == "assistant":
                out["content"] = self.reasoning({}, value, where, out)
            else:
                out["content"] = value
            self.add(out, where, t.get("weight"))
        return self.done(self.tools(record.get("tools"), "tools"), record.get("tools"))

    def function_call_value(self, value: str, where: str) -> List[dict]:
        """LLaMA-Factory's ``function_call`` value: JSON ``{"name", "arguments"}`` or a list of them."""
        calls = self.json_value(value, where, f"'{where}' is not JSON; a function_call turn holds {{\"name\", "
                                              "\"arguments\"}} or a list of them")
        calls = calls if isinstance(calls, list) else [calls]
        if not calls:
            raise self.error(f"'{where}' holds no function call", where, "bad_tool_call")
        return [self.tool_call(c, f"{where}[{j}]") for j, c in enumerate(calls)]

    def xlam(self, record: dict) -> Conversation:
        """xLAM / APIGen function calling (Salesforce's ``xlam-function-calling-60k``): ``query``
        is the user's request, ``answers`` the assistant's calls (``[{"name", "arguments"}...]``,
        a JSON string as published, or a list), ``tools`` the functions offered (bare schemas,
        wrapped as the other shapes' are). A record without calls is refused: xLAM has no reply text."""
        self.add({"role": "user", "content": self.text(record.get("query"), "query")}, "query")
        answers = record.get("answers")
        if isinstance(answers, str):
            calls = self.function_call_value(answers, "answers")
        elif isinstance(answers, list) and answers:
            calls = [self.tool_call(c, f"answers[{j}]") for j, c in enumerate(answers)]
        else:
            raise self.error("'answers' holds no function call (a JSON list of {\"name\", \"arguments\"})",
                             "answers", "bad_tool_call")
        self.add({"role": "assistant", "content": "", "tool_calls": calls}, "answers")
        return self.done(self.tools(record.get("tools"), "tools"), record.get("tools"))

    def alpaca(self, record: dict) -> Conversation:
        """Stanford / LLaMA-Factory Alpaca: system, history pairs, then instruction and input joined by
        a newline as the user turn (LLaMA-Factory's joiner), output as the assistant turn."""
        self.system(record, False)
        history = record.get("history")
        if _present(history):
            if not isinstance(history, list):
                raise self.error("'history' must be a list of [instruction, response] pairs", "history",
                                 "missing_key")
            for i, pair in enumerate(history):
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise self.error(f"'history[{i}]' must be an [instruction, response] pair", f"history[{i}]",
                                     "missing_key")
                self.add({"role": "user", "content": self.text(pair[0], f"history[{i}][0]")}, f"history[{i}][0]")
                reply = {"role": "assistant"}
                reply["content"] = self.reasoning({}, self.text(pair[1], f"history[{i}][1]"), f"history[{i}][1]",
                                                  reply)
                self.add(reply, f"history[{i}][1]")
        instruction = self.text(record.get("instruction"), "instruction", required=False)
        extra = self.text(record.get("input"), "input", required=False)
        query = "\n".join(t for t in (instruction, extra) if t)
        if not query:
            raise self.error("'instruction' and 'input' are both empty", "instruction", "empty_conversation")
        self.add({"role": "user", "content": query}, "input" if extra and not instruction else "instruction")
        if not isinstance(record.get("output"), str):
            raise self.error("'output' must be a string", "output", "missing_key")
        output = self.text(record["output"], "output")
        if not output.strip():
            raise self.error("empty output", "output", "empty_conversation")
        reply = {"role": "assistant"}
        reply["content"] = self.reasoning({}, output, "output", reply)
        self.add(reply, "output")
        return self.done(self.tools(record.get("tools"), "tools"), record.get("tools"))

    def nemotron(self, record: dict) -> Conversation:
        """Llama-Nemotron's post-training rows: ``input`` the prompt's messages (``user`` /
        ``assistant``; never trained, as a conversational prompt/completion's prompt), ``output`` the
        reply (its reasoning inline in ``<think>`` tags, trained by the reasoning policy), the system
        prompt (``detailed thinking on``) in ``system_prompt``."""
        messages = turns(record.get("input"), self.path, self.line, "input")
        self.system(record, any(isinstance(m, dict) and m.get("role") in ("system", "developer") for m in messages))
        for i, m in enumerate(messages):
            self.chat_message(m, f"input[{i}]")
        self.untrained.update(range(len(self.messages)))
        if not isinstance(record.get("output"), str):
            raise self.error("'output' must be a string (the reply)", "output", "missing_key")
        output = self.text(record["output"], "output")
        reply = {"role": "assistant"}
        reply["content"] = self.reasoning({}, output, "output", reply)
        if not reply["content"].strip() and "reasoning_content" not in reply:
            raise self.error("empty output", "output", "empty_conversation")
        self.add(reply, "output")
        return self.done(self.tools(record.get("tools"), "tools"), record.get("tools"))

    def prompt(self, record: dict):
        o = self.opts
        for key in ("input", "history", "system", "system_prompt", "output"):
            if key not in (o.prompt_key, o.completion_key) and _present(record.get(key)):
                raise self.error(f"'{key}' has no place in a prompt/completion record and would be lost",
                                 key, "unknown_field", "for Alpaca records (instruction/input/output) pass "
                                 "--input-format alpaca, or auto without --prompt-key/--completion-key")
        for key in (o.prompt_key, o.completion_key):
            if key not in record or record[key] is None:
                raise self.error(f"missing key '{key}'", key, "missing_key")
        prompt, completion = record[o.prompt_key], record[o.completion_key]
        if isinstance(prompt, list) or isinstance(completion, list):  # TRL's conversational form
            return "chat", self.conversational_prompt(prompt, completion)
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise self.error(f"'{o.prompt_key}' and '{o.completion_key}' must be strings (or lists of messages)",
                             o.prompt_key, "missing_key")
        prompt = check_text(prompt, self.path, self.line, o.prompt_key)
        completion = check_text(completion, self.path, self.line, o.completion_key)
        if not completion:
            raise self.error("empty completion", o.completion_key, "empty_conversation")
        if o.prompt_format == "raw":
            return "prompt", (prompt, completion)
        self.add({"role": "user", "content": prompt}, o.prompt_key)
        self.add({"role": "assistant", "content": completion}, o.completion_key)
        return "chat", self.done(None)

    def conversational_prompt(self, prompt, completion) -> Conversation:
        o = self.opts
        if self.opts.prompt_format == "raw":
            raise self.error("a prompt/completion of messages needs a chat template (--prompt-format chat)",
                             o.prompt_key, "missing_key")
        for key, value in ((o.prompt_key, prompt), (o.completion_key, completion)):
            if not isinstance(value, list):
                raise self.error(f"'{key}' must be a list of messages like the other one", key, "missing_key")
        for i, m in enumerate(prompt):
            self.chat_message(m, f"{o.prompt_key}[{i}]")
        self.untrained.update(range(len(self.messages)))  # TRL trains the completion only
        for i, m in enumerate(completion):
            self.chat_message(m, f"{o.completion_key}[{i}]")
        if not any(m["role"] == "assistant" for m in self.messages[len(prompt):]):
            raise self.error(f"'{o.completion_key}' holds no assistant message", o.completion_key,
                             "empty_conversation")
        return self.done(None)


def turns(value, path: str, line: int, key: str) -> list:
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


def token_record(record: dict, path: str, line: int):
    """Pre-tokenized record -> ``(input_ids, loss_mask or None, answer_start_idx or None)``."""
    if "input_ids" not in record:
        raise input_error("missing key 'input_ids'", path, line, field="input_ids", reason="missing_key")
    ids = record["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise input_error("'input_ids' must be a non-empty list of integers", path, line,
                          field="input_ids", reason="missing_key")
    mask = record.get("loss_mask")
    start = record.get("answer_start_idx")
    if mask is None and start is None:
        raise input_error("pre-tokenized record needs 'loss_mask' or 'answer_start_idx'", path, line,
                          field="loss_mask", reason="missing_key")
    if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids)):
        raise input_error(f"'loss_mask' must be a list as long as 'input_ids' ({len(ids)})", path, line,
                          field="loss_mask", reason="missing_key")
    if mask is None and (not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < len(ids)):
        raise input_error(f"'answer_start_idx' must be an integer in [0, {len(ids)})", path, line,
                          field="answer_start_idx", reason="missing_key")
    return ids, mask, start
