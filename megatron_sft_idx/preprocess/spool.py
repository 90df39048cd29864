"""Tokenization into a spool: per-worker shards of one conversation per "pack".

The main process reads raw records in batches and hands them to ``--workers``
processes through a bounded queue; each worker parses, tokenizes and masks its
batches and appends every kept conversation to its own spool shard (written
with :class:`IndexedDatasetBuilder`, ``pack_size=None``, ``seq_start_id=[0]``).
Which worker takes which batch varies run to run, but every batch reports
``(batch_id, worker, first local index, lengths)``, and the conversations are
ordered by batch id afterwards, so the global order never depends on ``N``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import numpy as np

from ..builder import IndexedDatasetBuilder
from ..errors import ShardError
from ..packing.padding import padded_length
from .chat import ChatTokenizer, encode_tokens
from .errors import InputError, input_error
from .inputs import parse_record

_ZERO_START = np.zeros(1, dtype=np.int64)


@dataclass(frozen=True)
class EncodeOptions:
    """What a worker needs to turn raw records into (ids, label-aligned mask)."""

    tokenizer_path: Optional[str]
    vocab_size: Optional[int]
    loss_on: str
    input_format: str
    prompt_key: str
    completion_key: str
    skip_bad: bool
    pack_size: int
    pad_multiple: int
    overlong: str           # truncate | drop | error
    truncate_to: int        # longest kept length under truncate
    pad_layout: str = "stored"  # which length pad_multiple applies to (packing/padding.py)


@dataclass
class Batch:
    batch_id: int
    file_index: int
    path: str
    records: list            # [(line, raw)]


@dataclass
class BatchResult:
    batch_id: int
    worker: int
    local_start: int
    lengths: np.ndarray      # int32, tokens per kept conversation (before padding)
    lines: np.ndarray        # int64, source line per kept conversation
    file_index: int
    skipped: Dict[str, int] = field(default_factory=dict)
    first_skipped: Dict[str, str] = field(default_factory=dict)
    error: Optional[BaseException] = None


class BatchEncoder:
    """Encodes batches for one worker and appends them to its spool shard."""

    def __init__(self, options: EncodeOptions, spool_prefix: str, worker: int) -> None:
        self.options = options
        self.worker = worker
        self.tokenizer = ChatTokenizer(options.tokenizer_path) if options.tokenizer_path else None
        self.builder = IndexedDatasetBuilder(spool_prefix, vocab_size=options.vocab_size, pack_size=None,
                                             overwrite=True)

    def encode_record(self, raw, path: str, line: int):
        o = self.options
        kind, payload = parse_record(raw, path, line, o.input_format, o.prompt_key, o.completion_key)
        if kind == "tokens":
            ids, mask = encode_tokens(*payload, o.vocab_size, path, line)
        elif self.tokenizer is None:
            raise input_error(f"{kind} records need --tokenizer", path, line, reason="missing_key",
                              hint="pass --tokenizer PATH (a local Hugging Face tokenizer)")
        elif kind == "chat":
            ids, mask = self.tokenizer.encode_chat(payload, o.loss_on, path, line)
        else:
            ids, mask = self.tokenizer.encode_prompt(*payload, path, line)
        return self._fit(ids, mask, path, line)

    def _fit(self, ids, mask, path, line):
        o = self.options
        padded = int(padded_length([ids.size], o.pad_multiple, o.pad_layout)[0])
        if padded <= o.pack_size:
            return ids, mask
        if o.overlong == "error":
            raise input_error(f"sequence of {ids.size} tokens (padded {padded}) exceeds --pack-size "
                              f"{o.pack_size}", path, line, field="input_ids", reason="overlong",
                              hint="use --overlong truncate or drop, or a larger --pack-size")
        if o.overlong == "drop":
            raise input_error("overlong sequence dropped", path, line, reason="overlong_dropped")
        if not mask[:o.truncate_to - 1].any():
            raise input_error("nothing trained within the first --pack-size tokens", path, line,
                              reason="overlong_untrainable_after_truncation")
        return ids, mask

    def run(self, batch: Batch) -> BatchResult:
        local_start = len(self.builder)
        lengths: List[int] = []
        lines: List[int] = []
        skipped: Dict[str, int] = {}
        first: Dict[str, str] = {}
        for line, raw in batch.records:
            try:
                ids, mask = self.encode_record(raw, batch.path, line)
            except InputError as err:
                reason = getattr(err, "reason", "bad_record")
                dropping = reason == "overlong_dropped" or reason.startswith("overlong_untrainable")
                if not (self.options.skip_bad or dropping):
                    raise
                skipped[reason] = skipped.get(reason, 0) + 1
                first.setdefault(reason, str(err))
                continue
            self.builder.add_packed(ids, mask, _ZERO_START)
            lengths.append(ids.size)
            lines.append(line)
        return BatchResult(batch.batch_id, self.worker, local_start, np.asarray(lengths, dtype=np.int32),
                           np.asarray(lines, dtype=np.int64), batch.file_index, skipped, first)

    def finish(self) -> int:
        """Publish the spool shard (when it holds anything); returns its conversation count."""
        count = len(self.builder)
        if count:
            self.builder.finalize()
        else:
            self.builder.abort()
        return count


def _worker_main(options, spool_prefix, worker, tasks, results) -> None:
    encoder = None
    try:
        encoder = BatchEncoder(options, spool_prefix, worker)
        while True:
            batch = tasks.get()
            if batch is None:
                break
            results.put(encoder.run(batch))
        results.put(("done", worker, encoder.finish()))
    except BaseException as exc:  # report, never hang the parent
        if encoder is not None:
            encoder.builder.abort()
        if not isinstance(exc, ShardError):
            exc = ShardError(f"tokenizer worker {worker} failed: {exc.__class__.__name__}: {exc}",
                             hint="this is a bug; the worker traceback follows:\n" + traceback.format_exc())
        results.put(("error", worker, exc))


def run_spool(batches: Iterable[Batch], options: EncodeOptions, spool_dir: str, workers: int,
              on_result: Callable[[BatchResult], None]) -> List[str]:
    """Tokenize every batch into ``spool_dir/spool_<w>`` shards; returns the spool prefixes by worker.

    ``on_result`` is called in the main process for every finished batch (any order).

    Raises:
        InputError: the first bad record met (unless ``skip_bad``).
    """
    prefixes = [os.path.join(spool_dir, f"spool_{w:03d}") for w in range(max(1, workers))]
    if workers <= 1:
        encoder = BatchEncoder(options, prefixes[0], 0)
        try:
            for batch in batches:
                on_result(encoder.run(batch))
        except BaseException:
            encoder.builder.abort()
            raise
        encoder.finish()
        return prefixes
    ctx = mp.get_context("fork")
    tasks = ctx.Queue(maxsize=2 * workers)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(options, prefixes[w], w, tasks, results), daemon=True)
             for w in range(workers)]
    for p in procs:
        p.start()
    try:
        _feed_and_collect(batches, tasks, results, procs, workers, on_result)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    return prefixes


def _feed_and_collect(batches, tasks, results, procs, workers, on_result) -> None:
    done = set()

    def handle(item) -> None:
        if isinstance(item, tuple):
            kind, worker, payload = item
            if kind == "error":
                raise payload
            done.add(worker)
        else:
            on_result(item)

    def poll(timeout: float) -> bool:
        try:
            item = results.get(timeout=timeout) if timeout else results.get_nowait()
        except queue.Empty:
            dead = [w for w, p in enumerate(procs) if not p.is_alive() and w not in done]
            if not dead:
                return False
            try:  # its last message may still be in flight
                item = results.get(timeout=1.0)
            except queue.Empty:
                raise ShardError(f"tokenizer worker {dead[0]} died without reporting "
                                 "(killed, or out of memory)") from None
        handle(item)
        return True

    for batch in batches:
        while True:
            try:
                tasks.put(batch, timeout=0.2)
                break
            except queue.Full:
                poll(0)
        while poll(0):
            pass
    for _ in range(workers):
        tasks.put(None)
    while len(done) < workers:
        poll(1.0)
