"""Kind ``alpaca``: Stanford / LLaMA-Factory ``{"instruction", "input"?, "output", "system"?,
"history"?, "tools"?}``."""

from __future__ import annotations

from .base import present
from .conversation import Conversation
from .keys import SYSTEM_KEYS
from .mapper import Mapper

KIND = "alpaca"
#: the record-level keys this shape reads
FIELDS = frozenset({"instruction", "input", "output", "history", "tools"} | set(SYSTEM_KEYS))


def to_conversation(mapper: Mapper, record: dict) -> Conversation:
    """Stanford / LLaMA-Factory Alpaca: system, history pairs, then instruction and input joined by
    a newline as the user turn (LLaMA-Factory's joiner), output as the assistant turn.

    Raises:
        InputError: see :mod:`megatron_sft_idx.preprocess.records.shapes`.
    """
    mapper.system(record, False)
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
    instruction = mapper.text(record.get("instruction"), "instruction", required=False)
    extra = mapper.text(record.get("input"), "input", required=False)
    query = "\n".join(t for t in (instruction, extra) if t)
    if not query:
        raise mapper.error("'instruction' and 'input' are both empty", "instruction", "empty_conversation")
    mapper.add({"role": "user", "content": query}, "input" if extra and not instruction else "instruction")
    if not isinstance(record.get("output"), str):
        raise mapper.error("'output' must be a string", "output", "missing_key")
    output = mapper.text(record["output"], "output")
    if not output.strip():
        raise mapper.error("empty output", "output", "empty_conversation")
    reply = {"role": "assistant"}
    reply["content"] = mapper.reasoning({}, output, "output", reply)
    mapper.add(reply, "output")
    return mapper.done(mapper.tools(record.get("tools"), "tools"), record.get("tools"))
