"""The checks on the staged output, before anything is published: ``--verify-masks`` and ``--check``.

:func:`run_gate` runs the promotion gate on every staged shard. ``--verify-masks N`` (and the
sample ``--check`` takes, :func:`verify_count`) checks N written conversations twice:

* exact: the record is encoded again by the reference path (one record at a time, prefix
  renders, ``tokenizers`` offsets; for ``per-turn`` the sequence of that turn) and its ids and
  mask must equal the shard's -- the batched fast path is what this catches;
* against the source (:mod:`.source_check`): the record as read from the file, walked by its own
  extraction and never through the pipeline's mapping, must have every text in the rendering in
  order, exactly the policy's turns trained (each reply and tool call with its end-of-turn,
  nothing else), and its trained tokens are counted per role -- the mapping, the template and
  the mask rules are what this catches. Pre-tokenized records: the mask the record holds;
  raw prompt/completion: the completion and EOS, decoded.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from ..errors import ShardError
from ..format import PUBLISH_ORDER
from ..gate import check
from ..jsondoc import parse_record_json
from ..reader import MMapIndexedDataset
from .records.chat import load_chat_tokenizer
from .records.masks import trained_from_offsets
from .records.encode import encoding_of
from .records.inputs import parse_record
from .records.partitions import read_batches
from .planfile import PackPlan
from .files import LOCAL, Files
from .store import SequenceStore, part_prefix, rows_paths
from .summary import check_gate, check_verify
from .records import source_check as sc

log = logging.getLogger("megatron_sft_idx.preprocess")
#: conversations ``--check`` verifies against their source when ``--verify-masks`` is not given
CHECK_SAMPLE = 16


def _runs(positions: np.ndarray) -> List[np.ndarray]:
    if positions.size == 0:
        return []
    return np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1)


class _Checker:
    """One tokenizer and the run's encoding settings; checks sequences one at a time."""

    def __init__(self, tok, encode: dict) -> None:
        self.tok = tok
        self.encode = encode
        self.schema, self.policy = encoding_of(encode)
        policy = encode.get("loss_policy") or {}
        self.settings = {"loss_on": encode["loss_on"], "prompt_key": encode["prompt_key"],
                         "completion_key": encode["completion_key"],
                         "prompt_format": encode.get("prompt_format", "chat"),
                         "tool_calls": policy.get("tool_calls", "train"),
                         "reasoning": policy.get("reasoning", "train"),
                         "empty_reasoning": policy.get("empty_reasoning", "mask"),
                         "reasoning_tags": tuple(policy.get("reasoning_tags", ("<think>", "</think>")))}
        self.counts: Dict[str, int] = {}
        self._kept = False   # the last sequence _reference read is a kept prompt-only one
        if tok is not None:
            self.special_ids = {tok.backend.token_to_id(t) for t in tok.special_tokens} - {None}
            self.generation_prompt = _generation_prompt(tok)

    def check(self, raw, ids, mask, name: str, line: int, ordinal: int) -> str:
        """'' when the sequence is right, else why not."""
        try:
            if isinstance(raw, (bytes, str)):
                sc.one_meaning(raw)   # (its own reading of the bytes, not the mapping's decoder)
            record = parse_record_json(raw, max_length=sys.maxsize) if isinstance(raw, (bytes, str)) else raw
            shape = sc.shape_of(record, self.encode["input_format"], self.encode["prompt_key"])
            if shape == "tokens":
                want_ids, want_mask = sc.token_record_mask(record)
                if not (np.array_equal(want_ids, ids) and np.array_equal(want_mask, mask)):
                    return "the ids or mask differ from the record's"
                self._count({"tokens": int(mask.sum())})
                return ""
            raw_pc = sc.raw_prompt(record, self.settings) if shape == "prompt" else None
            if raw_pc is not None:
                return self._raw_prompt(raw_pc, ids, mask)
            why, text, starts = self._reference(raw, ids, mask, name, line, ordinal)
            if why:
                return why
            source = sc.read_source(record, shape, self.settings)
            loss_on = self.settings["loss_on"]
            if self._kept:   # --prompt-only keep: every text rendered, none trained
                verdict = sc.check_sequence(source, [], text, starts, ids, mask, self.settings, self.special_ids,
                                            self.generation_prompt)
                self._count(verdict.trained)
                return verdict.problem
            trained = sc.trained_turns(source, "assistant" if loss_on in ("per-turn", "all") else loss_on,
                                       self.settings)
            if loss_on == "per-turn":
                source, trained = sc.cut_at(source, trained, ordinal)
            elif loss_on == "all":
                return self._all(source, trained, text, ids, mask)
            verdict = sc.check_sequence(source, trained, text, starts, ids, mask, self.settings,
                                        self.special_ids, self.generation_prompt)
        except (sc.Unverifiable, KeyError, TypeError, ValueError, AttributeError) as exc:
            return f"the source record cannot be checked ({exc.__class__.__name__}: {exc})"
        self._count(verdict.trained)
        return verdict.problem

    def _count(self, counts: Dict[str, int]) -> None:
        for role, n in counts.items():
            self.counts[role] = self.counts.get(role, 0) + n

    def _reference(self, raw, ids, mask, name, line, ordinal):
        """``(why, rendering, token starts)``: the record through the reference path, compared.

        Under ``--prompt-only keep`` a record the path trains nothing of (it refuses it as
        ``no_trainable_tokens``, or its mask comes out all zero) is rendered whole, as
        ``--loss-on all`` renders it, with an all-zero mask: what the encoder stored for it
        (``self._kept`` says so to :meth:`check`)."""
        tok, loss_on = self.tok, self.settings["loss_on"]
        keep = self.encode.get("prompt_only") == "keep"
        self._kept = False
        try:
            kind, payload = parse_record(raw, name, line, self.encode["input_format"], self.encode["prompt_key"],
                                         self.encode["completion_key"], self.schema)
            conv = tok.prepare(payload, self.policy, name, line)
            try:
                if loss_on == "per-turn":
                    text, spans = tok.turn_texts_and_spans(conv, name, line, self.policy)[ordinal]
                else:
                    text, spans = tok.chat_text_and_spans(conv, loss_on, name, line, self.policy)
            except ShardError as exc:
                if not (keep and getattr(exc, "reason", None) == "no_trainable_tokens"):
                    raise
                text = None
            enc, want = self._encoded(text, spans) if text is not None else (None, None)
            if keep and (want is None or not want.any()):
                self._kept = True
                text, _ = tok.chat_text_and_spans(conv, "all", name, line, self.policy)
                enc, want = self._encoded(text, None)
        except (ShardError, IndexError) as exc:
            return f"the reference path refuses this record ({exc})", "", None
        starts = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
        if not np.array_equal(np.asarray(enc.ids, dtype=np.int64), ids):
            return "token ids differ from the reference encoding" + self._clock(), "", None
        if not np.array_equal(want, mask):
            return "loss mask differs from the reference encoding" + self._clock(), "", None
        return "", text, np.append(starts, len(text))

    def _encoded(self, text: str, spans):
        """``(encoding, label-aligned mask)`` of a rendering: ``spans`` trained (None: nothing;
        under ``--loss-on all`` every token but the first)."""
        enc = self.tok.backend.encode(text, add_special_tokens=False)
        starts = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
        if spans is None:
            trained = np.zeros(starts.size, dtype=np.uint8)
        elif self.settings["loss_on"] == "all":
            trained = np.ones(starts.size, dtype=np.uint8)
            trained[:1] = 0
        else:
            trained = trained_from_offsets(starts, spans)
        want = np.zeros(trained.size, dtype=np.uint8)
        want[:-1] = trained[1:]
        return enc, want

    def _clock(self) -> str:
        """For a template that reads the clock: the date the check rendered, and the store's."""
        if not self.tok.reads_clock:
            return ""
        recorded = self.encode.get("template_date")
        return (f" (the chat template reads the clock: checked with template date {self.tok.template_date}, "
                + ("as the store records)" if recorded else "the store records none: made before dates were "
                   "pinned, it cannot be checked on another day)"))

    def _all(self, source, trained, text, ids, mask) -> str:
        if not mask[:-1].all():
            return f"{int((mask[:-1] == 0).sum())} positions are not trained under --loss-on all"
        verdict = sc.check_sequence(source, [], text, np.zeros(0), ids, np.zeros_like(mask), self.settings,
                                    self.special_ids, "", reasoned=trained[-1:])
        if verdict.problem:
            return verdict.problem
        self._count({"all": int(mask.sum())})
        return ""

    def _raw_prompt(self, pc, ids, mask) -> str:
        prompt, completion = pc
        got = [self.tok.decode(ids[r]) for r in _runs(np.flatnonzero(mask) + 1)]
        want = completion + (self.tok.hf.eos_token or "")
        if got != [want]:
            return f"trained {got!r}, expected {[want]!r}"
        if prompt not in self.tok.decode(ids):
            return "the prompt is not in the sequence"
        self._count({"assistant": int(mask.sum())})
        return ""


