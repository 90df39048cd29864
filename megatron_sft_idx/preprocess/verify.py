"""``--verify-masks N``: decode N random conversations back from the written shards.

Two checks per sampled sequence, both from the source record:

* exact: the record is encoded again by the reference path (one record at a
  time, prefix renders, ``tokenizers`` offsets; for ``per-turn`` the prefix that
  ends at that sequence's turn) and its ids and mask must equal the shard's;
* meaning, computed without the mask code: the trained spans (label-aligned mask
  → target tokens) decoded must be what the loss mode trains: for each trained
  assistant turn, a run that holds its visible answer (the content after any
  ``</think>``, stripped; the whole content when the template renders it verbatim)
  and ends in exactly one special (end-of-turn) token; under ``all`` the whole
  rendering; for prompt/completion the completion plus EOS; for pre-tokenized
  records the input mask itself.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np

from ..errors import ShardError
from ..packing import truncation_length
from ..reader import MMapIndexedDataset
from .chat import assistant_turns, encode_tokens
from .inputs import iter_batches, parse_record


def _runs(positions: np.ndarray) -> List[np.ndarray]:
    if positions.size == 0:
        return []
    return np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1)


def _locate(plans, conv: int):
    """(split plan, shard index, pack index in shard, sequence index in pack) of a conversation."""
    for plan in plans:
        pos = int(np.searchsorted(plan.members, conv))
        if pos < plan.members.size and plan.members[pos] == conv:
            a = plan.assignment
            b = int(a.bin_of[pos])
            members = a.items[a.offsets[b]:a.offsets[b + 1]]
            seq = int(np.searchsorted(members, pos))
            shard = int(np.searchsorted(plan.shard_starts, b, side="right")) - 1
            return plan, shard, b - int(plan.shard_starts[shard]), seq
    raise ShardError(f"internal error: conversation {conv} is in no split")


def _source_records(files, wanted: Dict[int, set]):
    """{(file_index, line): raw record} for the requested lines."""
    found = {}
    for fi, lines in wanted.items():
        for _, records in iter_batches(files[fi], 1024):
            for line, raw in records:
                if line in lines:
                    found[(fi, line)] = raw
    return found


def _visible_answer(content: str) -> str:
    return content.rsplit("</think>", 1)[-1].strip()


def _expected_ok(cfg, tok, kind, payload, ids, mask, path, line, turn: int = 0) -> str:
    """'' when the sequence's trained tokens are what the loss mode requires, else why not."""
    targets = np.flatnonzero(mask) + 1
    if kind == "tokens":
        _, want = encode_tokens(*payload, None, path, line)
        return "" if np.array_equal(want, mask) else "mask differs from the input's mask"
    if kind == "prompt":
        want = [payload[1] + (tok.hf.eos_token or "")]
    elif cfg.loss_on == "all":
        if targets.size != ids.size - 1:
            return f"{targets.size} trained tokens, expected {ids.size - 1}"
        return "" if tok.decode(ids) == tok.render(payload) else "decoded text differs from the rendering"
    else:
        if cfg.loss_on == "per-turn":
            k = assistant_turns(payload, "assistant")[turn]
            payload = payload[:k + 1]
        why = _same_as_reference(tok, payload, cfg.loss_on, ids, mask, path, line)
        if why:
            return why
        contents = [m["content"] for m in payload if m["role"] == "assistant"]
        want = contents if cfg.loss_on == "assistant" else contents[-1:]
    got = [tok.decode(ids[r]) for r in _runs(targets)]
    if len(got) != len(want):
        return f"{len(got)} trained spans, expected {len(want)}"
    for g, w in zip(got, want):
        if kind == "prompt" and g != w:
            return f"trained {g!r}, expected {w!r}"
        if kind == "chat" and not _turn_ok(tok, g, w):
            return f"trained {g!r}, expected {w!r} (its visible answer) + one end-of-turn token"
    return ""


def _turn_ok(tok, got: str, content: str) -> bool:
    if got.startswith(content) and got[len(content):] in tok.special_tokens:
        return True
    ends = [t for t in tok.special_tokens if got.endswith(t)]
    return bool(ends) and _visible_answer(content) in got[:-len(ends[0])]


def _same_as_reference(tok, messages, loss_on, ids, mask, path, line) -> str:
    mode = "last-turn" if loss_on == "per-turn" else loss_on
    try:
        want_ids, want_mask = tok.encode_chat(messages, mode, path, line)
    except ShardError as exc:
        return f"the reference path refuses this record ({exc})"
    if not np.array_equal(want_ids, ids):
        return "token ids differ from the reference encoding"
    if not np.array_equal(want_mask, mask):
        return "loss mask differs from the reference encoding"
    return ""


def _turn_of(sp, conv: int) -> int:
    """How many earlier sequences came from the same record (``per-turn``: the turn's ordinal)."""
    k = conv
    while k > 0 and sp.line[k - 1] == sp.line[conv] and sp.file_index[k - 1] == sp.file_index[conv]:
        k -= 1
    return conv - k


def verify_masks(cfg, tok, plans, sp, files, mult: int, count: int) -> dict:
    """Check ``count`` random conversations (seeded). Raises ShardError listing the failures."""
    trunc = truncation_length(cfg.pack_size, mult, cfg.pad_layout)
    rng = np.random.default_rng(cfg.seed + 1)
    eligible = np.flatnonzero(sp.lengths <= trunc)
    chosen = np.sort(rng.choice(eligible, size=min(count, eligible.size), replace=False))
    wanted: Dict[int, set] = {}
    for c in chosen:
        wanted.setdefault(int(sp.file_index[c]), set()).add(int(sp.line[c]))
    sources = _source_records(files, wanted)
    failures, opened = [], {}
    for c in chosen:
        fi, line = int(sp.file_index[c]), int(sp.line[c])
        plan, shard, pack_i, seq = _locate(plans, int(c))
        ds = opened.setdefault(plan.staged[shard], MMapIndexedDataset(plan.staged[shard]))
        pack = ds[pack_i]
        start = int(pack.seq_start_id[seq])
        n = int(sp.lengths[c])
        ids = np.asarray(pack.input_ids[start:start + n], dtype=np.int64)
        mask = np.asarray(pack.loss_mask[start:start + n])
        kind, payload = parse_record(sources[(fi, line)], files[fi], line, cfg.input_format,
                                     cfg.prompt_key, cfg.completion_key)
        turn = _turn_of(sp, int(c)) if cfg.loss_on == "per-turn" else 0
        why = _expected_ok(cfg, tok, kind, payload, ids, mask, files[fi], line, turn)
        if why:
            failures.append(f"{files[fi]}:{line}: {why}")
    if failures:
        raise ShardError(f"--verify-masks: {len(failures)} of {chosen.size} conversations have wrong masks; "
                         f"first: {failures[0]}", field="loss_mask",
                         hint="the chat template and the mask logic disagree; nothing was published")
    return {"checked": int(chosen.size), "failures": 0, "skipped_truncated": int(sp.lengths.size - eligible.size)}
