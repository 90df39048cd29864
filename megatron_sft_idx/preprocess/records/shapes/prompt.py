"""Kind ``prompt``: ``{PROMPT_KEY, COMPLETION_KEY}`` (the keys are the run's ``--prompt-key`` /
``--completion-key``): strings, encoded through the chat template (``--prompt-format chat``) or
as they are (``raw``), or lists of messages (TRL's conversational form)."""

from __future__ import annotations

from . import chat
from .base import check_text, present
from .conversation import Conversation
from .mapper import Mapper

KIND = "prompt"


def to_payload(mapper: Mapper, record: dict):
    """``("chat", Conversation)``, or ``("prompt", (prompt, completion))`` under ``--prompt-format raw``.

    Raises:
        InputError: see :mod:`megatron_sft_idx.preprocess.records.shapes`.
    """
    o = mapper.opts
    for key in ("input", "history", "system", "system_prompt", "output"):
        if key not in (o.prompt_key, o.completion_key) and present(record.get(key)):
            raise mapper.error(f"'{key}' has no place in a prompt/completion record and would be lost",
                               key, "unknown_field", "for Alpaca records (instruction/input/output) pass "
                               "--input-format alpaca, or auto without --prompt-key/--completion-key")
    for key in (o.prompt_key, o.completion_key):
        if key not in record or record[key] is None:
            raise mapper.error(f"missing key '{key}'", key, "missing_key")
    prompt, completion = record[o.prompt_key], record[o.completion_key]
    if isinstance(prompt, list) or isinstance(completion, list):  # TRL's conversational form
        return "chat", _conversational(mapper, prompt, completion)
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise mapper.error(f"'{o.prompt_key}' and '{o.completion_key}' must be strings (or lists of messages)",
                           o.prompt_key, "missing_key")
    prompt = check_text(prompt, mapper.path, mapper.line, o.prompt_key)
    completion = check_text(completion, mapper.path, mapper.line, o.completion_key)
    if not completion:
        raise mapper.error("empty completion", o.completion_key, "empty_conversation")
    if o.prompt_format == "raw":
        return "prompt", (prompt, completion)
    mapper.add({"role": "user", "content": prompt}, o.prompt_key)
    mapper.add({"role": "assistant", "content": completion}, o.completion_key)
    return "chat", mapper.done(None)


def _conversational(mapper: Mapper, prompt, completion) -> Conversation:
    """TRL's conversational prompt/completion: two lists of messages, the prompt's never trained."""
    o = mapper.opts
    if mapper.opts.prompt_format == "raw":
        raise mapper.error("a prompt/completion of messages needs a chat template (--prompt-format chat)",
                           o.prompt_key, "missing_key")
    for key, value in ((o.prompt_key, prompt), (o.completion_key, completion)):
        if not isinstance(value, list):
            raise mapper.error(f"'{key}' must be a list of messages like the other one", key, "missing_key")
    for i, m in enumerate(prompt):
        chat.message(mapper, m, f"{o.prompt_key}[{i}]")
    mapper.untrained.update(range(len(mapper.messages)))  # TRL trains the completion only
    for i, m in enumerate(completion):
        chat.message(mapper, m, f"{o.completion_key}[{i}]")
    if not any(m["role"] == "assistant" for m in mapper.messages[len(prompt):]):
        raise mapper.error(f"'{o.completion_key}' holds no assistant message", o.completion_key,
                           "empty_conversation")
    return mapper.done(None)