def _generation_prompt(tok) -> str:
    """What the template adds for ``add_generation_prompt`` after a user turn ('' when not a suffix)."""
    user = [{"role": "user", "content": "x"}]
    try:
        plain, prompted = tok.render(user), tok.render(user, add_generation_prompt=True)
    except Exception:
        return ""
    return prompted[len(plain):] if prompted.startswith(plain) else ""


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
    date = store.identity["encode"].get("template_date")      # the date a clock-reading template rendered
    args = store.identity["encode"].get("template_args") or {}   # --template-arg, when the run had some
    tok = load_chat_tokenizer(job.tokenizer_path, template, date, args) if store.tokenizer is not None else None
    if tok is not None and tok.identity()["files_sha256"] != store.tokenizer["files_sha256"]:
        raise ShardError("--verify-masks: this is not the tokenizer the store was tokenized with",
                         path=job.tokenizer_path, field="tokenizer",
                         expected=store.tokenizer["files_sha256"], actual=tok.identity()["files_sha256"])
    checker = _Checker(tok, store.identity["encode"])
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
    store.files.fetch([part_prefix(store.directory, k) + s for k in wanted for s in PUBLISH_ORDER]
                      + [staged + s for staged in {w[0] for w in where.values()} for s in PUBLISH_ORDER])
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
        why = checker.check(sources[(k, line)], ids, mask, name, line, turn_of[g])
        if why:
            failures.append(f"{name}:{line}: {why}")
    if failures:
        raise ShardError(f"--verify-masks: {len(failures)} of {chosen.size} conversations fail the check against "
                         f"their source; first: {failures[0]}", field="loss_mask",
                         hint="the input mapping, the chat template or the mask rules lose or mistrain what the "
                              "source holds; nothing was published")
    if chosen.size < count:
        log.info("verify-masks: %d of %d requested: %d written conversations are untruncated, %d truncated ones "
                 "are not sampled", chosen.size, count, eligible, truncated)
    return {"checked": int(chosen.size), "failures": 0, "skipped_truncated": truncated, "requested": int(count),
            "eligible": eligible, "trained_tokens_by_role": dict(sorted(checker.counts.items()))}


