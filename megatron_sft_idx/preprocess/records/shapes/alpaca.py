"""Kind ``alpaca``: Stanford / LLaMA-Factory ``{"instruction", "input"?, "output", "system"?,
"history"?, "tools"?}``, and the Alpaca-like sets that name two of its keys otherwise: the reply
``response`` (GPTeacher, Databricks Dolly), the input ``context`` (Dolly)."""

from __future__ import annotations

from .base import present
from .conversation import Conversation
from .keys import SYSTEM_KEYS
from .mapper import Mapper

KIND = "alpaca"
#: the keys that may hold the reply (a record gives one): Stanford's and LLaMA-Factory's ``output``,
#: GPTeacher's and Dolly's ``response``
REPLY_KEYS = ("output", "response")
#: the keys that may hold the input joined to the instruction (a record gives one at most): ``input``,
#: Dolly's ``context``
INPUT_KEYS = ("input", "context")
#: the record-level keys this shape reads
FIELDS = frozenset({"instruction", "history", "tools", *REPLY_KEYS, *INPUT_KEYS} | set(SYSTEM_KEYS))


def _key(mapper: Mapper, record: dict, keys) -> str:
    """The one of ``keys`` the record gives (the first when none is).

    Raises:
        InputError: two of them (``ambiguous_record``): which one is meant?
    """
    given = [k for k in keys if present(record.get(k))]
    if len(given) > 1:
        raise mapper.error(f"record holds both '{given[0]}' and '{given[1]}': which one is meant?", given[1],
                           "ambiguous_record", f"give each record one of {', '.join(keys)}, or --ignore-field "
                           f"the other")
    return given[0] if given else keys[0]


def to_conversation(mapper: Mapper, record: dict) -> Conversation:
    """Stanford / LLaMA-Factory Alpaca: system, history pairs, then instruction and input (or
    ``context``) joined by a newline as the user turn (LLaMA-Factory's joiner), output (or
    ``response``) as the assistant turn.

    Raises:
        InputError: see :mod:`megatron_sft_idx.preprocess.records.shapes`.
    """
    mapper.system(record, lambda: False)
    history = record.get("history")
    if present(history):
        if not isinstance(history, list):
            raise mapper.error("'history' must be a list of [instruction, response] pairs", "history",
                               "missing_key")
        for i, pair in enumerate(history):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise mapper.error(f"'history[{i}]' must be an [instruction, response] pair", f"history[{i}]",
                                   "missing_key")
            mapper.add({"role": "user", "content": mapper.text(pair[0], f"history[{i}][0]")}, f"history[{i}][0]")
            reply = {"role": "assistant"}
            reply["content"] = mapper.reasoning({}, mapper.text(pair[1], f"history[{i}][1]"), f"history[{i}][1]",
                                                reply)
            mapper.add(reply, f"history[{i}][1]")
    input_key, reply_key = _key(mapper, record, INPUT_KEYS), _key(mapper, record, REPLY_KEYS)
    instruction = mapper.text(record.get("instruction"), "instruction", required=False)
    extra = mapper.text(record.get(input_key), input_key, required=False)
    query = "\n".join(t for t in (instruction, extra) if t)
    if not query:
        raise mapper.error(f"'instruction' and '{input_key}' are both empty", "instruction", "empty_conversation")
    mapper.add({"role": "user", "content": query}, input_key if extra and not instruction else "instruction")
    if not isinstance(record.get(reply_key), str):
        raise mapper.error(f"'{reply_key}' must be a string (the reply: {' or '.join(REPLY_KEYS)})", reply_key,
                           "missing_key")
    output = mapper.text(record[reply_key], reply_key)
    if not output.strip():
        raise mapper.error(f"empty {reply_key}", reply_key, "empty_conversation")
    reply = {"role": "assistant"}
    reply["content"] = mapper.reasoning({}, output, reply_key, reply)
    mapper.add(reply, reply_key)
    return mapper.done(mapper.tools(record.get("tools"), "tools"), record.get("tools"))
