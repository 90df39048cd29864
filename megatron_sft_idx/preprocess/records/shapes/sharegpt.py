"""Kind ``sharegpt``: LLaMA-Factory's ``{"conversations": [{"from", "value"}...], "system"?, "tools"?}``,
``function_call`` turns carrying tool calls."""

from __future__ import annotations

from .base import check_text, split_inline_reasoning, turns
from .conversation import Conversation
from .keys import SYSTEM_KEYS
from .mapper import Mapper

KIND = "sharegpt"
#: the record-level keys this shape reads
FIELDS = frozenset({"conversations", "tools"} | set(SYSTEM_KEYS))
#: ShareGPT ``from`` values (lower-cased) -> template roles; ``function_call`` turns carry tool calls.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool"}
_PLAIN_SHAREGPT = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_TURN_FIELDS = frozenset({"from", "value", "weight"})


def to_conversation(mapper: Mapper, record: dict) -> Conversation:
    """The record's turns (a record-level system prompt first) and its ``tools``.

    Raises:
        InputError: see :mod:`megatron_sft_idx.preprocess.records.shapes`.
    """
    conversations = turns(record.get("conversations"), mapper.path, mapper.line, "conversations")
    mapper.system(record, lambda: any(isinstance(t, dict) and str(t.get("from", "")).lower() == "system"
                                      for t in conversations))
    for i, t in enumerate(conversations):
        if type(t) is dict and len(t) == 2 and type(t.get("from")) is str:  # the common case, taken fast
            role = _PLAIN_SHAREGPT.get(t["from"])
            if role is not None and mapper.plain_text(role, t.get("value"), f"conversations[{i}]", ".value"):
                continue
        mapper.plain = False
        where = f"conversations[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
            raise mapper.error(f"{where} needs string 'from' and 'value'", where, "missing_key")
        mapper.unknown(t, _TURN_FIELDS, where)
        source = check_text(t["from"], mapper.path, mapper.line, where + ".from")
        role = SHAREGPT_ROLES.get(source.lower())
        if role is None:
            raise mapper.error(f"{where} is from '{source}', which no template vocabulary holds", where + ".from",
                               "unknown_role", f"ShareGPT roles are {', '.join(sorted(SHAREGPT_ROLES))}")
        value = mapper.text(t["value"], where + ".value")
        out = {"role": role}
        if source.lower() == "function_call":  # (LLaMA-Factory lets a thought block open the calls)
            split = split_inline_reasoning(value, *mapper.opts.reasoning_tags)
            if split is not None:
                thought, value = split
                if thought.strip():
                    out["reasoning_content"] = thought
            out["content"] = ""
            out["tool_calls"] = mapper.function_call_value(value, where + ".value")
        elif role == "assistant":
            out["content"] = mapper.reasoning({}, value, where, out)
        else:
            out["content"] = value
        mapper.add(out, where, t.get("weight"))
    return mapper.done(mapper.tools(record.get("tools"), "tools"), record.get("tools"))
