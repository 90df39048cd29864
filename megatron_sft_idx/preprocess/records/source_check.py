"""The mask check against the SOURCE record (``--verify-masks``, and the sample ``--check`` runs).

This module shares nothing with the mapping it checks (:mod:`.schemas`, :mod:`.rendering`,
:mod:`.policy` are not imported): it walks the record as read from the file with its own small
extraction of every text the producer wrote -- message contents and each text part, reasoning
(a field or inline tags), each tool call's name and argument keys and values, tool results, the
tool definitions' names, Alpaca's system / history / instruction / input / output, prompt and
completion -- and decides from the record and the run's loss settings which turns must be
trained. Then, on the tokens of one written sequence, it proves:

1. every text appears in the rendering, in order (system texts and tool names anywhere; the
   reasoning of an untrained turn may be missing, as templates drop it from the history), and
   under ``--reasoning-loss drop`` no reasoning is rendered in its place. Reasoning is read with
   no precedence between the places it is written -- a block opening the content (or its first
   text part) and every reasoning field holding text -- where the mapping picks one, so a
   mapping that picks wrong (a blank ``reasoning_content: ""`` taken as "given") fails here;
2. every token that starts inside a text of a trained turn is trained (reasoning: only under
   ``train``; under ``mask`` none is), and no token that starts inside a text of any other
   turn is -- user, system, tool result, tool definition or untrained assistant turn;
3. every trained run ends with a special (end-of-turn) token, holds no generation prompt and
   (by default) no empty reasoning block, and a run outside every text belongs to a trained
   turn that renders no text (an empty reply: its end-of-turn alone);

and counts the trained tokens per role (``assistant``, ``tool_call``, ``reasoning``, and any
``user``/``system``/``tool`` ones, which fail the check).

Before any of it, the record's bytes -- and every JSON string it reads inside them (arguments, a
``function_call`` value, ``tools``, xLAM ``answers``) -- are read once more by this module's own
small scanner (:func:`duplicate_key`), not the decoder the mapping reads with: an object that
names a key twice has no one meaning, and a mapping whose decoder picked one silently
(``{"role": "user", ..., "role": "assistant"}`` trained as a reply) fails here. A mapping that dropped a text, a
template that rendered it nowhere, a turn left untrained or a turn trained that must not be,
each fails here, whatever the pipeline's own normalisation believed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...jsondoc import parse_record_json
from .key_scan import duplicate_key

_SHAREGPT = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
             "model": "assistant", "function_call": "assistant", "observation": "tool", "tool": "tool",
             "function": "tool", "system": "system"}
_OPENAI = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
           "function": "tool", "ipython": "tool"}


class Unverifiable(Exception):
    """The source record cannot be read as the settings say (the check fails with this message)."""


def one_meaning(raw, where: str = "the record") -> None:
    """Raises Unverifiable when the JSON text ``raw`` (of the field ``where``) names a key twice."""
    key = duplicate_key(raw)
    if key is not None:
        raise Unverifiable(f"{where} holds an object that names the key {key!r} twice: it has no one meaning")


@dataclass
class Text:
    turn: int           # index into SourceConversation.turns; -1 for a tool definition
    kind: str           # content | reasoning | call | result | tool
    forms: Tuple[str, ...]
    where: str
    start: int = -1     # position in the rendering, once found
    end: int = -1
    bare: Tuple[str, ...] = ()   # a call's key or value as text, where a template writes it so (XML)


@dataclass
class Turn:
    role: str           # system | user | assistant | tool
    where: str
    texts: List[Text] = field(default_factory=list)
    calls: bool = False
    reasoning: bool = False
    excluded: bool = False   # weight 0, or the prompt of a conversational prompt/completion


@dataclass
class SourceConversation:
    turns: List[Turn]
    tools: List[Text]


# --------------------------------------------------------------------------- extraction


def _forms(value) -> Tuple[str, ...]:
    """How a JSON scalar or key may be written: with non-ASCII kept (``tojson``) or escaped."""
    if isinstance(value, str):
        a, b = encode_basestring(value), encode_basestring_ascii(value)
        return (a,) if a == b else (a, b)
    return (json.dumps(value),)


#: words a reasoning field may hold that are a switch, not reasoning (docs/INPUTS.md: ``"off"``)
_SWITCHES = ("on", "off")


def _has_text(value) -> bool:
    """A string or text parts with a non-blank text in them (a switch word is none)."""
    if isinstance(value, str) and value.strip().lower() in _SWITCHES:
        return False
    if isinstance(value, list):
        return any(_has_text(p.get("text") if isinstance(p, dict) else p) for p in value)
    return isinstance(value, str) and bool(value.strip())


def _bare(value) -> Tuple[str, ...]:
    """How a call's key or scalar may appear where a template writes arguments as text (Qwen3.5's,
    GLM's and MiniMax's XML): a string as written, ``true`` as JSON or Python writes it, a number
    as either writes it."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, bool):
        return (json.dumps(value), str(value))
    return tuple({json.dumps(value), repr(value)})


