"""storage.paths: a path or a URL read alike (names, small files, shard specs). Their URL
branches against a real S3 API run with their callers' tests (tests/core/test_manifest.py,
test_multi.py, tests/batching/test_batching_order.py, marked ``remote``)."""

import os

import pytest

from megatron_sft_idx.storage.paths import (beside, comparable, idx_missing, names_file, normal, read_whole,
                                            relative_name, select)


def test_beside_resolves_against_the_directory_of_a_file_or_an_object():
    assert beside("/d/sub/set.json", "train_000") == "/d/sub/train_000"
    assert beside("rel/set.json", "train_000") == os.path.join("rel", "train_000")
    assert beside("/d/set.json", "/elsewhere/x") == "/elsewhere/x"
    assert beside("/d/set.json", "s3://b/k/x") == "s3://b/k/x"
    assert beside("s3://b/sft/set.json", "train_000") == "s3://b/sft/train_000"
    assert beside("msc://p/set.json", "a/b") == "msc://p/a/b"


def test_comparable_and_normal_spellings():
    assert comparable("/d/./a/../x") == "/d/x"
    assert comparable("s3://b/a/../x") == "s3://b/a/../x"   # a key is not a path: kept as written
    assert normal("rel/x") == os.path.abspath("rel/x")
    assert normal("s3://b/k") == "s3://b/k"


def test_relative_name_only_within_one_place():
    assert relative_name("/d/sub/x", "/d/set.json") == "sub/x"
    assert relative_name("/d/sub/x", "/d/set.json", relative=False) == "/d/sub/x"
    assert relative_name("s3://b/sft/x", "s3://b/sft/set.json") == "x"
    assert relative_name("s3://b/x", "s3://b/sft/set.json") == "s3://b/x"          # above the manifest
    assert relative_name("s3://other/sft/x", "s3://b/sft/set.json") == "s3://other/sft/x"
    assert relative_name("/d/x", "s3://b/set.json") == "/d/x"
    assert relative_name("s3://b/x", "/d/set.json") == "s3://b/x"


def test_read_whole_a_local_file(tmp_path):
    small = tmp_path / "small"
    small.write_bytes(b"12345")
    assert read_whole(str(small), 5) == (5, b"12345")
    assert read_whole(str(small), 4) == (5, None)              # larger: nothing read past the limit
    assert read_whole(str(tmp_path / "missing"), 5) == (None, None)
    with pytest.raises(IsADirectoryError):                     # there, unreadable: the caller names it
        read_whole(str(tmp_path), 1 << 20)
    assert names_file(str(small)) and not names_file(str(tmp_path)) and not names_file(str(tmp_path / "missing"))
    assert names_file("s3://b/not/looked/up.json")


def test_idx_missing_says_what_is_there(tmp_path):
    prefix = str(tmp_path / "s")
    assert idx_missing(prefix) == ".idx missing"
    (tmp_path / "s.bin").write_bytes(b"")
    assert idx_missing(prefix) == ".idx missing, other files of the shard present"
    (tmp_path / "s.idx").write_bytes(b"")
    assert idx_missing(prefix) == ""
    assert idx_missing("s3://b/not/looked/at", urls=False) == ""   # no request made


def test_select_asks_the_callers_rule_for_a_local_path():
    seen = []
    assert select("/d/train_*", lambda spec: seen.append(spec) or ("glob", ["/d/train_0"])) == ("glob", ["/d/train_0"])
    assert seen == ["/d/train_*"]
