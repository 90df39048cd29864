"""Record-level keys: the ones a shape reads, the ones ignored by a named rule (documented
metadata, ``--ignore-field``, documented counts holding no text; counted as ``rule:key``), and the
refusal of the rest (``docs/INPUTS.md``). A rule is keyed on a key's name, never on its value's
type alone: ``"label": false`` (an undesirable completion) holds no text, and decides whether the
record should be trained at all."""

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
#: words that are a reasoning switch, not reasoning text: a message's ``reasoning: "off"`` (how
#: some exports of Llama-Nemotron's data carry the record's flag) is read as the flag
REASONING_SWITCHES = frozenset({"on", "off"})
#: record-level keys documented as counts and positions: ignored when they hold no text (rule
#: ``no-text``); any other key, whatever its value's type, is read, ignored by another rule, or refused
NO_TEXT_KEYS = frozenset({
    "num_tokens", "n_tokens", "token_count", "num_chars", "char_count", "num_words", "word_count",
    "turn_count", "n_turns", "row", "row_id", "row_idx", "line", "index", "position", "offset", "views"})
#: record-level keys that decide what is trained -- a preference or safety label, a training switch,
#: a reward, a mask: refused whatever they hold (``training_flag``) unless ``--ignore-field`` says
#: they carry nothing (this run trains every record it keeps, as written)
TRAINING_FLAGS = frozenset({
    "label", "labels", "train", "training", "trainable", "is_train", "do_train", "use_for_training", "loss",
    "loss_mask", "loss_weight", "mask", "masked", "weight", "weights", "sample_weight", "chosen", "rejected",
    "preferred", "is_preferred", "preference", "reward", "rewards", "advantage", "is_harmful", "harmful",
    "is_safe", "safe", "unsafe", "is_toxic", "toxic", "toxicity", "accepted", "is_accepted", "keep", "exclude",
    "excluded", "skip", "filtered", "is_valid", "valid", "correct", "is_correct", "flagged"})
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
#: tool-call ids a template requires in a fixed form (Mistral's: 9 characters) given where the
#: record has none, or one not of the form (:mod:`.call_ids`; docs/INPUTS.md, "Tool-call ids");
#: counted per id as ``call-id-minted:FIELD`` / ``call-id-replaced:FIELD``
CALL_ID_MINTED = "call-id-minted"
CALL_ID_REPLACED = "call-id-replaced"
APPLIED_RULES = (DECODED_TWICE, HISTORY_REASONING, CALL_ID_MINTED, CALL_ID_REPLACED)


def ignore_rule(key: str, value, opts: SchemaOptions) -> Optional[str]:
    """The rule a record-level key outside its shape is ignored by (:data:`IGNORE_RULES`), or None
    when none covers it: it holds text, and dropping it would lose what the producer wrote, or it
    is no documented name (a number or a flag may decide what is trained)."""
    if key in opts.ignore_fields:
        return "ignore-field"
    if key in TRAINING_FLAGS:
        return None
    if key in METADATA_KEYS or (key in METADATA_FLAGS and isinstance(value, str)
                                and value.lower() in METADATA_FLAGS[key]):
        return "metadata"
    return "no-text" if key in NO_TEXT_KEYS and not holds_text(value) else None


def account_keys(record: dict, used: FrozenSet[str], opts: SchemaOptions, path: str, line: int,
                 ignored: Optional[Dict[str, int]]) -> None:
    """Account for every record-level key: read by the shape (``used``), absent (``null``, empty),
    or ignored by a named rule -- documented metadata, ``--ignore-field``, holding no text -- and
    counted in ``ignored`` as ``rule:key``.

    Raises:
        InputError: a key that decides what is trained (``training_flag``), or another that no rule
            covers (``unknown_field``), naming it.
    """
    if used.issuperset(record):   # (the common record: only its shape's keys)
        return
    for key, value in record.items():
        if key in used or not present(value) or not present(drop_nulls(value)):
            continue
        rule = ignore_rule(key, value, opts)
        if rule is None and key in TRAINING_FLAGS:
            raise input_error(f"record-level key '{key}' ({_shown(value)}) may decide whether or how this record "
                              "is trained (a label, a preference, a reward, a training switch); this run trains "
                              "every record it keeps as written", path, line, field=key, reason="training_flag",
                              hint=f"filter or split the data by '{key}' first; if it carries nothing, pass "
                                   f"--ignore-field {key} (counted in the summary), or pass --skip-bad")
        if rule is None:
            what = ("holds text the run does not use" if holds_text(value) else
                    f"holds {_shown(value)}, which the run does not use: no rule says it carries nothing (a number or "
                    "a flag may decide what is trained)")
            raise input_error(f"record-level key '{key}' {what}", path, line, field=key,
                              reason="unknown_field",
                              hint=f"if '{key}' carries nothing the model should see, pass --ignore-field {key} "
                                   "(it is counted in the summary); else map it into the conversation, or pass "
                                   "--skip-bad")
        if ignored is not None:
            name = f"{rule}:{key}"
            ignored[name] = ignored.get(name, 0) + 1


def _shown(value) -> str:
    """A value as a message shows it: short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
