"""Shard tools: merge shards, convert between packed formats, inspect and query shards.

Library modules (each with one job) behind three thin command lines:

* :mod:`.merge` (``merge-shards``): many shards -> one, streaming, gated, atomic;
* :mod:`.convert` (``convert-packed``): legacy ``.npy``, packed Parquet, the RFC's
  Option A directory and upstream pretrain ``.bin/.idx`` -> shard; shard -> Parquet;
* :mod:`.inspect` (``inspect-idx``): a summary, one pack with its trained spans,
  histograms and plots; :mod:`.arrow` exposes a shard as zero-copy Arrow batches
  so DuckDB / Polars / pandas can query it (:mod:`.sql`).

Nothing here is imported by the reader; heavy dependencies (pyarrow, duckdb,
matplotlib, tokenizers) are imported inside the functions that need them.
"""