def _leaves(value, out: list) -> None:
    """``(JSON forms, text forms)`` of each key and scalar of arguments, in document order."""
    if isinstance(value, dict):
        for key, item in value.items():
            if item is None:   # (null counts as absent, at every depth: columnar rows hold every field)
                continue
            out.append((_forms(key), _bare(key)))
            _leaves(item, out)
    elif isinstance(value, list):
        for item in value:
            _leaves(item, out)
    else:
        out.append((_forms(value), _bare(value)))


class _Reader:
    def __init__(self, tags: Tuple[str, str]) -> None:
        self.turns: List[Turn] = []
        self.tags = tags

    def turn(self, role: str, where: str, excluded: bool = False) -> Turn:
        t = Turn(role, where, excluded=excluded)
        self.turns.append(t)
        return t

    def text(self, t: Turn, kind: str, value, where: str) -> None:
        if isinstance(value, list):  # OpenAI text parts: each part's text is checked, whatever the joiner
            for i, part in enumerate(value):
                self.text(t, kind, part.get("text") if isinstance(part, dict) else part, f"{where}[{i}]")
            return
        if isinstance(value, str) and value.strip():
            t.texts.append(Text(len(self.turns) - 1, kind, (value.strip(),), where))

    def reply(self, t: Turn, content, message: dict, where: str) -> None:
        """An assistant reply: its reasoning, then its content.

        No precedence between the places reasoning is written: a block opening the content is
        reasoning whatever the fields hold, and so is every field that holds text (a blank field,
        as columnar exports write an absent one, holds none). The mapping picks one place; a
        mapping that picked wrong leaves a reasoning text trained or missing, which step 2 sees."""
        content = self.thought(t, content, where)
        for key in ("reasoning_content", "reasoning", "thinking"):
            value = message.get(key)
            if _has_text(value):
                t.reasoning = True
                self.text(t, "reasoning", value, f"{where}.{key}")
        self.text(t, "content", content, where + ".content")

    def thought(self, t: Turn, value, where: str):
        """``value`` without a reasoning block opening it; the block's text becomes ``t``'s reasoning.
        Text parts: a block opening the first part (the producer's parts, whatever the joiner)."""
        if isinstance(value, list) and value and isinstance(value[0], dict) and isinstance(value[0].get("text"), str):
            first = self.thought(t, value[0]["text"], f"{where}[0]")
            return [dict(value[0], text=first)] + value[1:]
        opening, closing = self.tags
        body = value.lstrip() if isinstance(value, str) else ""
        end = body.find(closing, len(opening)) if body.startswith(opening) else -1
        if end < 0:
            return value
        if body[len(opening):end].strip():
            t.reasoning = True
            self.text(t, "reasoning", body[len(opening):end], where + ".reasoning")
        return body[end + len(closing):]

    def call(self, t: Turn, call, where: str) -> None:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        name, arguments = fn.get("name"), fn.get("arguments")
        if isinstance(arguments, str):
            one_meaning(arguments, where + ".arguments")
            try:
                arguments = parse_record_json(arguments)
                if isinstance(arguments, str) and arguments.lstrip().startswith("{"):   # encoded twice
                    arguments = parse_record_json(arguments)
            except ValueError:
                raise Unverifiable(f"{where}: arguments are not JSON") from None
        t.calls = True
        t.texts.append(Text(len(self.turns) - 1, "call", (str(name),), where + ".name"))
        leaves: list = []
        _leaves(arguments or {}, leaves)
        t.texts.extend(Text(len(self.turns) - 1, "call", forms, where + ".arguments", bare=bare)
                       for forms, bare in leaves)

    def openai(self, messages, prefix: str, excluded: bool = False) -> None:
        for i, m in enumerate(messages):
            where = f"{prefix}[{i}]"
            role = _OPENAI.get(m.get("role"), "unknown")
            t = self.turn(role, where, excluded or m.get("weight") == 0)
            if role == "assistant":
                self.reply(t, m.get("content"), m, where)
                calls = m.get("tool_calls") or ([{"function": m["function_call"]}] if m.get("function_call") else [])
                for j, c in enumerate(calls):
                    self.call(t, c, f"{where}.tool_calls[{j}]")
            else:
                self.text(t, "result" if role == "tool" else "content", m.get("content"), where + ".content")

    def sharegpt(self, turns) -> None:
        for i, m in enumerate(turns):
            where = f"conversations[{i}]"
            source = str(m.get("from", "")).lower()
            t = self.turn(_SHAREGPT.get(source, "unknown"), where, m.get("weight") == 0)
            value = m.get("value")
            if source == "function_call":
                value = self.thought(t, value, where)  # (a thought block may open the calls)
                one_meaning(value if isinstance(value, str) else "", where + ".value")
                try:
                    calls = parse_record_json(value)
                except (TypeError, ValueError):
                    raise Unverifiable(f"{where}: a function_call value that is not JSON") from None
                for j, c in enumerate(calls if isinstance(calls, list) else [calls]):
                    self.call(t, c, f"{where}.value[{j}]")
            elif t.role == "assistant":
                self.reply(t, value, {}, where)
            else:
                self.text(t, "result" if t.role == "tool" else "content", value, where + ".value")

    def tools(self, value) -> List[Text]:
        if isinstance(value, str) and value.strip():
            one_meaning(value, "tools")
            value = parse_record_json(value)
        if isinstance(value, dict):
            value = [value]
        out = []
        for i, tool in enumerate(value or ()):
            fn = tool.get("function", tool) if isinstance(tool, dict) else {}
            out.append(Text(-1, "tool", (str(fn.get("name")),), f"tools[{i}].name"))
        return out


