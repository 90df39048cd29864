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
from ..reader import MMapIndexedDataset
from .chat import encode_tokens, load_chat_tokenizer
from .encode import encoding_of
from .inputs import parse_record
from .policy import trained_turns
from .partitions import read_batches
from .planfile import PackPlan


def _runs(positions: np.ndarray) -> List[np.ndarray]:
    if positions.size == 0:
        return []
    return np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1)


def _visible_answer(content: str) -> str:
    return content.rsplit("</think>", 1)[-1].strip()


def _expected_ok(loss_on, tok, kind, payload, ids, mask, path, line, turn: int = 0, tok_policy=None) -> str:
    """'' when the sequence's trained tokens are what the loss mode requires, else why not."""
    targets = np.flatnonzero(mask) + 1
    if kind == "tokens":
        _, want = encode_tokens(*payload, None, path, line)
        return "" if np.array_equal(want, mask) else "mask differs from the input's mask"
    if kind == "prompt":
        want = [payload[1] + (tok.hf.eos_token or "")]
    elif loss_on == "all":
        if targets.size != ids.size - 1:
            return f"{targets.size} trained tokens, expected {ids.size - 1}"
        conv = tok.prepare(payload, tok_policy, path, line)
        return "" if tok.decode(ids) == tok.render_conversation(conv) else "decoded text differs from the rendering"
    else:
        if loss_on == "per-turn":
            k = trained_turns(payload, "assistant")[turn]
            payload = payload.cut(k)
        why = _same_as_reference(tok, payload, loss_on, ids, mask, path, line)
        if why:
            return why
        contents = [payload.messages[k]["content"] for k in trained_turns(payload, "assistant")]
        want = contents if loss_on == "assistant" else contents[-1:]
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


def _locate(plan: PackPlan, shards, chosen: np.ndarray) -> Dict[int, tuple]:
    """{store sequence id: (staged prefix, pack in shard, sequence in pack)} for ``chosen``."""
    where = {}
    for i in range(len(plan.splits)):
        arrays = plan.arrays(i)
        ids = np.asarray(arrays["sequence_ids"])
        positions = np.flatnonzero(np.isin(ids, chosen))
        packs = np.searchsorted(arrays["pack_offsets"], positions, side="right") - 1
        shard_of = np.searchsorted(arrays["shard_starts"], packs, side="right") - 1
        for pos, b, k in zip(positions, packs, shard_of):
            staged = next(s.staged for s in shards if s.split == i and s.shard == k)
            where[int(ids[pos])] = (staged, int(b - arrays["shard_starts"][k]),
                                    int(pos - arrays["pack_offsets"][b]))
    return where


def _source_records(store, wanted: Dict[int, set]) -> dict:
    """{(partition, line): raw record} for the requested lines, reading only their partitions."""
    found = {}
    for k, lines in wanted.items():
        part = store.partitions[k]
        path = store.input_path(part.file)
        for batch in read_batches(path, part, 1024, 1 << 62):
            found.update(((k, line), raw) for line, raw in batch if line in lines)
            if all((k, line) in found for line in lines):
                break
    return found


def _choose(store, plan: PackPlan, trunc: int, count: int, seed: int) -> np.ndarray:
    """Store ids of ``count`` planned conversations no longer than ``trunc`` (seeded), how many
    planned ones are longer (their masks are cut, so not checkable), and how many are not."""
    lengths = np.concatenate([store.rows(k)["length"] for k in range(len(store.partitions))])
    planned = np.zeros(lengths.size, dtype=bool)
    for i in range(len(plan.splits)):
        planned[np.asarray(plan.arrays(i)["sequence_ids"])] = True
    eligible = np.flatnonzero(planned & (lengths <= trunc))
    rng = np.random.default_rng(seed + 1)
    chosen = np.sort(rng.choice(eligible, size=min(count, eligible.size), replace=False))
    return chosen, int(planned.sum() - eligible.size), int(eligible.size)


def verify_masks(store, plan_path: str, shards, job, count: int) -> dict:
    """Check ``count`` random conversations (seeded). Raises ShardError listing the failures."""
    if not job.tokenizer_path and store.tokenizer is not None:
        raise ShardError("--verify-masks needs the tokenizer to decode", field="verify_masks",
                         hint="pass --tokenizer (the one the store was tokenized with)")
    template = store.identity["encode"].get("chat_template")  # --chat-template, when the run had one
    tok = load_chat_tokenizer(job.tokenizer_path, template) if store.tokenizer is not None else None
    if tok is not None and tok.identity()["files_sha256"] != store.tokenizer["files_sha256"]:
        raise ShardError("--verify-masks: this is not the tokenizer the store was tokenized with",
                         path=job.tokenizer_path, field="tokenizer",
                         expected=store.tokenizer["files_sha256"], actual=tok.identity()["files_sha256"])
    encode = store.identity["encode"]
    schema, policy = encoding_of(encode)
    plan = PackPlan(plan_path)
    chosen, truncated, eligible = _choose(store, plan, job.settings.truncate_to, count, job.settings.seed)
    starts = store.starts()
    part_of = np.searchsorted(starts, chosen, side="right") - 1
    wanted: Dict[int, set] = {}
    line_of = {}
    turn_of = {}
    for g, k in zip(chosen, part_of):
        lines = store.rows(int(k))["line"]
        local = int(g - starts[k])
        line_of[int(g)] = int(lines[local])
        turn_of[int(g)] = local - int(np.searchsorted(lines, lines[local]))  # per-turn: the turn's ordinal
        wanted.setdefault(int(k), set()).add(line_of[int(g)])
    sources = _source_records(store, wanted)
    where = _locate(plan, shards, chosen)
    failures, opened = [], {}
    for g, k in zip(chosen, part_of):
        g, k = int(g), int(k)
        staged, pack_i, seq = where[g]
        ds = opened.setdefault(staged, MMapIndexedDataset(staged))
        pack = ds[pack_i]
        start = int(pack.seq_start_id[seq])
        n = int(store.part(k).sequence_lengths[g - starts[k]])
        ids = np.asarray(pack.input_ids[start:start + n], dtype=np.int64)
        mask = np.asarray(pack.loss_mask[start:start + n])
        name, line = store.inputs[store.partitions[k].file]["name"], line_of[g]
        kind, payload = parse_record(sources[(k, line)], name, line, encode["input_format"],
                                     encode["prompt_key"], encode["completion_key"], schema)
        why = _expected_ok(encode["loss_on"], tok, kind, payload, ids, mask, name, line, turn_of[g], policy)
        if why:
            failures.append(f"{name}:{line}: {why}")
    if failures:
        raise ShardError(f"--verify-masks: {len(failures)} of {chosen.size} conversations have wrong masks; "
                         f"first: {failures[0]}", field="loss_mask",
                         hint="the chat template and the mask logic disagree; nothing was published")
    if chosen.size < count:
        import logging

        logging.getLogger("megatron_sft_idx.preprocess").info(
            "verify-masks: %d of %d requested: %d written conversations are untruncated, %d truncated ones "
            "are not sampled", chosen.size, count, eligible, truncated)
    return {"checked": int(chosen.size), "failures": 0, "skipped_truncated": truncated, "requested": int(count),
            "eligible": eligible}
