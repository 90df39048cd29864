"""An independent decoder of written shards, for the family tests: it reads the five files with
numpy as docs/FORMAT.md lays them out (not through the package's reader), decodes each sequence
with the tokenizer's own ``tokenizer.json`` (``tokenizers``, not the package), and checks each
record against its source JSON as the test wrote it (not the pipeline's normalised messages):

* every reply, tool call and (per policy) reasoning block the settings train is trained once:
  its texts are in exactly one trained run, the runs of a record are its trained turns, in order;
* each trained run ends with a stop token of the family (:data:`STOPS` in the test);
* nothing else is trained: no user, system or tool-result text, no untrained reasoning, no
  generation prompt, in any trained run.

Records are found in the shards by a marker each test record carries in its first user message.
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from typing import Dict, List, Sequence

import numpy as np
from tokenizers import Tokenizer

_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
MARK = re.compile(r"rec#(\d+)#")


def read_shard(prefix: str):
    """``[(ids, label-aligned mask)]`` of every sequence of the shard at ``prefix``."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\x00\x00", prefix
    code = idx[17]
    n = struct.unpack_from("<Q", idx, 18)[0]
    lengths = np.frombuffer(idx, dtype="<i4", count=n, offset=34)
    pointers = np.frombuffer(idx, dtype="<i8", count=n, offset=34 + 4 * n)
    dtype = np.dtype(_DTYPES[code])
    tokens = np.fromfile(prefix + ".bin", dtype=dtype)
    loss = np.fromfile(prefix + ".loss.bin", dtype=np.uint8)
    with open(prefix + ".seq.idx", "rb") as f:
        head = f.read(64)
        assert head[:8] == b"MSFTSEQ\x00", prefix
        packs, = struct.unpack_from("<Q", head, 16)
        csr, = struct.unpack_from("<Q", head, 48)
        f.seek(csr)
        offsets = np.frombuffer(f.read(8 * (packs + 1)), dtype="<i8")
    starts = np.fromfile(prefix + ".seq.bin", dtype="<i4")
    out = []
    for i in range(n):
        first = int(pointers[i]) // dtype.itemsize
        ids = tokens[first:first + int(lengths[i])].astype(np.int64)
        mask = loss[first:first + int(lengths[i])]
        bounds = list(starts[offsets[i]:offsets[i + 1]]) + [int(lengths[i])]
        for a, b in zip(bounds, bounds[1:]):
            out.append((ids[a:b], mask[a:b]))
    return out


def shard_prefixes(output_prefix: str) -> List[str]:
    """The shard prefixes a run wrote at ``output_prefix`` (one shard, or a set)."""
    if os.path.exists(output_prefix + ".seq.idx"):
        return [output_prefix]
    directory, base = os.path.split(output_prefix)
    return sorted(os.path.join(directory, n[:-len(".seq.idx")]) for n in os.listdir(directory)
                  if n.startswith(base) and n.endswith(".seq.idx"))


def _runs(mask: np.ndarray) -> List[np.ndarray]:
    t = np.flatnonzero(mask) + 1   # label-aligned: position j trains token j + 1
    return np.split(t, np.flatnonzero(np.diff(t) != 1) + 1) if t.size else []


class Decoded:
    """One sequence, decoded: its text and its trained runs (text, last token id)."""

    def __init__(self, tok: Tokenizer, ids, mask) -> None:
        self.text = tok.decode(ids.tolist(), skip_special_tokens=False)
        self.runs = [(tok.decode(ids[r].tolist(), skip_special_tokens=False), int(ids[r[-1]])) for r in _runs(mask)]
        m = MARK.search(self.text)
        self.record = int(m.group(1)) if m else -1


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_json: str, stamp: tuple) -> Tokenizer:
    """The decoder's own ``tokenizers`` load, once per file and version of it in a test process
    (a 150k-vocabulary tokenizer.json takes ~1 s to load; decoding does not change it)."""
    return Tokenizer.from_file(tokenizer_json)


def decode_output(tokenizer_json: str, output_prefix: str) -> Dict[int, List[Decoded]]:
    """Every sequence the run wrote, by the record number its marker names."""
    st = os.stat(tokenizer_json)
    tok = _tokenizer(os.path.realpath(tokenizer_json), (st.st_size, st.st_mtime_ns, st.st_ino))
    out: Dict[int, List[Decoded]] = {}
    for prefix in shard_prefixes(output_prefix):
        for ids, mask in read_shard(prefix):
            d = Decoded(tok, ids, mask)
            out.setdefault(d.record, []).append(d)
    return out


# --------------------------------------------------------------------------- the source, read here


def _calls(message) -> List[tuple]:
    """``(name, [argument value texts])`` of an OpenAI message's calls, or a ShareGPT/xLAM value."""
    out = []
    for c in message:
        fn = c.get("function", c)
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            args = json.loads(args)
        out.append((fn["name"], [v for v in args.values() if isinstance(v, str)]))
    return out


