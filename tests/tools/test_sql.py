"""Shards as zero-copy Arrow batches, queried by DuckDB, Polars and pandas: the results equal
what the packs hold, the token lists point into the memory maps, corrupt indexes are refused."""

import json
import subprocess
import sys

import numpy as np
import pytest

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.errors import InvariantError, QueryError
from megatron_sft_idx.tools.arrow import COLUMNS, PackTable
from megatron_sft_idx.tools.inspect_cli import main as inspect_main
from megatron_sft_idx.tools.sql import columns_for_query, query
from megatron_sft_idx.publishing import write_manifest
from support.shardgen import random_packs, write_shard


@pytest.fixture
def shards(tmp_path, rng):
    a, b = random_packs(rng, 70, pack_size=64), random_packs(rng, 33, pack_size=64)
    write_shard(tmp_path / "s_000", a)
    write_shard(tmp_path / "s_001", b)
    return [str(tmp_path / "s_000"), str(tmp_path / "s_001")], a + b


def _mapped_file(buffer):
    """The file whose memory mapping holds ``buffer`` (from /proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= buffer.address and buffer.address + buffer.size <= hi:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def test_list_columns_are_views_of_the_memory_maps(shards):
    prefixes, packs = shards
    batches = list(PackTable(prefixes[0], batch_packs=16).batches())
    assert len(batches) == 5
    for batch in batches:
        for column, suffix in (("input_ids", ".bin"), ("loss_mask", ".loss.bin"), ("seq_start_id", ".seq.bin")):
            values = batch.column(column).values.buffers()[1]
            # the values buffer lies inside the file's own mapping: no copy was made
            assert _mapped_file(values) == prefixes[0] + suffix, column


def test_rows_equal_the_packs(shards):
    prefixes, packs = shards
    rows = PackTable(prefixes, batch_packs=7).to_table().to_pylist()
    assert [r["pack"] for r in rows] == list(range(len(packs)))
    assert [r["shard_index"] for r in rows] == [0] * 70 + [1] * 33
    assert [r["shard"] for r in rows] == [prefixes[0]] * 70 + [prefixes[1]] * 33  # the prefix, as users ask
    for row, (ids, loss, starts) in zip(rows, packs):
        assert row["input_ids"] == ids.tolist() and row["loss_mask"] == loss.tolist()
        assert row["seq_start_id"] == starts.tolist() and row["packed_len"] == len(ids)
        assert row["num_sequences"] == len(starts) and row["trainable_tokens"] == int(loss.sum())


def test_duckdb_queries_match_numpy(shards, tmp_path):
    prefixes, packs = shards
    manifest = tmp_path / "all.json"
    write_manifest(manifest, prefixes)
    got = query(str(manifest), "SELECT num_sequences AS k, count(*) AS n, sum(trainable_tokens) AS t "
                               "FROM packs GROUP BY 1 ORDER BY 1").to_pylist()
    counts = np.array([len(p[2]) for p in packs])
    trained = np.array([int(p[1].sum()) for p in packs])
    assert got == [{"k": int(k), "n": int((counts == k).sum()), "t": int(trained[counts == k].sum())}
                   for k in np.unique(counts)]
    # list functions over the token data itself
    got = query(prefixes, "SELECT pack, list_sum(loss_mask) AS s, input_ids[1] AS first, len(seq_start_id) AS k "
                          "FROM packs WHERE packed_len > 40 ORDER BY pack").to_pylist()
    want = [{"pack": i, "s": int(p[1].sum()), "first": int(p[0][0]), "k": len(p[2])}
            for i, p in enumerate(packs) if len(p[0]) > 40]
    assert got == want
    # a self-join scans the table twice: every scan is a fresh pass over the maps
    got = query(prefixes[0], "SELECT count(*) AS n FROM packs a JOIN packs b ON a.pack = b.pack").to_pylist()
    assert got == [{"n": 70}]


def test_polars_and_pandas_read_the_same_table(shards):
    import polars as pl

    prefixes, packs = shards
    table = PackTable(prefixes).to_table()
    frame = pl.from_arrow(table)
    assert frame.height == len(packs) and frame["input_ids"][5].to_list() == packs[5][0].tolist()
    df = table.select(["pack", "packed_len"]).to_pandas()
    assert df["packed_len"].sum() == sum(len(p[0]) for p in packs)


def test_mixed_token_dtypes_widen_to_int32(tmp_path, rng):
    small, big = random_packs(rng, 4), random_packs(rng, 3)
    big[0][0][0] = 70_000
    write_shard(tmp_path / "a", small)
    write_shard(tmp_path / "b", big)
    table = PackTable([str(tmp_path / "a"), str(tmp_path / "b")])
    assert str(table.schema.field("input_ids").type) == "large_list<item: int32>"
    rows = table.to_table().to_pylist()
    assert rows[4]["input_ids"][0] == 70_000 and rows[0]["input_ids"] == small[0][0].tolist()


def test_a_corrupt_index_is_refused_not_read_out_of_bounds(shards):
    prefixes, _ = shards
    ds = MMapIndexedDataset(prefixes[1])
    with open(prefixes[1] + ".idx", "r+b") as f:  # pack 10 claims to start far beyond .bin
        f.seek(ds.idx_header.pointers_offset + 8 * 10)
        f.write(np.int64(1 << 40).tobytes())
    with pytest.raises(InvariantError) as info:
        PackTable(prefixes).to_table()
    assert info.value.path == prefixes[1] and info.value.pack == 10


@pytest.mark.parametrize("extra", [[], ["--json"]])
@pytest.mark.parametrize("sql", ["SELECT sum(packed_len) FROM packs", "SELECT sum(len(input_ids)) FROM packs",
                                 "SELECT * FROM packs WHERE pack > 50"])
def test_cli_sql_on_a_corrupt_shard_prints_one_line(shards, capsys, sql, extra):
    """The shard's own error, once, on one line: not DuckDB's wrapper with an embedded traceback."""
    prefixes, _ = shards
    ds = MMapIndexedDataset(prefixes[1])
    with open(prefixes[1] + ".idx", "r+b") as f:
        f.seek(ds.idx_header.pointers_offset + 8 * 10)
        f.write(np.int64(1 << 40).tobytes())
    assert inspect_main([*prefixes, "--sql", sql, *extra]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"inspect-idx: error: {prefixes[1]}: the shard's index is corrupt")
    assert "Traceback" not in err and "Python exception" not in err and "[pack=10" in err
    with pytest.raises(InvariantError) as info:  # the API raises the shard's error itself
        query(prefixes, sql)
    assert info.value.pack == 10


def test_engine_errors_keep_one_line(shards, capsys):
    prefixes, _ = shards
    assert inspect_main([prefixes[0], "--sql", "SELECT no_such_column FROM packs"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Binder Error" in err and "no_such_column" in err


def test_columns_a_query_needs():
    assert columns_for_query("SELECT count(*) FROM packs") == ("pack",)
    assert columns_for_query("select avg(PACKED_LEN) from packs where num_sequences > 2") == ("packed_len",
                                                                                               "num_sequences")
    assert columns_for_query("SELECT * FROM packs") == COLUMNS
    assert columns_for_query("SELECT p.* FROM packs p") == COLUMNS


def test_cli_sql(shards, capsys):
    prefixes, packs = shards
    assert inspect_main([*prefixes, "--sql", "SELECT count(*) AS n, max(packed_len) AS m FROM packs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": len(packs), "m": max(len(p[0]) for p in packs)}]
    assert inspect_main([prefixes[0], "--sql", "SELECT num_sequences, count(*) FROM packs GROUP BY 1"]) == 0
    assert "num_sequences" in capsys.readouterr().out
    assert inspect_main([prefixes[0], "--sql", "SELEC nonsense"]) == 1
    err = capsys.readouterr().err
    assert "the query failed" in err and "Traceback" not in err
    with pytest.raises(QueryError):
        query(prefixes[0], "SELECT no_such_column FROM packs")


@pytest.mark.subprocess
def test_missing_duckdb_names_the_extra(shards):
    prefixes, _ = shards
    code = ("import sys; sys.modules['duckdb'] = None\n"
            "from megatron_sft_idx._console import run\n"
            f"sys.exit(run('inspect-idx', [{prefixes[0]!r}, '--sql', 'SELECT 1']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "needs the 'tools' extra" in proc.stderr \
        and "pip install 'megatron_sft_idx[tools]'" in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- sequences (and sources)


def test_sequences_table_groups_by_source(tmp_path):
    """One row per sequence, its source named (format 1.2): the counts and trained tokens per source
    are those the reader's own source ids and loss masks give."""
    from megatron_sft_idx import MMapIndexedDataset
    from support.shardgen import random_packs, write_shard

    rng = np.random.default_rng(4)
    packs = [p + (rng.integers(0, 2, p[2].size),) for p in random_packs(rng, 300)]
    prefix = str(tmp_path / "mixed")
    write_shard(prefix, packs, metadata={"sources": [{"name": "chat"}, {"name": "code"}]})
    got = query(prefix, "SELECT source, count(*) AS n, sum(trainable_tokens) AS t FROM sequences GROUP BY 1 ORDER BY 1")
    ds = MMapIndexedDataset(prefix)
    want = {"chat": [0, 0], "code": [0, 0]}
    for i in range(len(ds)):
        pack, ids = ds[i], ds.source_ids(i)
        b = pack.seq_boundaries
        for k, src in enumerate(ids):
            name = ds.sources[src]
            want[name][0] += 1
            want[name][1] += int(pack.loss_mask[b[k]:b[k + 1]].sum())
    assert {r["source"]: [r["n"], int(r["t"])] for r in got.to_pylist()} == want
    rows = query(prefix, "SELECT pack, sequence, length FROM sequences WHERE pack = 7 ORDER BY sequence").to_pylist()
    assert [r["length"] for r in rows] == np.diff(ds[7].seq_boundaries).tolist()
    both = query(prefix, "SELECT (SELECT count(*) FROM packs) AS packs, (SELECT count(*) FROM sequences) AS seqs")
    assert both.to_pylist() == [{"packs": len(ds), "seqs": int(ds.seq_header.sequence_count)}]


def test_sequences_of_shards_without_sources_have_null_sources(shards):
    got = query(shards[0], "SELECT count(*) AS n, count(source) AS named FROM sequences").to_pylist()
    assert got[0]["n"] > 0 and got[0]["named"] == 0


def test_inspect_summary_counts_the_sources(tmp_path, capsys):
    from support.shardgen import random_packs, write_shard

    rng = np.random.default_rng(8)
    prefix = str(tmp_path / "mixed")
    packs = [p + (rng.integers(0, 2, p[2].size),) for p in random_packs(rng, 40)]
    write_shard(prefix, packs, metadata={"sources": [{"name": "chat"}, {"name": "code"}]})
    assert inspect_main([prefix, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    ds = MMapIndexedDataset(prefix)
    ids = np.asarray(ds.sequence_source_ids)
    assert summary["sources"] == {"chat": int((ids == 0).sum()), "code": int((ids == 1).sum())}
    assert inspect_main([prefix]) == 0
    assert "sources      chat" in capsys.readouterr().out
