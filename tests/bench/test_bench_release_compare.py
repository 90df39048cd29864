"""Smoke test of bench.release_compare: the release is exported and imported as itself, both trees
write the same tokens in every setting, and the JSON holds the ratios and the stage profile."""

import json

import pytest

from bench import release_compare


def test_partition_sizes_read_as_the_bench_documents_them():
    assert release_compare.parse_partitions("default") is None
    assert release_compare.parse_partitions("64M") == 64 << 20
    assert release_compare.parse_partitions("512K") == 512 << 10
    assert release_compare.parse_partitions("4096") == 4096
    with pytest.raises(SystemExit, match="'auto' is not default or a size"):
        release_compare.parse_partitions("auto")
    with pytest.raises(SystemExit, match="not a positive size"):
        release_compare.parse_partitions("0M")


def test_an_unknown_corpus_is_refused_by_name():
    with pytest.raises(SystemExit, match="unknown corpus 'chat'"):
        release_compare.main(["--corpora", "realistic,chat"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_release_compare_runs_both_trees_in_every_setting(tmp_path, monkeypatch):
    import bench._common as common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert release_compare.main(["--count", "40", "--rounds", "2", "--workers", "1,2", "--partitions", "default,8K",
                                 "--corpora", "example"]) == 0
    doc = json.loads((tmp_path / "release_compare.json").read_text())
    assert doc["release_ref"] == release_compare.RELEASE_REF and doc["rounds"] == 2
    corpus = doc["corpora"]["example"]
    assert corpus["tokens"] > 0
    assert {(s["workers"], s["partitions"]) for s in corpus["settings"]} == {(1, "default"), (1, "8K"),
                                                                            (2, "default"), (2, "8K")}
    for s in corpus["settings"]:
        assert s["cpu_ratio"] > 0 and s["wall_ratio"] > 0
        for name in ("release", "tree"):
            runs = s[name]["runs"]
            assert len(runs) == 2 and {r["tokens"] for r in runs} == {corpus["tokens"]}
            assert {r["conversations"] for r in runs} == {40} and s[name]["seconds"]["tokenize"] > 0
        if s["partitions"] == "8K":   # this tree cut the 8 KiB partitions it was given
            assert s["tree"]["units"]["tokenize"] > 1
