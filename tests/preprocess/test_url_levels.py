"""Object keys are not paths (issue 41): a store, work, output, input or tokenizer URL with an
empty, ``.`` or ``..`` level, and a store at a bucket's root, are refused in one line before any
work, by every command that takes them (exit 2) and by the Python API (a ShardError naming the
option); a local copy named from a URL is one plain name, and a key under a mirrored prefix that
is no local name is refused before anything is written. Before issue 41, ``--store s3://b/st/..``
mirrored and wrote under the key ``st/..``, and ``--tokenizer s3://b/tok/..`` deleted every other
run's tokenizer copy on the node."""

import os

import pytest

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.gate.cli import main as check_idx_main
from megatron_sft_idx.preprocess import Config, run as preprocess
from megatron_sft_idx.preprocess.cli import main as preprocess_main
from megatron_sft_idx.preprocess.repack_cli import repack_main
from megatron_sft_idx.preprocess.records import tokenizer_source as ts
from megatron_sft_idx.storage.mirror import Mirror
from megatron_sft_idx.storage.urls import url_problem
from megatron_sft_idx.tools.convert_cli import main as convert_main
from megatron_sft_idx.tools.merge_cli import main as merge_main
from megatron_sft_idx.tools.plan_batches_cli import main as plan_batches_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TOKENIZER = os.path.join(EXAMPLES, "tokenizer")
INPUT = os.path.join(EXAMPLES, "conversations.jsonl")
SETTINGS = ["--input", INPUT, "--tokenizer", TOKENIZER, "--pack-size", "256", "--quiet"]

BAD_LEVELS = ["s3://bkt/st/..", "s3://bkt/st/../x", "s3://bkt/./st", "s3://bkt/a//st", "s3://bkt//st",
              "msc://prof/st/..", "s3://bkt/st/./"]


def test_the_levels_a_url_may_hold():
    for url in BAD_LEVELS:
        assert url_problem(url), url
    for url in ("s3://bkt/st", "s3://bkt/st/", "s3://bkt/a/b.jsonl", "s3://bkt/data/*.jsonl", "s3://bkt/.hidden/x",
                "s3://bkt/a..b", "s3://bkt/", "s3://bkt"):
        assert not url_problem(url), url
    for url in ("s3://bkt", "s3://bkt/", "msc://prof/"):
        assert "bucket's root" in url_problem(url, root=False)
    assert not url_problem("s3://bkt/st", root=False)


def usage_line(capsys, flag, url):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and f"{flag} {url}:" in lines[0], err
    return lines[0]


@pytest.mark.parametrize("url", BAD_LEVELS)
@pytest.mark.parametrize("flag", ["--store", "--output-prefix", "--input", "--tokenizer"])
def test_preprocess_refuses_a_url_level_that_is_no_name(flag, url, tmp_path, capsys):
    args = {"--input": INPUT, "--tokenizer": TOKENIZER, "--output-prefix": str(tmp_path / "out" / "ds")}
    args[flag] = url
    argv = [a for k, v in args.items() for a in (k, v)] + ["--pack-size", "256"]
    assert preprocess_main(argv) == 2
    line = usage_line(capsys, flag, url)
    assert "level" in line and "name the prefix itself" in line
    assert not (tmp_path / "out").exists()    # refused before any work


@pytest.mark.parametrize("url", ["s3://bkt", "s3://bkt/", "msc://prof/"])
def test_a_store_at_a_buckets_root_is_refused(url, tmp_path, capsys):
    assert preprocess_main(SETTINGS + ["--store", url, "--output-prefix", str(tmp_path / "ds")]) == 2
    assert "bucket's root" in usage_line(capsys, "--store", url)
    assert repack_main(["--store", url, "--output-prefix", str(tmp_path / "ds")]) == 2
    assert "bucket's root" in usage_line(capsys, "--store", url)
    assert plan_batches_main(["--dynamic", "--store", url, "--max-tokens-per-microbatch", "512",
                              "--balance-for", "1,1,2"]) == 2
    assert "bucket's root" in usage_line(capsys, "--store", url)


def test_every_command_that_writes_or_mirrors_a_url_refuses_its_levels(tmp_path, capsys):
    url = "s3://bkt/out/.."
    assert repack_main(["--store", str(tmp_path), "--output-prefix", url]) == 2
    usage_line(capsys, "--output-prefix", url)
    assert repack_main(["--store", "s3://bkt/st/../st", "--output-prefix", str(tmp_path / "o")]) == 2
    usage_line(capsys, "--store", "s3://bkt/st/../st")
    assert merge_main([url, str(tmp_path / "in")]) == 2
    usage_line(capsys, "OUT", url)
    assert convert_main([str(tmp_path / "in"), url]) == 2
    usage_line(capsys, "OUTPUT", url)
    assert check_idx_main([str(tmp_path / "in"), "--promote", "s3://bkt/a/../b"]) == 2
    usage_line(capsys, "--promote", "s3://bkt/a/../b")