def verify_count(job, store) -> int:
    """Conversations to check against their source: ``--verify-masks N``, else with ``--check``
    a sample of :data:`CHECK_SAMPLE` when the tokenizer is at hand (or none is needed)."""
    return job.run.verify_masks or (CHECK_SAMPLE if job.run.check and (job.tokenizer_path or store.tokenizer is None)
                                    else 0)


def checks_schema(doc) -> None:
    """The checks receipt: what ``--verify-masks`` and ``--check`` found (each None when not run)."""
    for key, check_entry in (("verify", check_verify), ("gate", check_gate)):
        entry = doc.doc(key, none=True)
        if entry is not None:
            check_entry(entry)


def run_gate(prefixes, on_shard=None) -> dict:
    """Run the promotion gate on every staged shard.

    Raises:
        ShardError: a shard fails it.
    """
    report = None
    for prefix in prefixes:  # one shard at a time: progress per shard, and the first failure stops
        report = check([prefix], level="standard")
        if not report.passed:
            break
        if on_shard is not None:
            on_shard()
    if report is not None and not report.passed:
        raise ShardError("the gate rejected the output; nothing was published:\n" + report.format_text(),
                         field="check")
    return {"passed": True, "shards": len(prefixes)}


@dataclass(frozen=True)
class GateStep:
    """Unit ``u``: the promotion gate on staged shard ``u`` where the unit runs (a work directory
    in object storage: the task pulls that shard alone); raises as :func:`run_gate`."""

    prefixes: Tuple[str, ...]
    name: str = "check"

    @property
    def writes_to(self) -> str:
        return self.prefixes[0]

    def reads(self, unit: int) -> List[str]:
        return [self.prefixes[unit] + s for s in PUBLISH_ORDER]

    def run(self, unit: int) -> dict:
        return dict(run_gate([self.prefixes[unit]]), unit=unit)


@dataclass(frozen=True)
class VerifyMasksStep:
    """Unit 0: :func:`verify_masks` where the unit runs (a work directory in object storage: the
    task pulls the plan and the store's rows, draws the sample, then fetches the partitions and
    staged shards the sample lands in through its ``files`` view); returns ``{"unit": 0,
    "verify": <its report>}``, raises as it does."""

    store_dir: str
    plan_path: str
    shards: tuple
    job: object
    count: int
    files: Files = LOCAL
    name: str = "verify-masks"

    @property
    def writes_to(self) -> str:
        return self.plan_path

    def reads(self, unit: int) -> List[str]:
        return [self.plan_path] + rows_paths(self.store_dir)

    def run(self, unit: int) -> dict:
        return {"unit": unit, "verify": verify_masks(SequenceStore(self.store_dir, files=self.files), self.plan_path, self.shards,
                                                     self.job, self.count)}
