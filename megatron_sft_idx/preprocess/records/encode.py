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
* label alignment and the all-zero check are vectorised;
* the read-back of tool definitions and calls (:func:`.accounting.check_rendered_tools`) is
  queued by each record's rendering check and made every :data:`READ_BACK_EVERY` records in
  one loop, which costs about a third less than the same calls made between renders, and slows
  the renders less; a record it refuses gets the reference's error (the reference is asked
  again), and its texts are not tokenized.

The staged pipeline's tokenize step calls it with :class:`EncodeOptions`, which carry no pack
size: what a conversation *is* does not depend on the packing, so the overlong rules are the
plan stage's, applied from the sequence store's lengths (one store serves every pack size).

A deterministic sample of conversations (every ``SAMPLE_EVERY``-th of a batch) is
also encoded the reference way and compared; a difference stops the run with
:class:`~megatron_sft_idx.errors.ShardError` rather than write different bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...errors import ShardError
from .chat import load_chat_tokenizer, reasoning_turns, template_rejected
from .errors import InputError, input_error
from .fast_tokenizer import FastTokenizer
from .masks import encode_tokens, label_aligned, label_aligned_all, trained_from_offsets
from .inputs import parse_record
from .policy import LossPolicy, require_trainable, trained_turns
from .rendering import check_rendered, count_history_reasoning, read_back_all
from .shapes import SchemaOptions
from .spans import SpanLocator
from .tokenizer_source import TokenizerFiles

SAMPLE_EVERY = 256
#: records whose read-backs are queued before they are made (a longer queue keeps more of the
#: batch's records alive, and the garbage collector walks them)
READ_BACK_EVERY = 64
SPAN_METHODS = ("auto", "prefix")
#: What ``--prompt-only`` may say of a record with no trained token (a prompt-only sequence):
#: ``error`` (a bad record: stop, or skip and count it under ``--skip-bad``; the default, as
#: before the flag), ``keep`` (store it whole with an all-zero mask, for schedulers that expect
#: such sequences) or ``drop`` (skip and count it, ``prompt_only_dropped``, without ``--skip-bad``).
PROMPT_ONLY = ("error", "keep", "drop")
#: The skip reason of a record ``--prompt-only drop`` dropped.
PROMPT_ONLY_DROPPED = "prompt_only_dropped"


@dataclass(frozen=True, kw_only=True)
class EncodeSettings:
    """How records become token ids and a loss mask, as a user chooses it: the one definition of
    these settings (their defaults are ``preprocess-sft``'s). The run's
    :class:`~megatron_sft_idx.preprocess.config.TokenizeSettings` extends them with its own;
    :meth:`encode_options` adds what the run resolved, for the workers."""

    vocab_size: Optional[int] = None      # None: the tokenizer's (EncodeOptions: the resolved size)
    loss_on: str = "assistant"
    input_format: str = "auto"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    prompt_format: str = "chat"           # chat | raw: prompt/completion strings (shapes.prompt)
    ignore_fields: Tuple[str, ...] = ()   # message fields that carry nothing the model should see
    tool_call_loss: str = LossPolicy.tool_calls         # the loss policies (policy.py), its defaults
    reasoning_loss: str = LossPolicy.reasoning
    empty_reasoning_loss: str = LossPolicy.empty_reasoning
    reasoning_tags: Tuple[str, str] = LossPolicy.tags
    tokenizer_backend: str = "auto"   # auto | gigatoken | hf (fast_tokenizer): the same bytes either way
    span_method: str = "auto"         # auto (one render, proven) | prefix (reference): the same bytes
    # YYYY-MM-DD a clock-reading template renders. TokenizeSettings: --template-date (None: the
    # run's start, UTC); EncodeOptions: the date resolved for this run (None: the template reads no clock)
    template_date: Optional[str] = None
    # switches the chat template reads (--template-arg NAME=VALUE: enable_thinking, thinking, thinking_mode),
    # given to every rendering: (name, JSON value) pairs, sorted (a dict from the API is taken too)
    template_args: Tuple[Tuple[str, object], ...] = ()
    prompt_only: str = "error"        # error | keep | drop: a record with no trained token (PROMPT_ONLY)

    def __post_init__(self) -> None:   # (lists from the API: the options are a dict key of the workers)
        object.__setattr__(self, "ignore_fields", tuple(self.ignore_fields))
        object.__setattr__(self, "reasoning_tags", tuple(self.reasoning_tags))
        object.__setattr__(self, "template_args", tuple(sorted(dict(self.template_args or ()).items())))

    def encode_options(self, *, tokenizer_path: Optional[str], vocab_size: Optional[int], skip_bad: bool,
                       chat_template_text: Optional[str] = None, template_date: Optional[str] = None,
                       tokenizer_files: Optional[TokenizerFiles] = None) -> "EncodeOptions":
        """These settings (only these, whatever subclass holds them) with what the run resolved."""
        mine = {f.name: getattr(self, f.name) for f in fields(EncodeSettings)}
        mine["vocab_size"] = vocab_size
        mine["template_date"] = template_date
        return EncodeOptions(tokenizer_path=tokenizer_path, skip_bad=skip_bad, chat_template_text=chat_template_text,
                             tokenizer_files=tokenizer_files, **mine)


