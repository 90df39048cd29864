"""inspect-idx on a directory of several sets (issue 44 item 1): the README's flow
(``preprocess-sft --split 90,5,5``, ``check-idx --promote out/sft``) leaves train, valid and
test side by side; ``inspect-idx out/sft`` summarizes each set by name, locally and in a
bucket, while two generations of one set, a partial set or a set beside strangers are still
refused with the message that says so."""

import json
import os

import numpy as np
import pytest

from megatron_sft_idx.gate.cli import main as check_idx
from megatron_sft_idx.manifest import load_manifest
from megatron_sft_idx.tools.inspect_cli import main as inspect_main
from support.shardgen import random_packs, write_shard
from support.stages import preprocess


@pytest.fixture(scope="module")
def promoted(tmp_path_factory):
    """The README's flow: three splits, each a set of two shards, promoted into ``sft/``."""
    root = tmp_path_factory.mktemp("readme")
    preprocess(str(root / "staging"), pack_size=512, split=[90, 5, 5], max_packs_per_shard=40)
    assert check_idx([str(root / "staging"), "--promote", str(root / "sft"), "-q"]) == 0
    return root / "sft"


def _packs(manifest):
    return sum(load_manifest(str(manifest)).counts)


def _run(argv, capsys):
    status = inspect_main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


def test_a_promoted_run_is_summarized_set_by_set(promoted, capsys):
    status, out, err = _run([str(promoted)], capsys)
    assert status == 0, err
    heads = [line for line in out.splitlines() if line.startswith("== set ")]
    assert [h.split("(")[1].split(")")[0] for h in heads] == ["train", "valid", "test"]
    assert out.splitlines()[0].startswith(f"{promoted}: 3 sets (train ")
    status, out, err = _run([str(promoted), "--json"], capsys)
    assert status == 0, err
    doc = json.loads(out)
    assert [s["set"]["name"] for s in doc["sets"]] == ["train", "valid", "test"]
    for s in doc["sets"]:
        manifest = promoted / f"ds_{s['set']['name']}.json"
        assert s["summary"]["packs"] == _packs(manifest)
        assert s["set"]["shards"] == len(s["summary"]["shards"]) == len(load_manifest(str(manifest)).prefixes)


def test_modes_that_read_one_set_say_how_to_name_it(promoted, capsys):
    status, _, err = _run([str(promoted), "--pack", "0", "--no-text"], capsys)
    assert status == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert "holds 3 whole sets" in err and "--pack, --consumers and --plot read one" in err
    assert "--resume" not in err  # nothing was interrupted
    assert f"(e.g. {promoted / 'ds_train.json'})" in err   # the manifest the run wrote, not a shard's name
    status, out, err = _run([str(promoted / "ds_valid.json"), "--pack", "0", "--no-text"], capsys)
    assert status == 0, err


def _member(path, set_id, index, count, name="train", seed=0):
    packs = random_packs(np.random.default_rng(seed * 100 + index), 3, pack_size=32)
    s = None if set_id is None else {"id": set_id, "index": index, "count": count, "name": name}
    write_shard(str(path), packs, pack_size=32, vocab_size=1000, metadata={"set": s} if s else {})


@pytest.mark.parametrize("kind", ["generations", "incomplete", "stranger"])
def test_a_mixed_or_partial_directory_is_still_refused(tmp_path, capsys, kind):
    d = tmp_path / kind
    if kind == "generations":       # two whole generations of one set (same name)
        _member(d / "a_0", "n" * 32, 0, 1)
        _member(d / "b_0", "o" * 32, 0, 1, seed=1)
    elif kind == "incomplete":      # a whole valid set beside 1 of 2 train shards
        _member(d / "t_0", "t" * 32, 0, 2)
        _member(d / "v_0", "v" * 32, 0, 1, name="valid")
    else:                           # two whole sets and a shard of no set
        _member(d / "t_0", "t" * 32, 0, 1)
        _member(d / "v_0", "v" * 32, 0, 1, name="valid")
        _member(d / "x", None, 0, 1, seed=2)
    status, _, err = _run([str(d)], capsys)
    assert status == 1 and err.count("\n") == 1 and "more than one set" in err and "--resume" in err


def test_a_promoted_run_in_a_bucket_is_summarized_set_by_set(promoted, s3, bucket, capsys):
    from megatron_sft_idx.publishing import upload_shard

    for name in os.listdir(promoted):
        if name.endswith(".idx") and not name.endswith(".seq.idx"):
            upload_shard(str(promoted / name[:-4]), f"s3://{bucket}/sft/{name[:-4]}")
    for spec in (f"s3://{bucket}/sft/", f"s3://{bucket}/sft/ds_*"):
        status, out, err = _run([spec, "--json"], capsys)
        assert status == 0, err
        doc = json.loads(out)
        assert [s["set"]["name"] for s in doc["sets"]] == ["train", "valid", "test"]
        assert [s["summary"]["packs"] for s in doc["sets"]] == [
            _packs(promoted / f"ds_{n}.json") for n in ("train", "valid", "test")]


def test_a_promoted_pack_is_detokenized_with_the_tokenizer_its_run_recorded(promoted, tmp_path, monkeypatch,
                                                                              capsys):
    """Issue 44 item 2: the run record stays in staging/ after the promotion; --pack still finds
    the tokenizer it names (no --tokenizer), and says in one line when it cannot load it."""
    from megatron_sft_idx.tools import pack_view
    from support.stages import TOKENIZER

    monkeypatch.setattr(pack_view, "EXAMPLE_TOKENIZER", str(tmp_path / "no-checkout"))   # only the record helps
    monkeypatch.delenv(pack_view.TOKENIZER_PATH_ENV, raising=False)
    shard = str(promoted / "ds_train_000000")
    assert not any(n.endswith(".preprocess") for n in os.listdir(promoted))   # the record stayed behind
    assert pack_view.run_recorded(shard) == [os.path.abspath(TOKENIZER)]
    status, out, err = _run([str(promoted / "ds_train.json"), "--pack", "0", "--json"], capsys)
    assert status == 0, err
    view = json.loads(out)
    assert view["tokenizer_note"] is None and all("text" in s for s in view["sequences"])
    # the recorded tokenizer's files hash as recorded but its tokenizer.json does not load: ids, one line
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json\nsecond line")
    monkeypatch.setattr(pack_view, "find_tokenizer", lambda recorded, run_paths=(): str(broken))
    status, out, err = _run([shard, "--pack", "0"], capsys)
    assert status == 0, err
    notes = [line for line in out.splitlines() if "cannot load the tokenizer" in line]
    assert len(notes) == 1 and "showing token ids" in notes[0]
