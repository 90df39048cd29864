"""Smoke tests of the benchmarks: every entry point runs at a tiny size through ``main(argv)``,
writes the JSON keys its docs promise, and every system reads back exactly what was written.

No timing is asserted: these check the harness, and cross-check the formats against
each other through the same corpus.
"""

import importlib.util
import json

import numpy as np
import pytest

from bench import builder_rss, compare, offsets, peers, scale
from bench.compare import METRICS
from bench.corpus import Corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# The upstream peer is the real PyPI megatron-core (installed --no-deps by `make install-test`).
SYSTEMS = [s for s in peers.SYSTEMS if s != "upstream" or HAVE_MEGATRON]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return Corpus.generate(tmp_path_factory.mktemp("corpus"), packs=120, pack_size=256, seed=7)


def test_corpus_packs_keep_the_invariants(corpus):
    assert len(corpus) == 120
    seen = 0
    for ids, loss, starts in corpus.iter_packs():
        n = ids.size
        assert 0 < n <= corpus.pack_size and loss.size == n
        assert starts[0] == 0 and np.all(np.diff(starts) > 0) and starts[-1] < n
        assert set(np.unique(loss)) <= {0, 1}
        ends = np.append(starts[1:], n)
        assert np.all(loss[ends - 1] == 0)  # label-aligned: nothing to predict after a sequence
        assert ids.max() < corpus.vocab_size
        seen += 1
    assert seen == 120
    digests = corpus.digests()
    assert digests[:, 0].sum() == corpus.n_tokens
    assert corpus.meta["seqs_per_pack"] > 1  # packs hold several sequences, as real packs do


def test_corpus_is_deterministic(tmp_path, corpus):
    again = Corpus.generate(tmp_path / "again", packs=120, pack_size=256, seed=7)
    assert np.array_equal(again.digests(), corpus.digests())


@pytest.mark.parametrize("system", SYSTEMS)
def test_every_system_reads_back_exactly_what_was_written(system, corpus, tmp_path):
    mod = peers.load(system)
    mod.write(corpus, str(tmp_path))
    reader = mod.open_reader(str(tmp_path))
    assert len(reader) == len(corpus)
    for i in range(len(corpus)):
        ids, loss, starts = corpus.pack(i)
        got_ids, got_loss, got_starts = mod.as_arrays(reader[i])
        assert np.array_equal(got_ids, ids), (system, i)
        if system != "upstream":  # upstream's pretrain format stores tokens only
            assert np.array_equal(got_loss, loss), (system, i)
            assert np.array_equal(got_starts, starts), (system, i)