def read_source(record: dict, shape: str, settings: dict) -> SourceConversation:
    """What the producer wrote, turn by turn.

    Raises:
        Unverifiable: the record is not of ``shape`` as the settings read it.
    """
    r = _Reader(tuple(settings.get("reasoning_tags") or ("<think>", "</think>")))
    tools = None
    system = next((k for k in ("system", "system_prompt") if isinstance(record.get(k), str) and record[k]), None)
    if system and shape in ("chat", "sharegpt", "alpaca", "nemotron"):
        r.text(r.turn("system", system), "content", record[system], system)
    if shape == "chat":
        r.openai(record["messages"], "messages")
        tools = record.get("tools") or record.get("functions")
    elif shape == "sharegpt":
        r.sharegpt(record["conversations"])
        tools = record.get("tools")
    elif shape == "nemotron":   # Llama-Nemotron: the input messages are the prompt, never trained
        r.openai(record["input"], "input", excluded=True)
        r.reply(r.turn("assistant", "output"), record.get("output"), {}, "output")
        tools = record.get("tools")
    elif shape == "alpaca":
        for i, (question, answer) in enumerate(record.get("history") or ()):
            r.text(r.turn("user", f"history[{i}][0]"), "content", question, f"history[{i}][0]")
            r.reply(r.turn("assistant", f"history[{i}][1]"), answer, {}, f"history[{i}][1]")
        t = r.turn("user", "instruction")
        r.text(t, "content", record.get("instruction"), "instruction")
        r.text(t, "content", record.get("input"), "input")
        r.reply(r.turn("assistant", "output"), record.get("output"), {}, "output")
        tools = record.get("tools")
    elif shape == "xlam":
        r.text(r.turn("user", "query"), "content", record.get("query"), "query")
        t = r.turn("assistant", "answers")
        answers = record.get("answers")
        if isinstance(answers, str):
            one_meaning(answers, "answers")
            try:
                answers = parse_record_json(answers)
            except ValueError:
                raise Unverifiable("answers: not JSON") from None
        for j, c in enumerate(answers if isinstance(answers, list) else [answers]):
            r.call(t, c, f"answers[{j}]")
        tools = record.get("tools")
    elif shape == "prompt":
        prompt, completion = record[settings["prompt_key"]], record[settings["completion_key"]]
        if isinstance(prompt, list):
            r.openai(prompt, settings["prompt_key"], excluded=True)
            r.openai(completion, settings["completion_key"])
        else:
            r.text(r.turn("user", settings["prompt_key"]), "content", prompt, settings["prompt_key"])
            r.reply(r.turn("assistant", settings["completion_key"]), completion, {}, settings["completion_key"])
    else:
        raise Unverifiable(f"no source check for {shape!r} records")
    return SourceConversation(r.turns, r.tools(tools) if tools else [])


