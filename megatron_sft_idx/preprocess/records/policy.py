"""Loss policies: which assistant turns are trained, and which parts of a trained turn are not.

=======================  =========  ======================================================================
flag                     default    meaning
=======================  =========  ======================================================================
``--tool-call-loss``     ``train``  an assistant turn holding tool calls is trained as assistant output
                                    (``mask``: the whole turn, its content included, is not trained)
``--reasoning-loss``     ``train``  a trained turn's reasoning block is trained; ``mask``: rendered, not
                                    trained; ``drop``: removed before rendering (the answer is trained alone)
``--empty-reasoning-loss`` ``mask`` a reasoning block holding only whitespace (Qwen3-style templates insert
                                    ``<think>\\n\\n</think>\\n\\n`` in the final turn) is not trained
``--reasoning-tags``     ``<think>,</think>``  what delimits a reasoning block in the rendering
=======================  =========  ======================================================================

Never trained, whatever the flags: system and user turns, tool results, the generation prompt
(the header before an assistant turn), and any turn the producer marked ``weight: 0`` or that
is the prompt of a conversational prompt/completion record. ``--loss-on all`` trains every token
(an explicit choice: these policies apply to the assistant modes).

A reasoning block is located in the rendering of a trained turn, never guessed: it opens at the
turn's start (after whitespace) with the opening tag, or the generation prompt ends with it (as
DeepSeek-R1's does); it ends with the first closing tag in the turn, plus the whitespace after
it. A turn whose source has reasoning that must be masked, but whose rendering shows no block, is
refused by name. Truncation inside reasoning follows ``--truncated-turn-loss`` like any cut reply:
the tokens before the cut keep their loss (``keep``) or the whole cut reply is masked (``drop``);
no closing tag is ever trained at a cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, List, Optional, Sequence, Tuple

from .errors import input_error
from .shapes import REASONING_TAGS, Conversation

TOOL_CALL_LOSS = ("train", "mask")
REASONING_LOSS = ("train", "mask", "drop")
EMPTY_REASONING_LOSS = ("mask", "train")


@dataclass(frozen=True)
class LossPolicy:
    """The run's loss policies (module docstring); ``to_dict`` holds only what differs from the
    defaults, so stores and shards made with the defaults keep their bytes."""

    tool_calls: str = "train"
    reasoning: str = "train"
    empty_reasoning: str = "mask"
    tags: Tuple[str, str] = REASONING_TAGS

    def to_dict(self) -> dict:
        out = {}
        for key, default in (("tool_calls", "train"), ("reasoning", "train"), ("empty_reasoning", "mask")):
            if getattr(self, key) != default:
                out[key] = getattr(self, key)
        if tuple(self.tags) != REASONING_TAGS:
            out["reasoning_tags"] = list(self.tags)
        return out


DEFAULT_POLICY = LossPolicy()


def trained_turns(conv: Conversation, loss_on: str, policy: LossPolicy = DEFAULT_POLICY) -> List[int]:
    """Indices of the assistant messages trained under ``loss_on`` and ``policy`` (``last-turn``:
    the last of them)."""
    mask_calls = policy.tool_calls == "mask"
    turns = [k for k, m in enumerate(conv.messages)
             if m["role"] == "assistant" and k not in conv.untrained and not (mask_calls and "tool_calls" in m)]
    return turns[-1:] if loss_on == "last-turn" else turns


def require_trainable(conv: Conversation, turns: Sequence[int], policy: LossPolicy, path: str, line: int) -> None:
    """Nothing to check unless ``turns`` is empty because ``--tool-call-loss mask`` masked every
    assistant turn (agentic data: every turn a call): then a named error, a counted skip under
    ``--skip-bad`` (reason ``only_masked_tool_calls``), never "no assistant turn".

    Raises:
        InputError: the record's every assistant turn is a tool call the policy masks.
    """
    if turns or policy.tool_calls != "mask":
        return
    calls = [k for k, m in enumerate(conv.messages) if m["role"] == "assistant" and "tool_calls" in m
             and k not in conv.untrained]
    if calls:
        raise input_error(f"--tool-call-loss mask masks all {len(calls)} assistant turns of this conversation (each "
                          "is a tool call): it has nothing else to train", path, line, field=conv.where(calls[0]),
                          reason="only_masked_tool_calls",
                          hint="pass --skip-bad to skip and count such records, or --tool-call-loss train to train "
                               "the calls")


def reasoning_block(text: str, a: int, b: int, opening: str, closing: str, opened: bool = False):
    """``(start, end, empty)`` of the reasoning block of the turn spanning ``text[a:b]``, or None.

    The block opens at the span's first non-space character, or in the generation prompt just
    before the span; it ends after the first closing tag and the whitespace that follows.
    ``opened``: the template's generation prompt opens a block the rendering does not show
    before this turn (it was counted as prompt): a span that starts with the closing tag closes
    that block, empty (GLM-4.7's ``</think>`` before an answer without reasoning)."""
    i = a
    while i < b and text[i].isspace():
        i += 1
    j = a
    while j > 0 and text[j - 1].isspace():
        j -= 1
    if text.startswith(opening, i):
        inner = i + len(opening)
    elif text.endswith(opening, 0, j):  # (no slice: a copy of the text before every turn)
        i = inner = a
    elif opened and text.startswith(closing, i):
        inner = i
    else:
        return None
    close = text.find(closing, inner, b)
    if close < 0:
        return None
    end = close + len(closing)
    while end < b and text[end].isspace():
        end += 1
    return a, end, not text[inner:close].strip()


def refine_spans(text: str, spans: Sequence[Tuple[int, int]], turns: Sequence[int], conv: Conversation,
                 policy: LossPolicy, path: str, line: int, opened: Collection[int] = (),
                 dropped: Collection[int] = ()) -> List[Tuple[int, int]]:
    """``spans`` (one per trained turn, in order) with the reasoning blocks the policy does not
    train cut out; pieces that hold only whitespace are dropped. ``opened``: turns whose
    generation prompt's opened block was counted as prompt; ``dropped``: turns whose reasoning the
    template drops from the history (:meth:`.chat.ChatTokenizer.prefix_spans`).

    Raises:
        InputError: a turn's reasoning must be masked but its rendering shows no reasoning block.
    """
    opening, closing = policy.tags
    out: List[Tuple[int, int]] = []
    for (a, b), k in zip(spans, turns):
        block = reasoning_block(text, a, b, opening, closing, k in opened) if a < b else None
        reasons = "reasoning_content" in conv.messages[k] and policy.reasoning != "drop" and k not in dropped
        if block is None:
            if reasons and policy.reasoning == "mask":
                raise input_error(f"cannot mask the reasoning of {conv.where(k)}: its rendering holds no "
                                  f"{opening}...{closing} block", path, line, field=conv.where(k),
                                  reason="reasoning_not_located",
                                  hint="set --reasoning-tags to the template's reasoning delimiters, or use "
                                       "--reasoning-loss train or drop")
            out.append((a, b))
            continue
        start, end, empty = block
        masked = policy.empty_reasoning == "mask" if empty else policy.reasoning == "mask"
        if not masked:
            out.append((a, b))
            continue
        for lo, hi in ((a, start), (end, b)):
            if hi > lo and text[lo:hi].strip():
                out.append((lo, hi))
    return out


def without_opened_block(prompt: str, opening: str, closing: str) -> Optional[str]:
    """``prompt`` without the reasoning block its end opens (the opening tag and the whitespace
    around it), or the empty block it ends with (Qwen3.5's ``enable_thinking=false`` prompt), or
    None when it ends with neither."""
    stripped = prompt.rstrip()
    if stripped.endswith(opening):
        return prompt[:len(stripped) - len(opening)]
    if stripped.endswith(closing):
        start = stripped.rfind(opening, 0, len(stripped) - len(closing))
        if start >= 0 and not stripped[start + len(opening):len(stripped) - len(closing)].strip():
            return prompt[:start]
    return None


def as_history(after: str, at: int, full: str, opening: str, closing: str) -> Optional[Tuple[str, bool]]:
    """``(after as the history shows it, whether its block was empty)``: ``after`` (a turn rendered
    as the conversation's last) with the reasoning block opening at ``at`` (after whitespace)
    removed, or reduced to its closing tag, whichever ``full`` starts with; None when neither is
    (or there is no block there)."""
    i = at
    while i < len(after) and after[i].isspace():
        i += 1
    if not after.startswith(opening, i):
        return None
    close = after.find(closing, i + len(opening))
    if close < 0:
        return None
    end = close + len(closing)
    while end < len(after) and after[end].isspace():
        end += 1
    empty = not after[i + len(opening):close].strip()
    for middle in ("", closing):
        edited = after[:at] + middle + after[end:]
        if full.startswith(edited):
            return edited, empty
    return None
