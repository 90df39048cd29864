"""Kind ``xlam``: xLAM / APIGen function calling, ``{"query", "answers", "tools"}`` (the calls
and the tools as JSON strings, as published, or lists)."""

from __future__ import annotations

from .conversation import Conversation
from .mapper import Mapper

KIND = "xlam"
#: the record-level keys this shape reads
FIELDS = frozenset({"query", "answers", "tools"})
#: the keys that together mark an xLAM record
MARKS = ("query", "answers")


def to_conversation(mapper: Mapper, record: dict) -> Conversation:
    """xLAM / APIGen function calling (Salesforce's ``xlam-function-calling-60k``): ``query``
    is the user's request, ``answers`` the assistant's calls (``[{"name", "arguments"}...]``,
    a JSON string as published, or a list), ``tools`` the functions offered (bare schemas,
    wrapped as the other shapes' are). A record without calls is refused: xLAM has no reply text.

    Raises:
        InputError: see :mod:`megatron_sft_idx.preprocess.records.shapes`.
    """
    mapper.add({"role": "user", "content": mapper.text(record.get("query"), "query")}, "query")
    answers = record.get("answers")
    if isinstance(answers, str):
        calls = mapper.function_call_value(answers, "answers")
    elif isinstance(answers, list) and answers:
        calls = [mapper.tool_call(c, f"answers[{j}]") for j, c in enumerate(answers)]
    else:
        raise mapper.error("'answers' holds no function call (a JSON list of {\"name\", \"arguments\"})",
                           "answers", "bad_tool_call")
    mapper.add({"role": "assistant", "content": "", "tool_calls": calls}, "answers")
    return mapper.done(mapper.tools(record.get("tools"), "tools"), record.get("tools"))