def test_compare_entry_point(tmp_path):
    rc = compare.main(["--packs", "150", "--pack-size", "256", "--repeats", "1", "--max-seconds", "1",
                       "--systems", ",".join(SYSTEMS),
                       "--results-dir", str(tmp_path), "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert {"machine", "command", "params", "corpus", "medians", "runs", "ratios_ours_over_peer"} <= set(doc)
    assert doc["systems"] == SYSTEMS
    for system in SYSTEMS:
        row = doc["medians"][system]
        for key, *_ in METRICS:
            if key != "write_first_pack_s" or system == "ours":
                assert key in row, (system, key)
        assert row["verified"] is True and row["mismatched_packs"] == 0
        assert row["checked_packs"] >= 150  # at least the sequential pass over every pack
    assert set(doc["ratios_ours_over_peer"]) == set(SYSTEMS) - {"ours"}


def test_scale_entry_point(tmp_path):
    rc = scale.main(["--sizes", "60,120", "--pack-size", "64", "--reads", "50", "--systems",
                     "ours,legacy_npy", "--results-dir", str(tmp_path),
                     "--work-dir", str(tmp_path / "work")] + ([] if HAVE_MATPLOTLIB else ["--no-plot"]))
    assert rc == 0
    doc = json.loads((tmp_path / "scale.json").read_text())
    for system in ("ours", "legacy_npy"):
        points = doc["points"][system]
        assert [p["packs"] for p in points] == [60, 120]
        for p in points:
            assert p["verified"] and p["mismatches"] == 0
            assert {"open_s", "rss_after_open_mb", "random_packs_per_s"} <= set(p)
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "scale.png").stat().st_size > 1000


def test_offsets_entry_point(tmp_path):
    assert offsets.main(["--sizes", "1000,5000", "--repeats", "1", "--results-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "offsets.json").read_text())
    for n in ("1000", "5000"):
        row = doc["sizes"][n]
        assert row["results_agree"] is True
        assert {"numba_s", "numpy_s", "python_loop_s", "loop_over_numba"} <= set(row)


def test_builder_rss_entry_point(tmp_path):
    rc = builder_rss.main(["--sizes", "200,600", "--pack-tokens", "16", "--systems", "ours",
                           "--rfc-packs", "40", "--rfc-systems", "ours,legacy_npy",
                           "--results-dir", str(tmp_path), "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    doc = json.loads((tmp_path / "builder_rss.json").read_text())
    assert [r["packs"] for r in doc["scaling"]["ours"]] == [200, 600]
    for row in doc["scaling"]["ours"]:
        assert row["peak_delta_mb"] is not None and row["heap_peak_bytes"] > 0
    assert set(doc["growth_per_pack"]) == {"ours"}
    assert set(doc["rfc"]) == {"ours", "legacy_npy"}
    # The legacy writer holds every token as a Python int; ours streams: its heap is far smaller.
    assert doc["rfc"]["ours"]["heap_peak_bytes"] < doc["rfc"]["legacy_npy"]["heap_peak_bytes"]


def test_bad_arguments_exit_2(tmp_path):
    assert compare.main(["--systems", "nope", "--results-dir", str(tmp_path)]) == 2
    assert offsets.main(["--sizes", "x", "--results-dir", str(tmp_path)]) == 2
    assert scale.main(["--sizes", "0", "--results-dir", str(tmp_path)]) == 2


@pytest.mark.skipif(not HAVE_MEGATRON, reason="the upstream merge peer is the installed megatron-core")
def test_merge_entry_point(tmp_path):
    from bench import merge as bench_merge

    rc = bench_merge.main(["--small-shards", "3", "--small-packs", "40", "--skip-large", "--templates", "2",
                           "--results-dir", str(tmp_path), "--work", str(tmp_path / "work")])
    assert rc == 0
    row = json.loads((tmp_path / "merge.json").read_text())["rows"][0]
    assert row["same_bin_and_idx"] is True and row["packs"] == 120
    for system in ("ours", "upstream"):
        assert {"seconds", "peak_rss_mb", "base_rss_mb", "peak_anon_mb"} <= set(row[system])
    assert row["ours"]["gate_seconds"] > 0 and row["ours"]["packs"] == row["upstream"]["packs"] == 120


def test_sql_entry_point(tmp_path):
    from bench import sql as bench_sql

    rc = bench_sql.main(["--packs", "30", "--pack-size", "256", "--repeats", "1", "--results-dir", str(tmp_path),
                         "--work", str(tmp_path / "work")])
    assert rc == 0
    doc = json.loads((tmp_path / "sql.json").read_text())
    assert len(doc["rows"]) == len(bench_sql.QUERIES) and all(r["same_result"] for r in doc["rows"])


def test_plan_benchmark_entry_point(tmp_path, monkeypatch):
    from bench import plan

    monkeypatch.setattr("bench._common.RESULTS_DIR", tmp_path)
    assert plan.main(["--sizes", "2000,6000", "--pack-size", "512", "--algorithms", "first_fit_decreasing,best_fit_decreasing",
                      "--split", "90,10"]) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert [(r["n"], r["algorithm"]) for r in doc["results"]] == [
        (2000, "first_fit_decreasing"), (2000, "best_fit_decreasing"),
        (6000, "first_fit_decreasing"), (6000, "best_fit_decreasing")]
    assert all(r["packs"] > 0 and r["plan_bytes"] > 0 for r in doc["results"])


def test_stages_benchmark_entry_point(tmp_path, monkeypatch):
    from bench import stages

    monkeypatch.setattr("bench._common.RESULTS_DIR", tmp_path)
    assert stages.main(["--conversations", "600", "--partition-bytes", "100K", "--reads", "50",
                        "--pack-size", "1024", "--work-dir", str(tmp_path / "work")]) == 0
    doc = json.loads((tmp_path / "stages.json").read_text())
    assert doc["reference"]["conversations"] == 600 and doc["kill_resume"]["identical_to_reference"] is True
    assert doc["reads"]["virtual_checksum"] == doc["reads"]["materialized_checksum"]
    assert set(doc["projection"]["projected_s"]) == {"1", "8", "64"}


def test_preprocess_vs_bridge_runs_ours_as_the_console_script_does(tmp_path):
    """Our side of ``bench.preprocess_vs_bridge``: the installed command's code path, in a fresh
    child whose RSS is the one reported (Bridge's side needs ``make install-compat``: not here)."""
    import os

    from bench._common import ROOT, run_child

    examples = os.path.join(str(ROOT), "examples")
    out = run_child("bench.preprocess_vs_bridge:child_ours", path=os.path.join(examples, "conversations.jsonl"),
                    tokenizer=os.path.join(examples, "tokenizer"), workers=1, pack_size=2048,
                    out=str(tmp_path / "ours"))
    summary = json.loads((tmp_path / "ours.summary.json").read_text())
    assert out["tokens"] == summary["tokens"] > 0 and out["packs"] == summary["packs"] > 0
    assert out["peak_mb"] > 0 and out["cpu_s"] > 0


def test_balance_benchmark_entry_point(tmp_path, monkeypatch):
    from bench import balance

    monkeypatch.setattr("bench._common.RESULTS_DIR", tmp_path)
    assert sorted(balance.runtime_lpt([8, 7, 6, 5, 4, 3, 2, 1], 2)) == [18, 18]
    assert sorted(balance.runtime_kk([8, 7, 6, 5, 4, 3, 2, 1], 2)) == [18, 18]
    plot = tmp_path / "b.png"
    assert balance.main(["--quick", "--plot", str(plot)]) == 0
    doc = json.loads((tmp_path / "balance.json").read_text())
    assert {r["corpus"] for r in doc["overhead"]} == {"chat", "reasoning-32k"} and len(doc["overhead"]) == 8
    for row in doc["overhead"]:
        assert set(row["orders"]) == {"shuffle", "runtime LPT", "runtime KK", "ours LPT", "ours KK",
                                      "ours KK, exchange 4"}
        assert all(o["steps"] > 0 for o in row["orders"].values())
    assert all(d["identical"] for d in doc["dynamic"])
    assert doc["scale"]["packs"] > 0 and doc["scale"]["dynamic_microbatches"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_labels_benchmark_entry_point(tmp_path, monkeypatch):
    from bench import labels

    monkeypatch.setattr("bench._common.RESULTS_DIR", tmp_path)
    assert labels.main(["--quick", "--work", str(tmp_path / "w")]) == 0
    doc = json.loads((tmp_path / "labels.json").read_text())
    assert set(doc["corpora"]) == {"sft-mixture", "chat"}
    for corpus in doc["corpora"].values():
        for row in corpus["topologies"]:
            orders = {o["order"]: o for o in row["orders"]}
            assert list(orders) == [name for name, _ in labels.ORDERS]
            if orders["shuffle"]["trained"]["steps"]:   # label balancing evens the ranks out
                assert (orders["labels"]["trained"]["rank_spread_mean"]
                        < orders["shuffle"]["trained"]["rank_spread_mean"])
    assert "megatron-lm:per-micro-batch" in doc["audit_chat_dp8_mbs4_cp2"]