def shape_of(record: dict, input_format: str, prompt_key: str) -> str:
    if input_format != "auto":
        return input_format
    for key, shape in (("messages", "chat"), ("conversations", "sharegpt"), ("input_ids", "tokens"),
                       (prompt_key, "prompt"), ("instruction", "alpaca")):
        if key in record:
            return shape
    if "query" in record and "answers" in record:
        return "xlam"
    if isinstance(record.get("input"), list) and "output" in record:
        return "nemotron"
    raise Unverifiable("a record of no known shape")


def trained_turns(conv: SourceConversation, loss_on: str, settings: dict) -> List[int]:
    """The source turns the settings train (before any per-turn cut)."""
    mask_calls = settings.get("tool_calls") == "mask"
    turns = [i for i, t in enumerate(conv.turns)
             if t.role == "assistant" and not t.excluded and not (mask_calls and t.calls)]
    return turns[-1:] if loss_on == "last-turn" else turns


# --------------------------------------------------------------------------- the check


@dataclass
class Verdict:
    problem: str                       # '' when the sequence is right
    trained: Dict[str, int]            # trained tokens per role


def _occurrences(text: str, forms: Tuple[str, ...], pos: int):
    """Occurrences ``(start, end)`` at or after ``pos`` of the forms as written, in order of start;
    if none, of their JSON-escaped versions (templates ``tojson`` some texts)."""
    for variants in (forms, tuple({json.dumps(f, ensure_ascii=False)[1:-1] for f in forms}
                                  | {json.dumps(f)[1:-1] for f in forms} - set(forms))):
        found = []
        for f in variants:
            at = text.find(f, pos)
            while at >= 0 and len(found) < 64:
                found.append((at, at + len(f)))
                at = text.find(f, at + 1)
        if found:
            return sorted(found)
    return []


class _Rendering:
    """The rendering, its tokens' starts and which tokens are trained."""

    def __init__(self, text: str, starts: np.ndarray, trained: np.ndarray) -> None:
        self.text, self.starts, self.trained = text, starts, trained

    def tokens(self, a: int, b: int) -> Tuple[int, int]:
        """The tokens that start in ``[a, b)``."""
        return int(np.searchsorted(self.starts, a, "left")), int(np.searchsorted(self.starts, b, "left"))

    def locate(self, forms: Tuple[str, ...], pos: int, want_trained: bool) -> Tuple[int, int]:
        """The first occurrence at or after ``pos`` where tokens start and are trained as wanted (a
        short text also occurs in the scaffolding: ``a`` in ``assistant``); else the first; else
        ``(-1, -1)``."""
        found = _occurrences(self.text, forms, pos)
        for a, b in found:
            lo, hi = self.tokens(a, b)
            got = self.trained[lo:hi]
            if lo < hi and (got.all() if want_trained else not got.any()):
                return a, b
        return found[0] if found else (-1, -1)


def check_sequence(conv: SourceConversation, trained: List[int], text: str, starts: np.ndarray,
                   ids: np.ndarray, mask: np.ndarray, settings: dict, special_ids, generation_prompt: str,
                   reasoned: Optional[List[int]] = None) -> Verdict:
    """Check one written sequence (``ids``, label-aligned ``mask``) whose rendering is ``text``,
    token ``j`` starting at character ``starts[j]`` (``starts[-1] == len(text)``), against the
    source turns ``conv`` of which ``trained`` must be trained (see the module docstring);
    ``special_ids`` are the tokenizer's special tokens (an end-of-turn is one). The reasoning of
    the turns ``reasoned`` (default: ``trained``) must be rendered unless the settings drop it
    (``--loss-on all`` trains no turn as such, yet its final reply is rendered with its reasoning)."""
    targets = np.flatnonzero(mask) + 1
    is_trained = np.zeros(ids.size, dtype=bool)
    is_trained[targets] = True
    r = _Rendering(text, starts[:ids.size] if starts.size else np.zeros(ids.size, np.int64), is_trained)
    c = _Check(conv, set(trained), settings.get("reasoning", "train"),
               set(trained if reasoned is None else reasoned))
    problem = c.locate(r) or c.texts(r)
    if not problem:
        problem = c.runs(r, targets, ids, special_ids, generation_prompt.strip(),
                         _empty_block(settings) if settings.get("empty_reasoning", "mask") == "mask" else None)
    return Verdict(problem, c.counts)