@pytest.mark.parametrize("field,value", [("store", "s3://bkt/st/.."), ("store", "s3://bkt/"),
                                         ("output_prefix", "s3://bkt/o//ds")])
def test_the_python_api_refuses_them_naming_the_option(field, value, tmp_path):
    kwargs = {"tokenizer": TOKENIZER, "pack_size": 256, "engine": "ray" if field == "output_prefix" else "local"}
    inputs, prefix = [INPUT], str(tmp_path / "out" / "ds")
    if field == "store":
        kwargs["store"] = value
    else:
        prefix = value
    with pytest.raises(ShardError) as e:
        preprocess(Config(inputs, prefix, **kwargs))
    assert value in str(e.value) and ("level" in str(e.value) or "bucket's root" in str(e.value))
    assert not (tmp_path / "out").exists()


def test_a_mirror_of_a_url_with_such_a_level_is_never_made():
    for url in BAD_LEVELS + ["s3://bkt", "s3://bkt/"]:
        with pytest.raises(ShardError):
            Mirror(url)


def test_a_tokenizer_copy_is_never_named_out_of_its_digests_directory(tmp_path, monkeypatch):
    """The guard under the argument check: a copy whose name is '..' is refused, and the other runs'
    copies on the node stay (before issue 41 the copy's directory was the tokenizers' root, emptied)."""
    monkeypatch.setenv("MEGATRON_SFT_IDX_CACHE", str(tmp_path))
    monkeypatch.setattr(ts, "_MATERIALIZED", {})
    files = {n: open(os.path.join(TOKENIZER, n), "rb").read() for n in os.listdir(TOKENIZER)}
    other = ts.TokenizerFiles.of("s3://b/other/tok/", "tok", dict(files, **{"added_tokens.json": b"{}"}))
    kept = other.materialize()
    for name in ("..", ".", "", "a/b"):
        with pytest.raises(ShardError, match="no name for a local file"):
            ts.TokenizerFiles.of(f"s3://b/tok/{name}", name, files).materialize()
    assert sorted(os.listdir(kept)) == sorted(n for n, _ in other.files)


# --------------------------------------------------------------------------- against a bucket


def test_nothing_reaches_the_bucket_or_the_tokenizer_copies(s3, bucket, tmp_path, capsys):
    """Through the door, against a real bucket holding a tokenizer under the literal key 'tok/..':
    the store and the tokenizer URLs are refused before anything is listed, written or deleted."""
    client = s3.client()
    for name in os.listdir(TOKENIZER):
        with open(os.path.join(TOKENIZER, name), "rb") as f:
            client.put_object(Bucket=bucket, Key=f"tok/../{name}", Body=f.read())
    root = os.path.join(os.environ["MEGATRON_SFT_IDX_CACHE"], "tokenizers", "0" * 32, "tok")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "tokenizer.json"), "w") as f:
        f.write("{}")                                       # another run's copy on this node
    s3.clear()
    out = str(tmp_path / "o" / "ds")
    assert preprocess_main(["--input", INPUT, "--tokenizer", f"s3://{bucket}/tok/..", "--output-prefix", out,
                            "--pack-size", "256"]) == 2
    usage_line(capsys, "--tokenizer", f"s3://{bucket}/tok/..")
    assert preprocess_main(SETTINGS + ["--store", f"s3://{bucket}/st/..", "--output-prefix", out]) == 2
    usage_line(capsys, "--store", f"s3://{bucket}/st/..")
    assert os.path.exists(os.path.join(root, "tokenizer.json"))
    assert s3.requests == []                                # nothing listed, read or written
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert all(k.startswith("tok/../") for k in keys), keys


def test_a_key_under_a_mirrored_prefix_that_is_no_local_name_is_refused(s3, bucket, tmp_path):
    client = s3.client()
    client.put_object(Bucket=bucket, Key="st/store.json", Body=b"{}")
    client.put_object(Bucket=bucket, Key="st/parts/../../escape", Body=b"x")   # a literal key, listed under st/
    mirror = Mirror(f"s3://{bucket}/st")
    with pytest.raises(ShardError, match="names no local file") as e:
        mirror.pull()
    assert "st/parts/../../escape" in str(e.value)
    assert not os.path.exists(os.path.join(os.path.dirname(mirror.local), "escape"))
    assert not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(mirror.local)), "escape"))
    mirror.remove_local()
