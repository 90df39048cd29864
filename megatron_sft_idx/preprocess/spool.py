"""Tokenization into a spool: per-worker shards of one conversation per "pack".

The main process reads raw records in batches and hands them to ``--workers``
processes through a bounded queue; each worker encodes a batch with one call
(:meth:`~.encode.RecordEncoder.encode_batch`) and appends its kept sequences to its
own spool shard in one builder call (:meth:`IndexedDatasetBuilder.add_sequences`,
``pack_size=None``, one sequence per pack).
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
from .encode import RecordEncoder, preload


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
    tokenizer_backend: str = "auto"   # auto | gigatoken | hf (see fast_tokenizer)
    span_method: str = "auto"         # auto (one render, proven) | prefix (reference)


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
    """Encodes batches for one worker (:class:`~.encode.RecordEncoder`) and appends them to its spool shard."""

    def __init__(self, options: EncodeOptions, spool_prefix: str, worker: int) -> None:
        self.options = options
        self.worker = worker
        self.encoder = RecordEncoder(options)
        self.builder = IndexedDatasetBuilder(spool_prefix, vocab_size=options.vocab_size, pack_size=None,
                                             overwrite=True)

    def run(self, batch: Batch) -> BatchResult:
        local_start = len(self.builder)
        encoded = self.encoder.encode_batch(batch.records, batch.path)
        self.builder.add_sequences(encoded.ids, encoded.loss_mask, encoded.lengths)
        return BatchResult(batch.batch_id, self.worker, local_start, encoded.lengths.astype(np.int32),
                           encoded.lines, batch.file_index, encoded.skipped, encoded.first_skipped)

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
    preload(options)  # workers fork with the tokenizers loaded
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