class _Check:
    """The three steps of :func:`check_sequence`; each returns '' or the first problem."""

    def __init__(self, conv: SourceConversation, required: set, reasoning: str, reasoned: set) -> None:
        self.conv, self.required, self.reasoning, self.reasoned = conv, required, reasoning, reasoned
        self.counts: Dict[str, int] = {}

    def must(self, x: Text) -> bool:
        return x.turn in self.required and (x.kind != "reasoning" or self.reasoning == "train")

    def locate(self, r: _Rendering) -> str:
        """1. Every text, in order (system texts and tool names anywhere); under ``--reasoning-loss
        drop``, no reasoning in its place (between the text before it and the text after it)."""
        conv, pos = self.conv, 0
        dropped: List[Tuple[Text, int]] = []   # reasoning that must not be rendered, and where its place begins
        for i, t in enumerate(conv.turns):
            for n, x in enumerate(t.texts):
                anywhere = t.role == "system"
                if x.kind == "reasoning" and self.reasoning == "drop":
                    dropped.append((x, pos))
                    continue
                x.start, x.end = r.locate(x.forms, 0 if anywhere else pos, self.must(x))
                if x.start < 0 and x.bare:   # (a template that writes the call's arguments as text)
                    x.start, x.end = r.locate(x.bare, 0 if anywhere else pos, self.must(x))
                if x.start >= 0 and x.kind == "reasoning" and (i not in self.reasoned or _user_after(conv, i)) \
                        and n + 1 < len(t.texts):
                    # the history's reasoning, which a template may drop, is in its place only before the
                    # turn's next text (the same thought in a later turn is not this one's)
                    after = _occurrences(r.text, t.texts[n + 1].forms, pos)
                    if after and after[0][0] < x.start:
                        x.start = x.end = -1
                if x.start < 0:
                    if x.kind == "reasoning" and (i not in self.reasoned or self.reasoning == "drop"
                                                  or _user_after(conv, i)):
                        continue  # a template may drop the history's reasoning (a turn a user turn follows)
                    what = "out of order" if _occurrences(r.text, x.forms, 0) else "nowhere"
                    return f"{x.where} ({_label(conv, x)} {x.forms[0][:40]!r}) is {what} in the rendering"
                if not anywhere:
                    problem = _rendered(r.text, dropped, x.start)
                    if problem:
                        return problem
                    dropped, pos = [], x.end
        problem = _rendered(r.text, dropped, len(r.text))
        if problem:
            return problem
        for x in conv.tools:
            x.start, x.end = r.locate(x.forms, 0, False)
            if x.start < 0:
                return f"{x.where} (tool definition {x.forms[0]!r}) is nowhere in the rendering"
        return ""

    def texts(self, r: _Rendering) -> str:
        """2. The tokens of each text are trained exactly when the settings train it."""
        conv = self.conv
        self.owner = np.full(r.trained.size, -2, dtype=np.int64)   # -2: no text, -1: a tool definition
        self.role_of = [""] * r.trained.size
        for x in [x for t in conv.turns for x in t.texts if x.start >= 0] + conv.tools:
            lo, hi = r.tokens(x.start, x.end)
            self.owner[lo:hi] = x.turn
            for j in range(lo, hi):
                self.role_of[j] = _role(conv, x)
            got = r.trained[lo:hi]
            if self.must(x) and not got.all():
                return f"{x.where} ({_label(conv, x)}) is not trained, but the settings train it"
            if not self.must(x) and got.any():
                return f"{x.where} ({_label(conv, x)}) is trained, but the settings never train it"
        return ""

    def runs(self, r: _Rendering, targets, ids, special_ids, gp: str, empty) -> str:
        """3. Each trained run: one turn's, ending with an end-of-turn token, no generation prompt,
        no empty reasoning block; trained tokens counted per role."""
        runs = np.split(targets, np.flatnonzero(np.diff(targets) != 1) + 1) if targets.size else []
        bare = sum(1 for i in self.required if not self.conv.turns[i].texts)
        for run in runs:
            turns = {int(o) for o in self.owner[run] if o >= 0}
            piece = r.text[int(r.starts[run[0]]):int(r.starts[run[-1] + 1]) if run[-1] + 1 < r.starts.size
                           else len(r.text)]
            if not turns:
                bare -= 1
                if bare < 0:
                    return f"trained text {piece[:60]!r} belongs to no trained turn"
            elif len(turns) > 1:
                return f"one trained run spans several turns: {piece[:60]!r}"
            kind = "tool_call" if turns and self.conv.turns[turns.pop()].calls else "assistant"
            if int(ids[run[-1]]) not in special_ids:
                return f"trained run {piece[-60:]!r} does not end with an end-of-turn token"
            if gp and gp in piece:
                return f"the generation prompt {gp!r} is trained"
            if empty is not None and empty.search(piece):
                return f"an empty reasoning block is trained in {piece[:60]!r}"
            for j in run:
                key = self.role_of[j] or kind
                self.counts[key] = self.counts.get(key, 0) + 1
        if bare > 0:
            return f"{bare} trained turn(s) with no text have no trained end-of-turn"
        return ""


