"""Tool-call ids for a template that requires them in a fixed form (Mistral's: a call, and the
tool result answering it, render only with an id of exactly 9 characters; ``rendering.probe``
learns the length by rendering probe calls, never by a family's name).

A call the record gives no id, or an id not of the form -- ``length`` ASCII letters and digits,
``^[a-zA-Z0-9]{9}$`` as ``mistral_common``'s request validator requires, OpenAI's ``call_...``
ids are not -- gets one minted from the record's content and the call's place in it: the same
record gives the same ids, byte for byte, in every run, worker, engine, resume and check. The
record is never asked for randomness, a clock or its file position. A tool result gets the id
of the call it answers: the one its ``tool_call_id`` names (as given, before any was replaced),
else, as ShareGPT's and xLAM's order pairs them, the n-th call of the assistant turn the result
follows for the n-th result after it. A result that answers no call (none before it, or more
results than calls) is refused: ``mistral_common`` refuses more results than calls too. A record
whose every call and result already holds an id of the form is left as it is.

Each id given is counted by rule and field, as ``call-id-minted:FIELD`` (none given) or
``call-id-replaced:FIELD`` (one not of the form), in the summary's ``rules_applied``
(docs/INPUTS.md, "Tool-call ids").
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Dict, List, Optional, Tuple

from ..errors import input_error
from .conversation import Conversation
from .keys import CALL_ID_MINTED, CALL_ID_REPLACED

_INDEX = re.compile(r"\[\d+\]")
_DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def of_form(value, length: int) -> bool:
    """True when ``value`` is an id of the form: ``length`` ASCII letters and digits."""
    return type(value) is str and len(value) == length and value.isascii() and value.isalnum()


def needs_ids(messages: List[dict], length: int) -> bool:
    """True when a call or a tool result of ``messages`` holds no id of the form."""
    for m in messages:
        if m["role"] == "tool" and not of_form(m.get("tool_call_id"), length):
            return True
        for call in m.get("tool_calls") or ():
            if not of_form(call.get("id"), length):
                return True
    return False


def _key(messages: List[dict]) -> bytes:
    """The record's identity: a digest of its messages as mapped (ids as given)."""
    text = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=32).digest()


def mint(key: bytes, index: int, attempt: int, length: int) -> str:
    """The id of the record's ``index``-th call (``attempt`` > 0 only after a collision):
    ``length`` base-62 digits of a keyed BLAKE2b digest."""
    digest = hashlib.blake2b(f"{index}.{attempt}".encode(), key=key, digest_size=16).digest()
    n = int.from_bytes(digest, "big")
    out = []
    for _ in range(length):
        n, r = divmod(n, 62)
        out.append(_DIGITS[r])
    return "".join(out)


def _call_field(where: str, j: int) -> str:
    """The source field of the ``j``-th call of the message at ``where`` (its id's parent)."""
    if where.startswith("conversations["):
        return f"{where}.value[{j}]"   # (a ShareGPT function_call value: a call or a list of them)
    if where == "answers":
        return f"answers[{j}]"
    return f"{where}.tool_calls[{j}]"


def assign(conv: Conversation, length: int, path: str, line: int) -> Tuple[List[dict], Tuple[str, ...]]:
    """``(messages, applied)``: ``conv``'s messages with every call and tool result holding an id
    of the form (new dicts where one was given; the others as they are), and ``applied``, one
    ``rule:field`` name per id given (fields with ``[]`` for indices, as the summary counts them).

    Raises:
        InputError: a tool result that answers no call (``bad_tool_call``), naming it.
    """
    messages = conv.messages
    kept = {c.get("id") for m in messages for c in m.get("tool_calls") or () if of_form(c.get("id"), length)}
    key: Optional[bytes] = None
    index = 0                      # the record's calls so far
    turn: List[str] = []           # the ids of the last assistant turn's calls
    renamed: Dict[str, str] = {}   # that turn's ids as given -> as written
    minted = False                 # that turn's calls were given some id
    answered = 0                   # results since that turn
    out, applied = [], []
    for k, m in enumerate(messages):
        where = conv.where(k)
        if m.get("tool_calls"):
            calls, turn, renamed, answered, minted = [], [], {}, 0, False
            for j, call in enumerate(m["tool_calls"]):
                given = call.get("id")
                if of_form(given, length):
                    calls.append(call)
                else:
                    key = key or _key(messages)
                    attempt = 0
                    new = mint(key, index, attempt, length)
                    while new in kept:
                        attempt += 1
                        new = mint(key, index, attempt, length)
                    kept.add(new)
                    minted = True
                    if given is not None:
                        renamed.setdefault(given, new)
                    calls.append(dict(call, id=new))
                    applied.append(_name(CALL_ID_MINTED if given is None else CALL_ID_REPLACED,
                                         _call_field(where, j) + ".id"))
                turn.append(calls[-1]["id"])
                index += 1
            out.append(dict(m, tool_calls=calls))
            continue
        if m["role"] != "tool":
            if m["role"] != "system":
                turn, renamed, answered, minted = [], {}, 0, False
            out.append(m)
            continue
        given = m.get("tool_call_id")
        if of_form(given, length) and (given in turn or not minted):   # (as given: it names its call)
            out.append(m)
        elif given is not None and given in renamed:
            out.append(dict(m, tool_call_id=renamed[given]))
            applied.append(_name(CALL_ID_REPLACED, where + ".tool_call_id"))
        elif answered < len(turn):
            out.append(dict(m, tool_call_id=turn[answered]))
            applied.append(_name(CALL_ID_MINTED if given is None else CALL_ID_REPLACED, where + ".tool_call_id"))
        else:
            made = f"the assistant turn before it made {len(turn)} call(s)" if turn else "no assistant call precedes it"
            raise input_error(f"{where} is a tool result that answers no call ({made}), and the chat template "
                              f"renders a result only with the id of its call ({length} characters)", path, line,
                              field=where + ".tool_call_id", reason="bad_tool_call",
                              hint="give the result the 'tool_call_id' of the call it answers (or remove it), or "
                                   "pass --skip-bad to skip and count such records")
        answered += 1
    return out, tuple(applied)


def _name(rule: str, field: str) -> str:
    """``rule:field`` with indices written ``[]`` (``messages[3].tool_calls[0].id`` ->
    ``messages[].tool_calls[].id``)."""
    return f"{rule}:{_INDEX.sub('[]', field)}"
