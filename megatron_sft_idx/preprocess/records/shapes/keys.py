"""Record-level keys: the ones a shape reads, the ones ignored by a named rule (documented
metadata, ``--ignore-field``, holding no text; counted as ``rule:key``), and the refusal of the
rest (``docs/INPUTS.md``)."""

from __future__ import annotations

from typing import Dict, FrozenSet, Optional

from ..errors import input_error
from .base import drop_nulls, holds_text, present
from .conversation import SchemaOptions

#: record-level keys that hold a system prompt, in the order they are looked for (Llama-Nemotron's
#: post-training data and OpenHermes name it ``system_prompt``); a record may give one of them
SYSTEM_KEYS = ("system", "system_prompt")
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
#: reasoning a thinking template drops from the history (Qwen3 family, GLM-4.7, MiniMax-M2: shown
#: only after the last user turn), so a turn is trained as the rendering shows it, without it
#: (docs/INPUTS.md, "Thinking templates"); counted per message as ``history-reasoning:messages[]``
HISTORY_REASONING = "history-reasoning"
APPLIED_RULES = (DECODED_TWICE, HISTORY_REASONING)


def ignore_rule(key: str, value, opts: SchemaOptions) -> Optional[str]:
    """The rule a record-level key outside its shape is ignored by (:data:`IGNORE_RULES`), or None
    when none covers it: it holds text, and dropping it would lose what the producer wrote."""
    if key in opts.ignore_fields:
        return "ignore-field"
    if key in METADATA_KEYS or (key in METADATA_FLAGS and isinstance(value, str)
                                and value.lower() in METADATA_FLAGS[key]):
        return "metadata"
    return None if holds_text(value) else "no-text"


def account_keys(record: dict, used: FrozenSet[str], opts: SchemaOptions, path: str, line: int,
                 ignored: Optional[Dict[str, int]]) -> None:
    """Account for every record-level key: read by the shape (``used``), absent (``null``, empty),
    or ignored by a named rule -- documented metadata, ``--ignore-field``, holding no text -- and
    counted in ``ignored`` as ``rule:key``.

    Raises:
        InputError: a key holding text that no rule covers (``unknown_field``), naming it.
    """
    for key, value in record.items():
        if key in used or not present(value) or not present(drop_nulls(value)):
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