@dataclass(frozen=True, kw_only=True)
class EncodeOptions(EncodeSettings):
    """What a worker needs to turn raw records into (ids, label-aligned mask): the settings, and
    the tokenizer, vocabulary and template the run resolved. Nothing here depends on the
    packing: the overlong rules are the plan stage's, from the store's lengths."""

    tokenizer_path: Optional[str] = None       # as given: a local path, a URL or a Hugging Face name
    skip_bad: bool = False
    chat_template_text: Optional[str] = None   # --chat-template's text, instead of the tokenizer's own
    # a URL's or a name's files, resolved by the driver and shipped with the step (tokenizer_source)
    tokenizer_files: Optional[TokenizerFiles] = None

    @property
    def tokenizer_directory(self) -> Optional[str]:
        """Where this process loads the tokenizer from: this node's copy of the shipped files,
        else ``tokenizer_path``."""
        return self.tokenizer_files.materialize() if self.tokenizer_files is not None else self.tokenizer_path

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
        if self.chat_template_text is not None:  # (absent: stores as before the flag)
            out["chat_template"] = self.chat_template_text
        policy = self.policy.to_dict()
        if policy:
            out["loss_policy"] = policy
        if self.prompt_format != EncodeSettings.prompt_format:
            out["prompt_format"] = self.prompt_format
        if self.ignore_fields:
            out["ignore_fields"] = sorted(self.ignore_fields)
        if self.template_date is not None:  # (only a template that reads the clock has one)
            out["template_date"] = self.template_date
        if self.template_args:  # (absent: stores as before the flag)
            out["template_args"] = dict(self.template_args)
        if self.prompt_only != EncodeSettings.prompt_only:  # (absent: stores as before the flag)
            out["prompt_only"] = self.prompt_only
        return out


def encoding_of(encode: dict) -> Tuple[SchemaOptions, LossPolicy]:
    """The schema options and loss policy a store's ``identity["encode"]`` records (defaults absent)."""
    policy = encode.get("loss_policy") or {}
    tags = tuple(policy.get("reasoning_tags", LossPolicy.tags))
    schema = SchemaOptions(encode["prompt_key"], encode["completion_key"],
                           encode.get("prompt_format", EncodeSettings.prompt_format),
                           tuple(encode.get("ignore_fields", EncodeSettings.ignore_fields)), tags)
    return schema, LossPolicy(policy.get("tool_calls", LossPolicy.tool_calls),
                              policy.get("reasoning", LossPolicy.reasoning),
                              policy.get("empty_reasoning", LossPolicy.empty_reasoning), tags)


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
        fast = _load_fast(load_chat_tokenizer(options.tokenizer_directory, options.chat_template_text,
                                              options.template_date, options.template_args),
                          options.tokenizer_backend)
        if fast is not None:  # load the numba kernel from its cache here, not once per worker
            ids, off = fast.encode(["warm up"])
            fast.trained_flags(["warm up"], [[(0, 4)]], ids, off)