def source_turns(record: dict) -> List[dict]:
    """``[{"role", "texts", "reasoning", "calls"}]`` of a test record, read from its JSON."""
    turns = []
    system = record.get("system")
    if system:
        turns.append({"role": "system", "texts": [system]})
    if "messages" in record:
        for m in record["messages"]:
            role = m["role"]
            t = {"role": role, "texts": [m["content"].strip()] if isinstance(m.get("content"), str)
                 and m["content"].strip() else [], "reasoning": None, "calls": _calls(m.get("tool_calls") or [])}
            content = m.get("content") or ""
            if role == "assistant" and content.lstrip().startswith("<think>") and "</think>" in content:
                thought, _, answer = content.partition("</think>")
                t["reasoning"] = thought.replace("<think>", "").strip()
                t["texts"] = [answer.strip()] if answer.strip() else []
            if m.get("reasoning_content"):
                t["reasoning"] = m["reasoning_content"].strip()
            turns.append(t)
    elif "conversations" in record:
        roles = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}
        for m in record["conversations"]:
            role = roles[m["from"]]
            if m["from"] == "function_call":
                calls = json.loads(m["value"])
                turns.append({"role": role, "texts": [], "reasoning": None,
                              "calls": _calls(calls if isinstance(calls, list) else [calls])})
            else:
                turns.append({"role": role, "texts": [m["value"].strip()], "reasoning": None, "calls": []})
    elif "query" in record:
        answers = record["answers"]
        turns.append({"role": "user", "texts": [record["query"]], "reasoning": None, "calls": []})
        turns.append({"role": "assistant", "texts": [], "reasoning": None,
                      "calls": _calls(json.loads(answers) if isinstance(answers, str) else answers)})
    return turns


def check_record(record: dict, decoded: Sequence[Decoded], stops: Sequence[int], *, tool_calls: str = "train",
                 reasoning: str = "train", history_reasoning: str = "dropped", loss_on: str = "assistant") -> str:
    """'' when the record's sequences train exactly what the settings say, else the first problem.
    ``history_reasoning``: what the family's template does with the reasoning of a turn a user turn
    follows (``dropped``: not rendered, so not trained; ``kept``: rendered, trained per policy);
    ``loss_on``: ``assistant`` (every turn, one sequence), ``per-turn`` (one sequence per turn, each
    training its last turn with its reasoning) or ``last-turn`` (the final turn only)."""
    turns = source_turns(record)
    trained = [i for i, t in enumerate(turns) if t["role"] == "assistant" and not (tool_calls == "mask" and t["calls"])]
    if loss_on == "last-turn":
        trained = trained[-1:]
    per_turn = loss_on == "per-turn"
    if not decoded:
        return "no sequence of the record is in the shards"
    runs = [r for d in decoded for r in d.runs]
    if per_turn and len(decoded) != len(trained):
        return f"{len(decoded)} sequences for {len(trained)} trained turns"
    if per_turn and any(len(d.runs) != 1 for d in decoded):
        return f"a per-turn sequence trains {[len(d.runs) for d in decoded]} runs, not one each"
    if len(runs) < len(trained) or (loss_on == "last-turn" and len(runs) != 1):
        return f"{len(runs)} trained runs for {len(trained)} trained turns: {[r[0][:40] for r in runs]}"
    for text, last in runs:
        if last not in stops:
            return f"trained run {text[-50:]!r} does not end with a stop of the family"
    joined = "\x00".join(r[0] for r in runs)
    for i, t in enumerate(turns):
        last_user = any(u["role"] == "user" for u in turns[i + 1:])
        for x in t["texts"] + [v for c in t.get("calls", []) for v in [c[0]] + c[1]]:
            n = joined.count(x)
            if i in trained and n < 1:
                return f"{t['role']} text {x[:40]!r} of turn {i} is not trained"
            if i not in trained and n and t["role"] != "assistant":
                return f"{t['role']} text {x[:40]!r} of turn {i} is trained"
            if i not in trained and n and loss_on == "last-turn" and not any(x in y for y in _texts_of(turns, trained)):
                return f"{t['role']} text {x[:40]!r} of untrained turn {i} is trained under last-turn"
        thought = t.get("reasoning")
        if thought:
            want = i in trained and reasoning == "train" and not (history_reasoning == "dropped" and last_user
                                                                 and not per_turn)
            got = joined.count(thought)
            if want and got != 1 and not per_turn:
                return f"the reasoning of turn {i} is trained {got} times"
            if want and per_turn and got < 1:
                return f"the reasoning of turn {i} is not trained in its own sequence"
            if not want and got:
                return f"the reasoning of turn {i} is trained, but the settings do not train it"
    return ""


def _texts_of(turns: List[dict], which: Sequence[int]) -> set:
    """Every text (content, call name and argument value) of the turns ``which``: a text of an
    untrained assistant turn that one of them holds (``Paris2`` in ``It is sunny in Paris2.``)
    may be trained there."""
    return {x for i in which for x in turns[i]["texts"] + [v for c in turns[i].get("calls", []) for v in [c[0]] + c[1]]}
