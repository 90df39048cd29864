"""Kind ``chat``: OpenAI / Hugging Face ``{"messages": [...], "tools"?, "functions"?, "system"?}``,
and the message of that vocabulary other shapes hold too (Nemotron's ``input``, TRL's
conversational prompt/completion)."""

from __future__ import annotations

from typing import Optional

from .base import check_text, turns
from .conversation import Conversation, SchemaOptions
from .keys import SYSTEM_KEYS
from .mapper import REASONING_FIELDS, Mapper

KIND = "chat"
#: the record-level keys this shape reads
FIELDS = frozenset({"messages", "tools", "functions"} | set(SYSTEM_KEYS))
#: OpenAI / Hugging Face roles -> template roles (``developer`` is OpenAI's newer ``system``;
#: ``function`` its legacy tool result; ``ipython`` Llama 3's name for a tool result).
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool", "function": "tool", "ipython": "tool"}
_PLAIN_CHAT = {"system": "system", "user": "user", "assistant": "assistant"}
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "function_call",
                             "weight"} | set(REASONING_FIELDS))


def as_conversation(value, path: str = "<messages>", line: int = 0,
                    opts: Optional[SchemaOptions] = None) -> Conversation:
    """A Conversation from itself, or from a list of OpenAI-style messages (mapped as a chat
    record's ``messages`` are).

    Raises:
        InputError: what :func:`.registry.map_record` refuses.
    """
    if isinstance(value, Conversation):
        return value
    return to_conversation(Mapper(path, line, opts or SchemaOptions()), {"messages": list(value)})


def to_conversation(mapper: Mapper, record: dict) -> Conversation:
    """The record's ``messages`` (a record-level system prompt first), its ``tools`` or OpenAI's
    legacy ``functions``.

    Raises:
        InputError: see :mod:`megatron_sft_idx.preprocess.records.shapes`.
    """
    messages = turns(record.get("messages"), mapper.path, mapper.line, "messages")
    mapper.system(record, lambda: any(isinstance(m, dict) and m.get("role") in ("system", "developer")
                                      for m in messages))
    out, fields, maybe = mapper.messages, mapper.fields, mapper.maybe_reasoning
    for i, m in enumerate(messages):
        if type(m) is dict and len(m) == 2:  # the common case, taken fast
            role, content = m.get("role"), m.get("content")
            if (type(role) is str and type(content) is str and content.isascii() and role in _PLAIN_CHAT
                    and (role != "assistant" or content[:1] not in maybe)):
                out.append({"role": role, "content": content})
                fields.append(i)
                continue
            role = _PLAIN_CHAT.get(role) if type(role) is str else None
            if role is not None and mapper.plain_text(role, content, i, ".content"):
                continue
        message(mapper, m, f"messages[{i}]")
    tools = mapper.tools(record.get("tools"), "tools")
    legacy = mapper.tools(record.get("functions"), "functions")
    if tools and legacy:
        raise mapper.error("record has both 'tools' and 'functions': keep one", "functions", "ambiguous_record")
    return mapper.done(tools or legacy, record.get("tools") if tools else record.get("functions"))


def message(mapper: Mapper, m, where: str) -> None:
    """One OpenAI-style message ``m`` (the field ``where``), mapped and added to ``mapper``.

    Raises:
        InputError: see :mod:`megatron_sft_idx.preprocess.records.shapes`.
    """
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise mapper.error(f"{where} needs a string 'role'", where, "missing_key")
    mapper.unknown(m, _MESSAGE_FIELDS, where)
    source = check_text(m["role"], mapper.path, mapper.line, where + ".role")
    role = CHAT_ROLES.get(source)
    if role is None:
        raise mapper.error(f"{where} has role '{source}', which no template vocabulary holds", where + ".role",
                           "unknown_role", f"roles are {', '.join(sorted(CHAT_ROLES))}; fix the record or "
                           "pass --skip-bad")
    calls = m.get("tool_calls")
    if m.get("function_call") is not None:
        if calls is not None:
            raise mapper.error(f"{where} has both 'tool_calls' and 'function_call'", where + ".function_call",
                               "ambiguous_record")
        calls = [{"type": "function", "function": m["function_call"]}]
    if calls is not None and role != "assistant":
        raise mapper.error(f"{where} is a '{source}' message with tool calls; only assistant messages make "
                           "them", where + ".tool_calls", "bad_tool_call")
    if m.get("content") is None and calls is None:
        raise mapper.error(f"{where} needs string 'role' and 'content' (content may be null only on an "
                           "assistant message with tool calls)", where + ".content", "missing_key")
    content = mapper.text(m.get("content"), where + ".content", required=False)
    out = {"role": role}
    if role == "assistant":
        content = mapper.reasoning(m, content, where, out)
    else:
        hit = next((k for k in REASONING_FIELDS if m.get(k) is not None and not mapper.switch(m, k, where)), None)
        if hit:
            raise mapper.error(f"{where} is a '{source}' message with '{hit}'; only assistant messages reason",
                               f"{where}.{hit}", "unknown_field")
    out["content"] = content
    if calls is not None:
        if not isinstance(calls, list) or not calls:
            raise mapper.error(f"'{where}.tool_calls' must be a non-empty list", where + ".tool_calls",
                               "bad_tool_call")
        out["tool_calls"] = [mapper.tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if m.get("tool_call_id") is not None:
        if role != "tool":
            raise mapper.error(f"{where} is a '{source}' message with 'tool_call_id'", where + ".tool_call_id",
                               "unknown_field")
        out["tool_call_id"] = mapper.text(m["tool_call_id"], where + ".tool_call_id")
    if m.get("name") is not None and "name" in mapper.opts.ignore_fields and source != "function":
        mapper.count("ignore-field", where + ".name")   # (dropped: the rendering never sees it)
    elif m.get("name") is not None:
        out["name"] = mapper.text(m["name"], where + ".name")
    elif source == "function":
        raise mapper.error(f"{where} is a legacy 'function' result without 'name'", where + ".name", "missing_key")
    mapper.add(out, where, m.get("weight"))
