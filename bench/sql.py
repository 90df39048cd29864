"""SQL over a shard (zero-copy Arrow from the memory maps) vs over the same packs as Parquet.

``python -m bench.sql`` generates the seeded corpus (``bench/corpus.py``), writes it as a
shard, converts the shard to Bridge packed Parquet with ``convert-packed`` (timed: the
cost a user pays once before querying Parquet), then runs the same queries through DuckDB
over both, in one process, same thread count:

* shard: the table ``packs`` of :class:`megatron_sft_idx.tools.arrow.PackTable` (only the
  columns a query names are produced, as ``inspect-idx --sql`` does);
* Parquet: ``read_parquet`` behind a view that derives the same columns
  (``row_number() - 1 AS pack``, ``len(input_ids) AS packed_len``, ``len(seq_start_id)
  AS num_sequences``, ``list_sum(loss_mask) AS trainable_tokens``): how a Bridge Parquet
  file is queried.

Each query's result is compared between the two; times are the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from ._common import RESULTS_DIR, format_table, ratio_cell, write_json

QUERIES = {
    "count + sums": "SELECT count(*) AS packs, sum(packed_len) AS tokens, sum(trainable_tokens) AS trained FROM packs",
    "histogram of sequences per pack": "SELECT num_sequences, count(*) AS n FROM packs GROUP BY 1 ORDER BY 1",
    "short packs (filter on length)": "SELECT pack, packed_len FROM packs WHERE packed_len < 3000 ORDER BY pack",
    "one pack's tokens": "SELECT input_ids FROM packs WHERE pack = 12345",
    "count one token id (unnest)": "SELECT count(*) AS n FROM (SELECT unnest(input_ids) AS t FROM packs) WHERE t = 42",
    "trained share per pack": "SELECT avg(trainable_tokens::DOUBLE / packed_len) AS share FROM packs",
}
PARQUET_VIEW = ("CREATE VIEW packs AS SELECT (row_number() OVER () - 1)::BIGINT AS pack, "
                "len(input_ids)::INTEGER AS packed_len, len(seq_start_id)::INTEGER AS num_sequences, "
                "list_sum(loss_mask)::BIGINT AS trainable_tokens, input_ids, loss_mask, seq_start_id "
                "FROM read_parquet('{path}')")


def build_inputs(work: str, packs: int, pack_size: int) -> dict:
    from megatron_sft_idx import IndexedDatasetBuilder
    from megatron_sft_idx.tools.convert import convert

    from .corpus import Corpus

    corpus = Corpus.generate(os.path.join(work, "corpus"), packs, pack_size=pack_size)
    prefix = os.path.join(work, "shard")
    with IndexedDatasetBuilder(prefix, pack_size=pack_size, vocab_size=corpus.vocab_size, overwrite=True) as b:
        for p0, p1, tokens, loss, starts in corpus.iter_chunks():
            b.add_packs(tokens, loss, starts, corpus.token_offsets[p0:p1 + 1] - corpus.token_offsets[p0],
                        corpus.seq_offsets[p0:p1 + 1] - corpus.seq_offsets[p0])
    parquet = os.path.join(work, "packed.parquet")
    t0 = time.perf_counter()
    convert(prefix, parquet)
    return {"prefix": prefix, "parquet": parquet, "convert_s": time.perf_counter() - t0,
            "tokens": corpus.n_tokens, "packs": len(corpus)}


def _time(run, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def run_queries(prefix: str, parquet: str, repeats: int, threads: int) -> list:
    import duckdb

    from megatron_sft_idx.tools.arrow import PackTable
    from megatron_sft_idx.tools.sql import columns_for_query

    rows = []
    for name, sql in QUERIES.items():
        def ours():
            con = duckdb.connect(config={"threads": threads})
            con.register("packs", PackTable(prefix, columns=columns_for_query(sql)))
            try:
                return con.sql(sql).fetchall()
            finally:
                con.close()

        def parquet_query():
            con = duckdb.connect(config={"threads": threads})
            con.execute(PARQUET_VIEW.format(path=parquet))
            try:
                return con.sql(sql).fetchall()
            finally:
                con.close()

        ours_s, ours_rows = _time(ours, repeats)
        pq_s, pq_rows = _time(parquet_query, repeats)
        rows.append({"query": name, "sql": sql, "ours_s": ours_s, "parquet_s": pq_s,
                     "same_result": _normal(ours_rows) == _normal(pq_rows)})
        print(f"{name}: ours {ours_s:.3f} s, parquet {pq_s:.3f} s, same={rows[-1]['same_result']}", flush=True)
    return rows


def _normal(rows):
    """Rows with floats rounded: an average summed in another order differs in the last bits."""
    return [tuple(float(f"{v:.9g}") if isinstance(v, float) else v for v in r) for r in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--packs", type=int, default=50_000)
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--work", default=None)
    args = p.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="bench_sql_")
    try:
        inputs = build_inputs(work, args.packs, args.pack_size)
        rows = run_queries(inputs["prefix"], inputs["parquet"], args.repeats, args.threads)
        sizes = {"shard_bytes": sum(os.path.getsize(inputs["prefix"] + s)
                                    for s in (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin")),
                 "parquet_bytes": os.path.getsize(inputs["parquet"])}
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    table = format_table(["query", "shard s", "Parquet s", "shard ÷ Parquet", "same result"],
                         [[r["query"], r["ours_s"], r["parquet_s"],
                           ratio_cell(r["ours_s"], r["parquet_s"], higher_is_better=False), r["same_result"]]
                          for r in rows])
    print(table)
    print(f"shard -> Parquet conversion (paid once before querying Parquet): {inputs['convert_s']:.2f} s; "
          f"{inputs['packs']:,} packs, {inputs['tokens']:,} tokens")
    path = write_json("sql", {"rows": rows, "table": table, "convert_s": inputs["convert_s"],
                              "packs": inputs["packs"], "tokens": inputs["tokens"], **sizes}, args.results_dir)
    print(f"results: {path}")
    return 0 if all(r["same_result"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
