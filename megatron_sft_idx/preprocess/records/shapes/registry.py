"""How a record's shape is told and chosen -- the one place. ``--input-format`` names a kind, or
``auto`` detects it by the record's keys (:func:`detect`); :func:`map_record` refuses a detected
record that also holds another shape's keys, accounts for every record-level key
(:func:`.keys.account_keys`) and hands the record to its kind's module."""

from __future__ import annotations

from typing import Dict, Optional

from . import alpaca, chat, nemotron, prompt, sharegpt, tokens, xlam
from .base import present
from .conversation import SchemaOptions
from .keys import account_keys
from .mapper import Mapper

#: the shapes mapped to a conversation, by kind (each module's ``to_conversation(mapper, record)``,
#: looked up when called)
CONVERSATIONS = {module.KIND: module for module in (chat, sharegpt, alpaca, xlam, nemotron)}
KINDS = (*CONVERSATIONS, prompt.KIND, tokens.KIND)
#: the record-level keys each shape reads (a prompt record's: the run's prompt and completion keys);
#: beside these, a key is metadata, ignored by a named rule, or refused (:func:`.keys.account_keys`)
SHAPE_FIELDS = {**{kind: module.FIELDS for kind, module in CONVERSATIONS.items()}, tokens.KIND: tokens.FIELDS}
#: the keys that mark the other shapes (each entry: keys that together mark one; the last one is
#: named): a record holding them beside its own is ambiguous, not metadata
_SHAPE_KEYS = {"chat": (("conversations",), ("instruction",), ("history",), xlam.MARKS),
               "sharegpt": (("messages",), ("instruction",), ("history",), xlam.MARKS),
               "alpaca": (("messages",), ("conversations",), xlam.MARKS),
               "xlam": (("messages",), ("conversations",), ("instruction",)),
               "nemotron": (("messages",), ("conversations",), ("instruction",), xlam.MARKS)}


#: per kind, the keys whose presence is worth a closer look (each entry's named key), as one set
_MARKERS = {kind: frozenset(keys[-1] for keys in entries) for kind, entries in _SHAPE_KEYS.items()}


def detect(record: dict, prompt_key: str) -> Optional[str]:
    """The kind of ``record`` by its keys (``--input-format auto``), or None."""
    for key, kind in (("messages", "chat"), ("conversations", "sharegpt"), ("input_ids", "tokens"),
                      (prompt_key, "prompt"), ("instruction", "alpaca")):
        if key in record:
            return kind
    if all(k in record for k in xlam.MARKS):
        return "xlam"
    if isinstance(record.get("input"), list) and "output" in record:
        return "nemotron"
    return None


def map_record(kind: str, record: dict, path: str, line: int, opts: SchemaOptions, detected: bool = False,
               ignored: Optional[Dict[str, int]] = None, nulls: bool = True, raw=None):
    """``(kind, payload)``: ``("chat", Conversation)``, ``("prompt", (prompt, completion))`` for a
    raw prompt/completion, or ``("tokens", (input_ids, loss_mask, answer_start_idx))``. A ``detected``
    kind (``--input-format auto``) is refused when the record also holds another shape's keys.
    Every record-level key is accounted for (:func:`.keys.account_keys`); ``ignored`` counts, per
    ``rule:key``, the keys ignored by a rule. ``nulls=False`` says the record holds no null
    (its JSON text has no ``null``), so none is looked for; ``raw``: its bytes as read, which may prove
    that no value of it holds a lone surrogate (:func:`.base.surrogate_free`, asked only of a record
    with tool calls or tools), so its JSON values are not walked for one.

    Raises:
        InputError: see :mod:`megatron_sft_idx.preprocess.records.shapes`; ``reason`` is the skip-count key.
    """
    m = Mapper(path, line, opts, ignored)
    m.nulls, m.raw = nulls, raw
    # (a kind named by --input-format is the user's choice; only a detected one can be ambiguous)
    if detected and kind in _SHAPE_KEYS and not _MARKERS[kind].isdisjoint(record):
        other = [keys[-1] for keys in _SHAPE_KEYS[kind] if all(present(record.get(k)) for k in keys)]
        if other:
            raise m.error(f"record holds '{other[0]}' beside the {kind} shape's keys: which one is meant?",
                          other[0], "ambiguous_record", "give each record one shape (--input-format names it)")
    if kind == prompt.KIND:   # (its keys are accounted for after the mapping, which names the misplaced ones)
        kind, payload = prompt.to_payload(m, record)
        account_keys(record, frozenset({opts.prompt_key, opts.completion_key}), opts, path, line, ignored)
        return kind, payload
    account_keys(record, SHAPE_FIELDS[kind], opts, path, line, ignored)
    if kind == tokens.KIND:
        return "tokens", tokens.token_record(record, path, line)
    return "chat", CONVERSATIONS[kind].to_conversation(m, record)