def _user_after(conv: SourceConversation, i: int) -> bool:
    """True when a user turn follows turn ``i``: thinking templates (Qwen3, Qwen3.5, GLM-4.7, MiniMax-M2)
    render a turn's reasoning only while no user turn follows it, and the turn is then trained as
    rendered, without it (docs/INPUTS.md, "Thinking templates")."""
    return any(t.role == "user" for t in conv.turns[i + 1:])


def _rendered(text: str, dropped: List[Tuple[Text, int]], before: int) -> str:
    """'' unless a dropped reasoning text is rendered in its place (from where it begins to ``before``)."""
    for x, at in dropped:
        if any(a < before for a, _ in _occurrences(text, x.forms, at)):
            return f"{x.where} (reasoning {x.forms[0][:40]!r}) is rendered, but --reasoning-loss drop drops it"
    return ""


def _label(conv: SourceConversation, x: Text) -> str:
    if x.kind == "content":
        return f"{conv.turns[x.turn].role} content"
    return {"reasoning": "reasoning", "call": "tool call", "result": "tool result", "tool": "tool definition"}[x.kind]


def _role(conv: SourceConversation, x: Text) -> str:
    if x.turn < 0:
        return "tools"
    if x.kind == "reasoning":
        return "reasoning"
    if x.kind == "call":
        return "tool_call"
    return conv.turns[x.turn].role


def _empty_block(settings: dict):
    opening, closing = settings.get("reasoning_tags") or ("<think>", "</think>")
    return re.compile(re.escape(opening) + r"\s*" + re.escape(closing))


def cut_at(conv: SourceConversation, trained: List[int], ordinal: int) -> Tuple[SourceConversation, List[int]]:
    """``per-turn``: the conversation up to the ``ordinal``-th trained turn, which alone is trained."""
    if ordinal >= len(trained):
        raise Unverifiable(f"the record has {len(trained)} trained turns, the store {ordinal + 1} or more")
    k = trained[ordinal]
    return SourceConversation(conv.turns[:k + 1], conv.tools), [k]


def token_record_mask(record: dict) -> Tuple[np.ndarray, np.ndarray]:
    """A pre-tokenized record's ids and label-aligned mask, read directly."""
    ids = np.asarray(record["input_ids"], dtype=np.int64)
    if record.get("loss_mask") is not None:
        trained = np.asarray(record["loss_mask"], dtype=np.uint8)
    else:
        trained = np.zeros(ids.size, dtype=np.uint8)
        trained[int(record["answer_start_idx"]):] = 1
    mask = np.zeros(ids.size, dtype=np.uint8)
    mask[:-1] = trained[1:]
    return ids, mask


def raw_prompt(record: dict, settings: dict) -> Optional[Tuple[str, str]]:
    """``(prompt, completion)`` of a prompt/completion record encoded raw, else None."""
    if settings.get("prompt_format") != "raw":
        return None
    return record[settings["prompt_key"]], record[settings["completion_key"]]
