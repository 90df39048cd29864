"""Kind ``nemotron``: Llama-Nemotron's post-training rows, ``{"input": [messages], "output",
"system_prompt"?, "tools"?}``."""

from __future__ import annotations

from . import chat
from .base import turns
from .conversation import Conversation
from .keys import SYSTEM_KEYS
from .mapper import Mapper

KIND = "nemotron"
#: the record-level keys this shape reads
FIELDS = frozenset({"input", "output", "tools"} | set(SYSTEM_KEYS))


def to_conversation(mapper: Mapper, record: dict) -> Conversation:
    """Llama-Nemotron's post-training rows: ``input`` the prompt's messages (``user`` /
    ``assistant``; never trained, as a conversational prompt/completion's prompt), ``output`` the
    reply (its reasoning inline in ``<think>`` tags, trained by the reasoning policy), the system
    prompt (``detailed thinking on``) in ``system_prompt``.

    Raises:
        InputError: see :mod:`megatron_sft_idx.preprocess.records.shapes`.
    """
    messages = turns(record.get("input"), mapper.path, mapper.line, "input")
    mapper.system(record, lambda: any(isinstance(m, dict) and m.get("role") in ("system", "developer")
                                      for m in messages))
    for i, m in enumerate(messages):
        chat.message(mapper, m, f"input[{i}]")
    mapper.untrained.update(range(len(mapper.messages)))
    if not isinstance(record.get("output"), str):
        raise mapper.error("'output' must be a string (the reply)", "output", "missing_key")
    output = mapper.text(record["output"], "output")
    reply = {"role": "assistant"}
    reply["content"] = mapper.reasoning({}, output, "output", reply)
    if not reply["content"].strip() and "reasoning_content" not in reply:
        raise mapper.error("empty output", "output", "empty_conversation")
    mapper.add(reply, "output")
    return mapper.done(mapper.tools(record.get("tools"), "tools"), record.get("tools"))
