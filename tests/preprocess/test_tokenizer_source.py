"""records/tokenizer_source.py: what ``--tokenizer`` names, and the shipped files written by each
process into its node's cache directory -- whole, verified when found, safe when several
processes of a node write them at once. (From a bucket and from the Hugging Face cache, end to
end: tests/preprocess/test_remote_inputs.py.)"""

import multiprocessing as mp
import os

import pytest

from megatron_sft_idx.preprocess.records import tokenizer_source as ts
from megatron_sft_idx.preprocess.records.chat import tokenizer_files_sha256

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")


def shipped() -> ts.TokenizerFiles:
    files = {n: open(os.path.join(TOKENIZER, n), "rb").read() for n in os.listdir(TOKENIZER)}
    return ts.TokenizerFiles.of("s3://b/models/tokenizer/", "tokenizer", files)


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """A fresh cache directory for this process (and its forks), and no copy known yet."""
    monkeypatch.setenv("MEGATRON_SFT_IDX_CACHE", str(tmp_path))
    monkeypatch.setattr(ts, "_MATERIALIZED", {})
    return tmp_path


def test_what_names_a_tokenizer_to_resolve(tmp_path):
    assert ts.is_tokenizer_reference("s3://b/tok/") and ts.is_tokenizer_reference("msc://p/tok")
    assert ts.is_tokenizer_reference("Qwen/Qwen3-8B") and ts.is_tokenizer_reference("gpt2")
    assert not ts.is_tokenizer_reference(TOKENIZER)                     # a local directory
    assert not ts.is_tokenizer_reference(str(tmp_path / "missing"))     # a path (absolute): loaded, and refused there
    assert not ts.is_tokenizer_reference("./tok") and not ts.is_tokenizer_reference("a/b/c")
    assert not ts.is_tokenizer_reference(None) and not ts.is_tokenizer_reference("")


def test_the_copy_is_the_files_named_as_the_source_and_hashes_as_the_local_directory(own_tmp):
    files = shipped()
    path = files.materialize()
    assert path == os.path.join(str(own_tmp), "tokenizers", files.digest[:32], "tokenizer")
    assert tokenizer_files_sha256(path) == tokenizer_files_sha256(TOKENIZER)
    assert files.materialize() == path and files == shipped() and hash(files) == hash(shipped())


def test_a_damaged_copy_is_written_again(own_tmp):
    files = shipped()
    path = files.materialize()
    with open(os.path.join(path, "tokenizer.json"), "r+b") as f:
        f.write(b"XX")
    ts._MATERIALIZED.clear()   # (another process of the node, finding the copy)
    assert files.materialize() == path
    assert tokenizer_files_sha256(path) == tokenizer_files_sha256(TOKENIZER)
    os.remove(os.path.join(path, "tokenizer_config.json"))
    ts._MATERIALIZED.clear()
    assert tokenizer_files_sha256(files.materialize()) == tokenizer_files_sha256(TOKENIZER)


def _materialize(files, out) -> None:
    out.put(files.materialize())


def test_processes_writing_at_once_all_get_the_whole_copy(own_tmp):
    files = shipped()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_materialize, args=(files, out)) for _ in range(6)]
    for p in procs:
        p.start()
    paths = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert len(set(paths)) == 1
    assert tokenizer_files_sha256(paths[0]) == tokenizer_files_sha256(TOKENIZER)
    parent = os.path.dirname(paths[0])
    assert os.listdir(parent) == ["tokenizer"]   # no staging directory left behind


def test_the_cache_keeps_the_most_recently_used_copies_and_drops_old_ones(own_tmp, monkeypatch):
    """Issue 44, item 8: the copies are a bounded cache, not one more directory per run."""
    import time

    monkeypatch.setattr(ts, "CACHE_KEEP", 2)
    base = {n: open(os.path.join(TOKENIZER, n), "rb").read() for n in os.listdir(TOKENIZER)}
    made = [ts.TokenizerFiles.of(f"s3://b/t{k}/tok/", "tok", dict(base, **{"added_tokens.json": b'{"k": %d}' % k}))
            for k in range(4)]
    paths = []
    for files in made:
        paths.append(files.materialize())
        os.utime(os.path.dirname(paths[-1]), (time.time() - 100 + len(paths), time.time() - 100 + len(paths)))
    root = os.path.join(str(own_tmp), "tokenizers")
    assert sorted(os.listdir(root)) == sorted(os.path.basename(os.path.dirname(p)) for p in paths[-2:])
    stale = os.path.dirname(paths[-2])
    os.utime(stale, (time.time() - ts.CACHE_MAX_AGE - 10,) * 2)   # unused for longer than the age bound
    monkeypatch.setattr(ts, "_MATERIALIZED", {})
    assert made[0].materialize() == paths[0]                       # written again, as new
    assert sorted(os.listdir(root)) == sorted(os.path.basename(os.path.dirname(p)) for p in (paths[0], paths[-1]))
