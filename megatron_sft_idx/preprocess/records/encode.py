"""The batched encoder: raw records -> flat token ids and label-aligned loss masks.

:func:`RecordEncoder.encode_batch` is the one entry point the tokenize stage calls. It
gives exactly what the reference path (:class:`~.chat.ChatTokenizer`, one record at a
time, prefix renders, ``tokenizers`` offsets) gives, record for record, including which
records fail and with which error, but does the work in bulk:

* chat templates are rendered once per conversation (:mod:`.spans`), falling back to
  prefix renders where the one-render method cannot vouch for a conversation;
* every text of the batch is tokenized in one call (:mod:`.fast_tokenizer`, gigatoken),
  trained flags come from one numba pass, and texts it cannot prove go through
  ``tokenizers`` with offsets as the reference does;
* label alignment, the all-zero check and the overlong rules are vectorised.

The staged pipeline's tokenize step calls it with :class:`EncodeOptions` that carry no pack
size: what a conversation *is* does not depend on the packing, so the overlong rules are
applied later, by the plan stage, from the sequence store's lengths (one store serves every
pack size).

A deterministic sample of conversations (every ``SAMPLE_EVERY``-th of a batch) is
also encoded the reference way and compared; a difference stops the run with
:class:`~megatron_sft_idx.errors.ShardError` rather than write different bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...errors import ShardError
from ...packing.padding import padded_length
from .chat import (ChatTokenizer, encode_tokens, load_chat_tokenizer, reasoning_turns, template_rejected,
                   trained_from_offsets)
from .errors import InputError, input_error
from .fast_tokenizer import FastTokenizer
from .inputs import parse_record
from .policy import LossPolicy, trained_turns
from .rendering import check_rendered
from .shapes import REASONING_TAGS, SchemaOptions
from .spans import SpanLocator

SAMPLE_EVERY = 256
SPAN_METHODS = ("auto", "prefix")


@dataclass(frozen=True)
class EncodeOptions:
    """What a worker needs to turn raw records into (ids, label-aligned mask).

    ``pack_size`` and the overlong fields are None for the tokenize stage (the plan stage
    decides overlong sequences); a caller that sets them gets the rules applied per record.
    """

    tokenizer_path: Optional[str]
    vocab_size: Optional[int]
    loss_on: str
    input_format: str
    prompt_key: str
    completion_key: str
    skip_bad: bool
    pack_size: Optional[int] = None   # None: no overlong rules here (the tokenize stage)
    pad_multiple: int = 1
    overlong: str = "truncate"
    truncate_to: Optional[int] = None
    pad_layout: str = "stored"
    tokenizer_backend: str = "auto"   # auto | gigatoken | hf (fast_tokenizer): the same bytes either way
    span_method: str = "auto"         # auto (one render, proven) | prefix (reference): the same bytes
    chat_template: Optional[str] = None   # --chat-template's text, instead of the tokenizer's own
    tool_call_loss: str = "train"         # the loss policies (policy.py)
    reasoning_loss: str = "train"
    empty_reasoning_loss: str = "mask"
    reasoning_tags: Tuple[str, str] = REASONING_TAGS
    prompt_format: str = "chat"           # chat | raw: prompt/completion strings (schemas.py)
    ignore_fields: Tuple[str, ...] = ()   # message fields that carry nothing the model should see

    @property
    def policy(self) -> LossPolicy:
        return LossPolicy(self.tool_call_loss, self.reasoning_loss, self.empty_reasoning_loss,
                          tuple(self.reasoning_tags))

    @property
    def schema(self) -> SchemaOptions:
        return SchemaOptions(self.prompt_key, self.completion_key, self.prompt_format, tuple(self.ignore_fields),
                             tuple(self.reasoning_tags))

    def to_dict(self) -> dict:
        """What decides the encoded bytes (the store's identity): not the backend or span method,
        which are checked to give the same bytes as the reference path. Settings at their
        defaults are left out, so stores made before they existed keep their identity."""
        out = {"vocab_size": self.vocab_size, "loss_on": self.loss_on, "input_format": self.input_format,
               "prompt_key": self.prompt_key, "completion_key": self.completion_key,
               "skip_bad": self.skip_bad}
        if self.chat_template is not None:  # (absent: stores as before the flag)
            out["chat_template"] = self.chat_template
        policy = self.policy.to_dict()
        if policy:
            out["loss_policy"] = policy
        if self.prompt_format != "chat":
            out["prompt_format"] = self.prompt_format
        if self.ignore_fields:
            out["ignore_fields"] = sorted(self.ignore_fields)
        return out


def encoding_of(encode: dict) -> Tuple[SchemaOptions, LossPolicy]:
    """The schema options and loss policy a store's ``identity["encode"]`` records (defaults absent)."""
    policy = encode.get("loss_policy") or {}
    tags = tuple(policy.get("reasoning_tags", REASONING_TAGS))
    schema = SchemaOptions(encode["prompt_key"], encode["completion_key"], encode.get("prompt_format", "chat"),
                           tuple(encode.get("ignore_fields", ())), tags)
    return schema, LossPolicy(policy.get("tool_calls", "train"), policy.get("reasoning", "train"),
                              policy.get("empty_reasoning", "mask"), tags)


@dataclass
class EncodedBatch:
    """Kept sequences of one batch, in record order (``per-turn`` gives several per record)."""

    ids: np.ndarray            # int64, every kept sequence's tokens concatenated
    loss_mask: np.ndarray      # uint8, label-aligned, token-aligned with ids
    lengths: np.ndarray        # int64, tokens per kept sequence
    lines: np.ndarray          # int64, source line of each kept sequence
    skipped: Dict[str, int] = field(default_factory=dict)
    first_skipped: Dict[str, str] = field(default_factory=dict)
    skipped_lines: List[Tuple[int, str]] = field(default_factory=list)   # (line, reason) of every skip
    ignored: Dict[str, int] = field(default_factory=dict)   # record-level keys ignored, by "rule:key"


@dataclass
class _Unit:
    """One text to tokenize: a conversation's rendering (or one of its per-turn renderings)."""

    record: int
    text: str
    spans: List[Tuple[int, int]]
    train_all: bool
    check: bool = False      # cross-check against the reference (sampled)


_FAST: dict = {}


def _load_fast(tok, backend: str):
    """FastTokenizer per (tokenizer, backend), shared in the process and with workers forked after."""
    key = (id(tok), backend)
    if key not in _FAST or _FAST[key][0] is not tok:
        _FAST.clear()
        _FAST[key] = (tok, FastTokenizer.load(tok, backend))
    return _FAST[key][1]


def preload(options) -> None:
    """Load the tokenizers once in the parent, so forked workers start with them (a 128k-token
    tokenizer takes seconds to load); gigatoken then encodes on each worker's own thread."""
    if options.tokenizer_path:
        fast = _load_fast(load_chat_tokenizer(options.tokenizer_path, getattr(options, "chat_template", None)),
                          getattr(options, "tokenizer_backend", "auto"))
        if fast is not None:  # load the numba kernel from its cache here, not once per worker
            ids, off = fast.encode(["warm up"])
            fast.trained_flags(["warm up"], [[(0, 4)]], ids, off)


class RecordEncoder:
    """Encodes batches of raw records for one worker (tokenizer loaded once).

    Args:
        options: an ``EncodeOptions`` (``tokenizer_path``, ``loss_on``, ``skip_bad``, the
            overlong rules, ``tokenizer_backend``, ``span_method``, ...).
    """

    def __init__(self, options) -> None:
        self.options = options
        self.tok = (load_chat_tokenizer(options.tokenizer_path, getattr(options, "chat_template", None))
                    if options.tokenizer_path else None)
        backend = getattr(options, "tokenizer_backend", "auto")
        method = getattr(options, "span_method", "auto")
        self.fast = _load_fast(self.tok, backend) if self.tok else None
        # how each text was handled (tests and --verbose read these)
        self.stats = {"one_render": 0, "prefix_render": 0, "fast_tokens": 0, "reference_tokens": 0}
        self.policy = options.policy if isinstance(options, EncodeOptions) else LossPolicy()
        self.schema = (options.schema if isinstance(options, EncodeOptions)
                       else SchemaOptions(options.prompt_key, options.completion_key))
        self._ignored: Dict[str, int] = {}   # this batch's ignored record-level keys (account_keys)
        self.locator = None
        if (self.tok is not None and self.tok.chat_template is not None and method == "auto"
                and options.loss_on in ("assistant", "last-turn")):
            self.locator = SpanLocator(self.tok)
            if not self.locator.enabled:
                self.locator = None

    # ------------------------------------------------------------------ entry point

    def encode_batch(self, records, path: str) -> EncodedBatch:
        """Encode ``records`` (``[(line, raw)]`` from one file).

        Raises:
            InputError: the first bad record, unless ``skip_bad`` (overlong drops are
                always counted, never raised).
            ShardError: the fast path disagrees with the reference on a sampled record.
        """
        results: List[list] = [[] for _ in records]   # per record: (ids, mask) or InputError items
        units: List[_Unit] = []
        self._ignored = {}
        for i, (line, raw) in enumerate(records):
            try:
                self._prepare(i, line, raw, path, results, units)
            except ShardError as err:  # raised (or skipped) in record order by _collect, as the reference does
                results[i] = [err]
        self._tokenize(units, records, path, results)
        batch = self._collect(records, results, path)
        batch.ignored = self._ignored
        return batch

    # ------------------------------------------------------------------ stages

    def _prepare(self, i, line, raw, path, results, units) -> None:
        o = self.options
        kind, payload = parse_record(raw, path, line, o.input_format, o.prompt_key, o.completion_key, self.schema,
                                     self._ignored)
        if kind == "tokens":
            results[i].append(encode_tokens(*payload, o.vocab_size, path, line))
        elif self.tok is None:
            raise input_error(f"{kind} records need --tokenizer", path, line, reason="missing_key",
                              hint="pass --tokenizer PATH (a local Hugging Face tokenizer)")
        elif kind == "prompt":
            results[i].append(self.tok.encode_prompt(*payload, path, line))
        else:
            self.tok.require_template()
            conv = self.tok.prepare(payload, self.policy, path, line)
            if o.loss_on == "per-turn":
                units.extend(_Unit(i, text, spans, False, i % SAMPLE_EVERY == 0) for text, spans in
                             self.tok.turn_texts_and_spans(conv, path, line, self.policy))
            else:
                units.append(self._chat_unit(i, conv, path, line))

    def _chat_unit(self, i, conv, path, line) -> _Unit:
        loss_on = self.options.loss_on
        check = i % SAMPLE_EVERY == 0
        if loss_on == "all":
            text, _ = self.tok.chat_text_and_spans(conv, "all", path, line, self.policy)
            return _Unit(i, text, [], True, check)
        if self.locator is not None:
            spans, text = self._one_render(conv, path, line)
            if spans is not None:
                if check and (text, spans) != self.tok.chat_text_and_spans(conv, loss_on, path, line, self.policy):
                    raise ShardError(f"{path}:{line}: the one-render assistant spans differ from the "
                                     "prefix-render spans", field="span_method",
                                     hint="rerun with --span-method prefix, and report the template")
                self.stats["one_render"] += 1
                return _Unit(i, text, spans, False, check)
        self.stats["prefix_render"] += 1
        text, spans = self.tok.chat_text_and_spans(conv, loss_on, path, line, self.policy)
        return _Unit(i, text, spans, False, check)

    def _one_render(self, conv, path, line):
        """``(spans, text)`` by one render, checked and refined as the reference does; spans None
        when the method cannot vouch for them, or a check fails (the reference then decides,
        and raises what it raises first)."""
        loss_on = self.options.loss_on
        turns = trained_turns(conv, loss_on, self.policy)
        try:
            text, spans = self.locator.locate(conv.template_messages, turns, conv.tools)
        except Exception as exc:
            raise template_rejected(exc, path, line) from None
        if spans is None:
            return None, text
        try:
            check_rendered(text, conv, reasoning_turns(conv, loss_on, self.policy, turns), self.policy, path, line)
            return self.tok.refined(text, spans, turns, conv, self.policy, path, line), text
        except InputError:
            return None, text

    def _tokenize(self, units: List[_Unit], records, path, results) -> None:
        if not units:
            return
        texts = [u.text for u in units]
        proven = np.zeros(len(units), dtype=np.uint8)
        if self.fast is not None:
            ids, off = self.fast.encode(texts)
            trained, proven = self.fast.trained_flags(texts, [u.spans for u in units], ids, off)
            for k, u in enumerate(units):
                if u.train_all:  # every token but the first: no offsets involved
                    trained[off[k]:off[k + 1]] = 1
                    trained[off[k]:off[k] + 1] = 0
                    proven[k] = 1
        redo = [k for k, u in enumerate(units) if not proven[k] or u.check]
        self.stats["fast_tokens"] += int(proven.sum())
        self.stats["reference_tokens"] += len(units) - int(proven.sum())
        ref = dict(zip(redo, self._reference([texts[k] for k in redo], [units[k] for k in redo])))
        for k, u in enumerate(units):
            if proven[k]:
                got = (ids[off[k]:off[k + 1]], trained[off[k]:off[k + 1]])
                if u.check and not (np.array_equal(got[0], ref[k][0]) and np.array_equal(got[1], ref[k][1])):
                    line = records[u.record][0]
                    raise ShardError(f"{path}:{line}: gigatoken and tokenizers disagree on this conversation "
                                     "(ids or token offsets)", field="tokenizer_backend",
                                     hint="rerun with --tokenizer-backend hf, and report the tokenizer")
            else:
                got = ref[k]
            line = records[u.record][0]
            try:
                results[u.record].append((got[0], ChatTokenizer._label_aligned(got[1], path, line)))
            except InputError as err:
                results[u.record].append(err)

    def _reference(self, texts: List[str], units: List[_Unit]):
        """(ids, token-aligned trained flags) the reference way: ``tokenizers`` with offsets."""
        out = []
        for text, unit, enc in zip(texts, units, self.tok.backend.encode_batch(texts, add_special_tokens=False)
                                   if texts else []):
            ids = np.asarray(enc.ids, dtype=np.int64)
            if unit.train_all:
                trained = np.ones(ids.size, dtype=np.uint8)
                trained[:1] = 0
            else:
                trained = trained_from_offsets(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)[:, 0],
                                               unit.spans)
            out.append((ids, trained))
        return out

    def _collect(self, records, results, path) -> EncodedBatch:
        """Apply the overlong rules and the skip policy, in record order (the reference's order)."""
        o = self.options
        ids, masks, lengths, lines = [], [], [], []
        skipped: Dict[str, int] = {}
        first: Dict[str, str] = {}
        skipped_lines: List[Tuple[int, str]] = []
        for (line, _), items in zip(records, results):
            for item in items:
                if isinstance(item, ShardError) and not isinstance(item, InputError):
                    raise item  # not a bad record: e.g. the tokenizer has no chat template
                if not isinstance(item, InputError):
                    try:
                        self._fit(item[0], item[1], path, line)
                    except InputError as err:
                        item = err
                if isinstance(item, InputError):
                    reason = getattr(item, "reason", "bad_record")
                    dropping = reason == "overlong_dropped" or reason.startswith("overlong_untrainable")
                    if not (o.skip_bad or dropping):
                        raise item
                    skipped[reason] = skipped.get(reason, 0) + 1
                    first.setdefault(reason, str(item))
                    skipped_lines.append((int(line), reason))
                    continue
                ids.append(item[0])
                masks.append(item[1])
                lengths.append(item[0].size)
                lines.append(line)
        return EncodedBatch(_cat(ids, np.int64), _cat(masks, np.uint8), np.asarray(lengths, dtype=np.int64),
                            np.asarray(lines, dtype=np.int64), skipped, first, skipped_lines)

    def _fit(self, ids, mask, path, line) -> None:
        o = self.options
        if o.pack_size is None:  # the tokenize stage: the plan stage applies the overlong rules
            return
        padded = int(padded_length([ids.size], o.pad_multiple, getattr(o, "pad_layout", "stored"))[0])
        if padded <= o.pack_size:
            return
        if o.overlong == "error":
            raise input_error(f"sequence of {ids.size} tokens (padded {padded}) exceeds --pack-size "
                              f"{o.pack_size}", path, line, field="input_ids", reason="overlong",
                              hint="use --overlong truncate or drop, or a larger --pack-size")
        if o.overlong == "drop":
            raise input_error("overlong sequence dropped", path, line, reason="overlong_dropped")
        if not mask[:o.truncate_to - 1].any():
            raise input_error("nothing trained within the first --pack-size tokens", path, line,
                              reason="overlong_untrainable_after_truncation")


def _cat(parts, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