class RecordEncoder:
    """Encodes batches of raw records for one worker (tokenizer loaded once).

    Args:
        options: the :class:`EncodeOptions` (``tokenizer_path``, ``loss_on``, ``skip_bad``,
            ``tokenizer_backend``, ``span_method``, ...).
    """

    def __init__(self, options: EncodeOptions) -> None:
        self.options = options
        self.tok = (load_chat_tokenizer(options.tokenizer_directory, options.chat_template_text, options.template_date,
                                        options.template_args)
                    if options.tokenizer_path else None)
        self.fast = _load_fast(self.tok, options.tokenizer_backend) if self.tok else None
        # how each text was handled (tests and --verbose read these)
        self.stats = {"one_render": 0, "prefix_render": 0, "fast_tokens": 0, "reference_tokens": 0}
        self.policy = options.policy
        self.schema = options.schema
        self._ignored: Dict[str, int] = {}   # this batch's ignored record-level keys (account_keys)
        self.locator = None
        if self.tok is not None and options.input_format != "tokens":
            self.tok.stops.require()
        if (self.tok is not None and self.tok.chat_template is not None and options.span_method == "auto"
                and options.loss_on in ("assistant", "last-turn")):
            self.locator = SpanLocator(self.tok, self.policy)
            if not self.locator.enabled:
                self.locator = None

    # ------------------------------------------------------------------ entry point

    def encode_batch(self, records, path: str) -> EncodedBatch:
        """Encode ``records`` (``[(line, raw)]`` from one file).

        Raises:
            InputError: the first bad record, unless ``skip_bad`` (then counted by reason).
            ShardError: the fast path disagrees with the reference on a sampled record.
        """
        results: List[list] = [[] for _ in records]   # per record: (ids, mask) or InputError items
        units: List[_Unit] = []
        self._ignored = {}
        queued: list = []   # read-backs (rendering.check_rendered) queued, made every READ_BACK_EVERY records
        marks = []          # (record, first, end): the record's read-backs are queued[first:end]
        for start in range(0, len(records), READ_BACK_EVERY):
            # a window of records mapped first, so the call texts a text-form template writes for
            # all their calls are rendered together (CallText.prefetch), then each record in turn
            window = []
            for i in range(start, min(start + READ_BACK_EVERY, len(records))):
                try:
                    window.append((i, self._parse(records[i], path)))
                except ShardError as err:  # raised (or skipped) in record order by _collect, as the reference does
                    results[i] = [err]
            self._prefetch_calls(window)
            for i, parsed in window:
                first = len(queued)
                try:
                    self._prepare(i, records[i][0], parsed, path, results, units, queued)
                except ShardError as err:
                    results[i] = [err]
                if len(queued) > first:
                    marks.append((i, first, len(queued)))
                    if len(marks) == READ_BACK_EVERY:
                        units = self._read_back(queued, marks, records, path, results, units)
        units = self._read_back(queued, marks, records, path, results, units)
        self._tokenize(units, records, path, results)
        batch = self._collect(records, results, path)
        batch.ignored = self._ignored
        return batch

    # ------------------------------------------------------------------ stages

    def _parse(self, record, path):
        """``(kind, payload)`` of one ``(line, raw)`` record, a chat record's conversation adapted
        to the template (:meth:`.chat.ChatTokenizer.prepare`)."""
        o = self.options
        line, raw = record
        kind, payload = parse_record(raw, path, line, o.input_format, o.prompt_key, o.completion_key, self.schema,
                                     self._ignored)
        if kind in ("tokens", "prompt") or self.tok is None:
            return kind, payload
        self.tok.require_template()
        conv = self.tok.prepare(payload, self.policy, path, line)
        for name in conv.applied:   # (tool-call ids the template requires, given: shapes.call_ids)
            self._ignored[name] = self._ignored.get(name, 0) + 1
        return kind, conv

    def _prefetch_calls(self, window) -> None:
        """The call texts of every tool call the window's chat records make, rendered together
        once when the template writes calls as text (:meth:`.call_text.CallText.prefetch`): one
        render per window instead of one per record; each record's read-back then finds its own."""
        call_text = self.tok.call_text if self.tok is not None and self.tok.chat_template is not None else None
        if call_text is None:
            return
        try:
            call_text.prefetch([conv.source_calls for _, (kind, conv) in window
                                if kind == "chat" and conv.source_calls])
        except Exception:   # (only a saving: each record's read-back learns its own calls, and fails alone)
            pass

    def _prepare(self, i, line, parsed, path, results, units, queued) -> None:
        o = self.options
        kind, payload = parsed
        if kind == "tokens":
            results[i].append(encode_tokens(*payload, o.vocab_size, path, line))
        elif self.tok is None:
            raise input_error(f"{kind} records need --tokenizer", path, line, reason="missing_key",
                              hint="pass --tokenizer PATH (a local Hugging Face tokenizer)")
        elif kind == "prompt":
            results[i].append(self.tok.encode_prompt(*payload, path, line))
        else:
            conv = payload
            if o.loss_on == "per-turn":
                units.extend(_Unit(i, text, spans, False, i % SAMPLE_EVERY == 0) for text, spans in
                             self.tok.turn_texts_and_spans(conv, path, line, self.policy, queued))
            else:
                units.append(self._chat_unit(i, conv, path, line, queued))

    def _read_back(self, queued, marks, records, path, results, units) -> List[_Unit]:
        """Make the queued read-backs, record by record, and empty the queue; a record one refuses
        gets the error the reference gives it (:meth:`_reference_error`), and its texts are dropped
        from ``units``. Made every :data:`READ_BACK_EVERY` records, not once a batch: a queue
        keeps its records' values alive, and the garbage collector walks them (with a whole batch
        waiting, its time went from 0.012 to 0.11 CPU-s in 2.2: docs/PREPROCESSING.md)."""
        refused = set()
        for i, first, end in marks:
            try:
                read_back_all(queued[first:end])
            except InputError as err:
                results[i] = [self._reference_error(records[i], path) or err]
                refused.add(i)
        queued.clear()
        marks.clear()
        return [u for u in units if u.record not in refused] if refused else units

    def _reference_error(self, record, path) -> Optional[ShardError]:
        """The error the reference raises for ``record`` (``(line, raw)``), asked again from its
        text, with its read-backs made in place (its first error may come before them: a prefix
        render the template refuses), its ignored keys not counted twice; None: it raises none."""
        line, raw = record
        o = self.options
        try:
            _, payload = parse_record(raw, path, line, o.input_format, o.prompt_key, o.completion_key, self.schema, {})
            if o.loss_on == "per-turn":
                self.tok.turn_texts_and_spans(payload, path, line, self.policy)
            else:
                self.tok.chat_text_and_spans(payload, o.loss_on, path, line, self.policy)
        except ShardError as err:
            return err
        return None

    def _chat_unit(self, i, conv, path, line, queued) -> _Unit:
        unit = self._chat_text(i, conv, path, line, queued)
        count_history_reasoning(unit.text, conv, self.policy, self._ignored)
        return unit

    def _chat_text(self, i, conv, path, line, queued) -> _Unit:
        loss_on = self.options.loss_on
        check = i % SAMPLE_EVERY == 0
        if loss_on == "all":
            text, _ = self.tok.chat_text_and_spans(conv, "all", path, line, self.policy, queued)
            return _Unit(i, text, [], True, check)
        if self.locator is not None:
            spans, text = self._one_render(conv, path, line, queued)
            if spans is not None:
                if check and (text, spans) != self.tok.chat_text_and_spans(conv, loss_on, path, line, self.policy,
                                                                          queued):
                    raise ShardError(f"{path}:{line}: the one-render assistant spans differ from the "
                                     "prefix-render spans", field="span_method",
                                     hint="rerun with --span-method prefix, and report the template")
                self.stats["one_render"] += 1
                return _Unit(i, text, spans, False, check)
        self.stats["prefix_render"] += 1
        text, spans = self.tok.chat_text_and_spans(conv, loss_on, path, line, self.policy, queued)
        return _Unit(i, text, spans, False, check)

    def _one_render(self, conv, path, line, queued):
        """``(spans, text)`` by one render, checked and refined as the reference does; spans None
        when the method cannot vouch for them, or a check fails (the reference then decides,
        and raises what it raises first; what this render queued on ``queued`` is withdrawn)."""
        loss_on = self.options.loss_on
        turns = trained_turns(conv, loss_on, self.policy)
        require_trainable(conv, turns, self.policy, path, line)
        try:
            text, spans, notes = self.locator.locate(conv.template_messages, turns, conv.tools,
                                                      plain=conv.plain)
        except Exception as exc:
            raise template_rejected(exc, path, line) from None
        if spans is None:
            return None, text
        text, spans = self.tok.stops.extend(conv.template_messages, text, spans, path, line)
        first = len(queued)
        try:
            required = [k for k in reasoning_turns(conv, loss_on, self.policy, turns) if k not in notes["dropped"]]
            check_rendered(text, conv, required, self.policy, path, line, queued, self.tok.call_text)
            return self.tok.refined(text, spans, turns, conv, self.policy, path, line, notes), text
        except InputError:
            del queued[first:]
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
        if self.fast is not None and proven.any():
            # the stop check and the label alignment of every proven text at once; a text either
            # refuses is asked again on its own below, for its error
            unstopped = self.tok.stops.unstopped(ids, trained, off)
            masks, untrained = label_aligned_all(trained, off)
        for k, u in enumerate(units):
            if proven[k]:
                got = (ids[off[k]:off[k + 1]], trained[off[k]:off[k + 1]])
                if u.check and not (np.array_equal(got[0], ref[k][0]) and np.array_equal(got[1], ref[k][1])):
                    line = records[u.record][0]
                    raise ShardError(f"{path}:{line}: gigatoken and tokenizers disagree on this conversation "
                                     "(ids or token offsets)", field="tokenizer_backend",
                                     hint="rerun with --tokenizer-backend hf, and report the tokenizer")
                if not untrained[k] and (u.train_all or not unstopped[k]):
                    results[u.record].append((got[0], masks[off[k]:off[k + 1]]))
                    continue
            else:
                got = ref[k]
            line = records[u.record][0]
            try:
                if not u.train_all:
                    self.tok.stops.check(got[0], got[1], path, line, self.tok.decode)
                results[u.record].append((got[0], label_aligned(got[1], path, line)))
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
        """Apply the skip policy, in record order (the reference's order)."""
        o = self.options
        ids, masks, lengths, lines = [], [], [], []
        skipped: Dict[str, int] = {}
        first: Dict[str, str] = {}
        skipped_lines: List[Tuple[int, str]] = []
        for (line, raw), items in zip(records, results):
            for item in items:
                if isinstance(item, ShardError) and not isinstance(item, InputError):
                    raise item  # not a bad record: e.g. the tokenizer has no chat template
                if (isinstance(item, InputError) and getattr(item, "reason", None) == "no_trainable_tokens"
                        and o.prompt_only == "keep"):
                    item = self._prompt_only(line, raw, path) or item
                if isinstance(item, InputError):
                    reason = getattr(item, "reason", "bad_record")
                    if reason == "no_trainable_tokens" and o.prompt_only == "drop":
                        reason = PROMPT_ONLY_DROPPED   # (a policy, not a bad record: no --skip-bad needed)
                    elif not o.skip_bad:
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


    def _prompt_only(self, line, raw, path) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """``(ids, all-zero mask)`` of a record that trains nothing, under ``--prompt-only keep``: a
        chat record rendered whole by its template (as ``--loss-on all`` renders it) and tokenized
        the reference way, a token record as given; None for a prompt/completion record (its
        empty completion stays the error it was)."""
        o = self.options
        kind, payload = parse_record(raw, path, line, o.input_format, o.prompt_key, o.completion_key, self.schema, {})
        if kind == "tokens":
            ids = np.asarray(payload[0], dtype=np.int64)
        elif kind == "chat" and self.tok is not None:
            conv = self.tok.prepare(payload, self.policy, path, line)
            text, _ = self.tok.chat_text_and_spans(conv, "all", path, line, self.policy)
            ids = np.asarray(self.tok.backend.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        else:
            return None
        return ids, np.zeros(ids.size, dtype=np.uint8)


def _cat(parts, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
