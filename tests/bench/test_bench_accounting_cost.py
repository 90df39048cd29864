"""Smoke test of bench.accounting_cost: both trees run with and without accounting and write the
same tokens either way, and "without" really turns the key account and the read-back off."""

import json

import pytest

from bench import accounting_cost


def test_without_accounting_means_neither_the_key_account_nor_the_read_back(monkeypatch):
    from megatron_sft_idx.preprocess.records import rendering, shapes
    from megatron_sft_idx.preprocess.records.errors import InputError
    from megatron_sft_idx.preprocess.records.inputs import parse_record

    monkeypatch.setattr(rendering, "check_rendered_tools", rendering.check_rendered_tools)   # (restored after)
    monkeypatch.setattr(shapes.registry, "account_keys", shapes.registry.account_keys)
    record = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                         "critique": "text no rule covers"})
    opts = shapes.SchemaOptions()

    def parse():
        return parse_record(record, "d.jsonl", 1, "auto", opts.prompt_key, opts.completion_key, opts, {})

    with pytest.raises(InputError, match="critique"):
        parse()
    accounting_cost._no_accounting()
    parse()
    assert rendering.check_rendered_tools("{}", [{"name": "f"}], "d.jsonl", 1) is None


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_accounting_cost_runs_both_trees_with_and_without(tmp_path, monkeypatch):
    import bench._common as common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert accounting_cost.main(["--count", "30", "--rounds", "1", "--processes", "1", "--corpora", "tools,pool"]) == 0
    doc = json.loads((tmp_path / "accounting_cost.json").read_text())
    assert set(doc["corpora"]) == {"tools", "pool"} and doc["baseline_ref"] == accounting_cost.BASELINE_REF
    for corpus in doc["corpora"].values():
        for name in ("before", "after"):
            system = corpus["systems"][name]
            assert system["tokens"] > 0 and system["cpu_s_on"] > 0 and system["cpu_s_off"] > 0
            runs = system["runs"]
            assert len(runs["on"]) == len(runs["off"]) == 1 and {r["conversations"] for r in runs["on"]} == {30}
            assert all(r["check_s"] > 0 for r in runs["on"]) and all(r["check_s"] == 0 for r in runs["off"])


def test_an_unknown_corpus_is_refused_by_name():
    with pytest.raises(SystemExit, match="unknown corpus 'chat'"):
        accounting_cost.main(["--corpora", "tools,chat"])
