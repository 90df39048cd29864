"""preprocess-sft reading its inputs (and its tokenizer) from object storage: ``--input s3://...``
against moto's S3 server on loopback behind the counting, fault-injecting proxy (the ``s3`` /
``bucket`` fixtures of tests/conftest.py).

Every input kind (JSON Lines plain and compressed, JSON arrays, Parquet, Arrow, a saved dataset)
is uploaded and preprocessed from the bucket, and the run is compared with the same run on the
local copy: the output shards and the store's partitions are byte for byte the same, except
where a file records the inputs' *names* (a URL there, a local path here): the ``.seq.idx``
metadata's ``source.inputs[].name`` and the ``store_id`` that digests them, compared after
putting one name for the other. Then: globs and prefixes, a missing object, an object replaced
between the index and the tokenize stage, ``--resume`` proving the inputs by content, a large
JSON Lines streamed in bounded GETs, the tokenizer from the bucket, and the Ray engine.
"""

import gzip
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_sft_idx.errors import InputError, ObjectChangedError
from megatron_sft_idx.preprocess import driver, stages
from megatron_sft_idx.preprocess.cli import main as preprocess_main
from megatron_sft_idx.preprocess.config import Config
from megatron_sft_idx.reader import MMapIndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TOKENIZER = os.path.join(EXAMPLES, "tokenizer")
RECORDS = [json.loads(line) for line in open(os.path.join(EXAMPLES, "conversations.jsonl"))][:120]
SHARD_FILES = (".bin", ".idx", ".loss.bin", ".seq.bin")
SETTINGS = ["--pack-size", "1024", "--max-packs-per-shard", "20", "--quiet", "--partition-bytes", "16K"]


def jsonl_bytes(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def write_kind(directory, kind: str, records=RECORDS) -> str:
    """One input file (or saved dataset) of ``kind`` under ``directory``; returns its name there."""
    os.makedirs(directory, exist_ok=True)
    if kind == "jsonl":
        name = "a.jsonl"
        open(os.path.join(directory, name), "wb").write(jsonl_bytes(records))
    elif kind == "gz":
        name = "a.jsonl.gz"
        open(os.path.join(directory, name), "wb").write(gzip.compress(jsonl_bytes(records), mtime=0))
    elif kind == "zst":
        import zstandard

        name = "a.jsonl.zst"
        open(os.path.join(directory, name), "wb").write(zstandard.ZstdCompressor().compress(jsonl_bytes(records)))
    elif kind == "array":
        name = "a.json"
        open(os.path.join(directory, name), "w").write("[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n")
    elif kind == "parquet":
        name = "a.parquet"
        pq.write_table(pa.Table.from_pylist(records), os.path.join(directory, name), row_group_size=15)
    elif kind == "arrow":
        name = "a.arrow"
        table = pa.Table.from_pylist(records)
        with pa.OSFile(os.path.join(directory, name), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            for lo in range(0, len(records), 15):
                writer.write_table(table.slice(lo, 15))
    elif kind == "arrow_stream":
        name = "a.arrow"
        table = pa.Table.from_pylist(records)
        with pa.OSFile(os.path.join(directory, name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for lo in range(0, len(records), 15):
                writer.write_table(table.slice(lo, 15))
    elif kind == "saved":
        from support.saved_datasets import save_to_disk

        name = "saved"
        save_to_disk(records, os.path.join(directory, name))
    else:
        raise ValueError(kind)
    return name


def upload_tree(s3, bucket, local, prefix):
    """Every file under ``local`` to ``s3://bucket/prefix/<relative path>``."""
    client = s3.client()
    for root, _, files in os.walk(local):
        for name in files:
            path = os.path.join(root, name)
            key = prefix + "/" + os.path.relpath(path, local).replace(os.sep, "/")
            client.put_object(Bucket=bucket, Key=key, Body=open(path, "rb").read())


def run(inputs, out, store, *extra):
    settings = [s for s in SETTINGS if s != "--quiet"] if "--no-quiet" in extra else SETTINGS
    assert preprocess_main(["--input", *inputs, "--tokenizer", TOKENIZER, "--output-prefix", str(out),
                            "--store", str(store), *settings, *[e for e in extra if e != "--no-quiet"]]) == 0


def output_prefixes(directory):
    return sorted(os.path.join(directory, n[:-4]) for n in os.listdir(directory)
                  if n.endswith(".idx") and not n.endswith(".seq.idx"))


def renamed_metadata(prefix, names: dict, store_ids: dict) -> dict:
    """The shard's metadata with every input name and store id replaced by its counterpart."""
    text = json.dumps(MMapIndexedDataset(prefix).metadata.to_dict(), sort_keys=True)
    for a, b in list(names.items()) + list(store_ids.items()):
        text = text.replace(json.dumps(a)[1:-1], json.dumps(b)[1:-1])
    return json.loads(text)


def object_gets(s3, bucket, ranged: bool):
    """``[(key, Range, bytes)]`` of the GETs of objects (not listings) in ``bucket``."""
    return [(k, r, n) for m, k, r, n in s3.requests
            if m == "GET" and k.startswith(f"/{bucket}/") and k != f"/{bucket}/" and (r is not None) == ranged]


def store_body(store):
    return json.load(open(os.path.join(store, "store.json")))


def assert_same_run(local_root, remote_root, local_names, remote_names):
    """Outputs and store partitions byte-identical, metadata identical once names are swapped."""
    local_store, remote_store = store_body(local_root / "store"), store_body(remote_root / "store")
    names = dict(zip(remote_names, local_names))
    ids = {remote_store["store_id"]: local_store["store_id"]}
    assert [i["name"] for i in remote_store["inputs"]] == remote_names
    assert [dict(i, name=names[i["name"]]) for i in remote_store["inputs"]] == local_store["inputs"]
    for key in ("identity", "partitions", "version", "format"):
        assert remote_store[key] == local_store[key], key
    assert remote_store["input_paths"] == remote_names
    pairs = [(output_prefixes(local_root / "out"), output_prefixes(remote_root / "out"))]
    parts_local, parts_remote = (output_prefixes(r / "store" / "parts") for r in (local_root, remote_root))
    pairs.append((parts_local, parts_remote))
    for mine, theirs in pairs:
        assert [os.path.basename(p) for p in mine] == [os.path.basename(p) for p in theirs] and mine
        for a, b in zip(mine, theirs):
            for suffix in SHARD_FILES:
                assert open(a + suffix, "rb").read() == open(b + suffix, "rb").read(), b + suffix
            assert renamed_metadata(b, names, ids) == renamed_metadata(a, {}, {})
    for a, b in zip(parts_local, parts_remote):
        assert open(a + ".rows", "rb").read() == open(b + ".rows", "rb").read()


# --------------------------------------------------------------------------- every kind


# (a dataset saved by the compat stack's `datasets`: support/saved_datasets.py, hence marked compat)
KINDS = ["jsonl", "gz", "zst", "array", "parquet", "arrow", "arrow_stream",
         pytest.param("saved", marks=pytest.mark.compat)]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_from_the_bucket_is_the_run_on_a_local_copy(tmp_path, s3, bucket, kind):
    name = write_kind(tmp_path / "data", kind)
    upload_tree(s3, bucket, tmp_path / "data", "in")
    local, url = str(tmp_path / "data" / name), f"s3://{bucket}/in/{name}"
    run([local], tmp_path / "local" / "out" / "ds", tmp_path / "local" / "store")
    s3.clear()
    run([url], tmp_path / "remote" / "out" / "ds", tmp_path / "remote" / "store")
    assert object_gets(s3, bucket, ranged=True) and not object_gets(s3, bucket, ranged=False)  # ranged reads only
    if kind == "saved":
        files = sorted(n for n in os.listdir(tmp_path / "data" / name) if n.endswith(".arrow"))
        local_names = [os.path.join(local, f) for f in files]
        remote_names = [f"{url}/{f}" for f in files]
    else:
        local_names, remote_names = [local], [url]
    assert_same_run(tmp_path / "local", tmp_path / "remote", local_names, remote_names)
    parts = store_body(tmp_path / "remote" / "store")["partitions"]
    if kind in ("jsonl", "array", "parquet", "arrow", "arrow_stream", "saved"):
        assert len(parts) > 1   # cut into several byte ranges / row groups / batches, as locally


# --------------------------------------------------------------------------- expansion


def make_tree(root):
    """A directory of several kinds, a file no run reads, a hidden directory, a nested level."""
    write_kind(root, "jsonl", RECORDS[:30])
    write_kind(root / "sub", "array", RECORDS[30:60])
    write_kind(root / "sub" / "deeper", "parquet", RECORDS[60:90])
    open(root / "notes.txt", "w").write("not an input\n")
    open(root / ".hidden.jsonl", "wb").write(jsonl_bytes(RECORDS[:2]))
    write_kind(root / ".cache", "jsonl", RECORDS[:2])


def test_a_prefix_and_globs_expand_as_the_local_directory_and_globs(tmp_path, s3, bucket):
    from megatron_sft_idx.preprocess.records.inputs import expand_inputs

    make_tree(tmp_path / "data")
    upload_tree(s3, bucket, tmp_path / "data", "data")
    base, url = str(tmp_path / "data"), f"s3://{bucket}/data"

    def relative(names, prefix):
        assert all(n.startswith(prefix) for n in names)
        return [n[len(prefix):] for n in names]

    for local_spec, remote_spec in ((base, url), (base + "/", url + "/"), (base + "/*.jsonl", url + "/*.jsonl"),
                                    (base + "/**/*.json", url + "/**/*.json"), (base + "/s*/*", url + "/s*/*"),
                                    (base + "/**", url + "/**")):
        left_local, left_remote, sizes = [], [], {}
        local = expand_inputs([local_spec], left_local)
        remote = expand_inputs([remote_spec], left_remote, sizes)
        assert relative(remote, url) == relative(local, base), remote_spec
        assert relative(left_remote, url) == relative(left_local, base), remote_spec
        assert sizes == {n: os.path.getsize(base + n[len(url):]) for n in remote}
    left = []
    assert relative(expand_inputs([url], left), url) == ["/a.jsonl", "/sub/a.json", "/sub/deeper/a.parquet"]
    assert relative(left, url) == ["/.hidden.jsonl", "/notes.txt", "/.cache/"]   # said, never read; .cache/ not walked


def warnings_said(capsys) -> list:
    return [line for line in capsys.readouterr().err.splitlines() if ": warning: " in line]


def test_a_run_from_a_prefix_is_the_run_on_the_local_directory(tmp_path, s3, bucket, capsys):
    make_tree(tmp_path / "data")
    upload_tree(s3, bucket, tmp_path / "data", "data")
    base, url = str(tmp_path / "data"), f"s3://{bucket}/data/"
    run([base + "/"], tmp_path / "local" / "out" / "ds", tmp_path / "local" / "store", "--no-quiet")
    local_said = warnings_said(capsys)
    run([url], tmp_path / "remote" / "out" / "ds", tmp_path / "remote" / "store", "--no-quiet")
    said = [w for w in warnings_said(capsys) if "not of a kind the run reads" in w]
    assert len(said) == 1 and f"{url}notes.txt" in said[0] and f"{url}.hidden.jsonl" in said[0]
    assert said == [w.replace(base + "/", url) for w in local_said if "not of a kind" in w]   # said the same way
    names = ["a.jsonl", "sub/a.json", "sub/deeper/a.parquet"]
    assert_same_run(tmp_path / "local", tmp_path / "remote", [base + "/" + n for n in names], [url + n for n in names])


def test_a_missing_object_is_one_line_naming_it(tmp_path, s3, bucket, capsys):
    url = f"s3://{bucket}/nothing/here.jsonl"
    assert preprocess_main(["--input", url, "--tokenizer", TOKENIZER, "--output-prefix", str(tmp_path / "o"),
                            "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{url}: no input files match" in err and "Traceback" not in err
    with pytest.raises(InputError, match="no input files match"):
        driver.run(config([f"s3://{bucket}/nothing/*.jsonl"], tmp_path / "o"))


@pytest.mark.compat   # (a dataset saved by the compat stack's `datasets`: support/saved_datasets.py)
def test_a_saved_dataset_missing_a_data_file_is_refused_by_name(tmp_path, s3, bucket):
    write_kind(tmp_path / "data", "saved", RECORDS[:30])
    upload_tree(s3, bucket, tmp_path / "data", "in")
    first = sorted(n for n in os.listdir(tmp_path / "data" / "saved") if n.endswith(".arrow"))[0]
    s3.client().delete_object(Bucket=bucket, Key=f"in/saved/{first}")
    with pytest.raises(InputError, match="a data file state.json lists is missing") as info:
        driver.run(config([f"s3://{bucket}/in/saved"], tmp_path / "o"))
    assert info.value.path == f"s3://{bucket}/in/saved/{first}"


# --------------------------------------------------------------------------- versions and identity


def config(inputs, out, **kw):
    return Config([str(i) for i in inputs], str(out), tokenizer=TOKENIZER, pack_size=1024, workers=1,
                  progress="off", **kw)


def test_an_object_replaced_between_index_and_tokenize_fails_by_name(tmp_path, s3, bucket, monkeypatch):
    client = s3.client()
    client.put_object(Bucket=bucket, Key="in/a.jsonl", Body=jsonl_bytes(RECORDS))
    url = f"s3://{bucket}/in/a.jsonl"
    real = stages.Stages._index

    def index_then_replace(self, *args, **kwargs):
        index = real(self, *args, **kwargs)
        client.put_object(Bucket=bucket, Key="in/a.jsonl", Body=jsonl_bytes(RECORDS[::-1]))  # same size, other bytes
        return index

    monkeypatch.setattr(stages.Stages, "_index", index_then_replace)
    with pytest.raises(ObjectChangedError) as info:
        driver.run(config([url], tmp_path / "out" / "ds"))
    message = str(info.value)
    assert message.startswith(f"{url}: input {url} was replaced after it was indexed (its ETag changed)")
    assert "--resume" in message
    assert not os.path.exists(tmp_path / "out" / "ds.idx") and not [
        n for n in os.listdir(tmp_path / "out") if n.endswith(".idx")]
    monkeypatch.setattr(stages.Stages, "_index", real)
    # a rerun with --resume indexes the new bytes and gives the run of the new object
    fresh = tmp_path / "fresh"
    write_kind(fresh, "jsonl", RECORDS[::-1])
    driver.run(config([url], tmp_path / "out" / "ds", resume=True))
    driver.run(config([fresh / "a.jsonl"], tmp_path / "ref" / "ds"))
    for a, b in zip(output_prefixes(tmp_path / "ref"), output_prefixes(tmp_path / "out")):
        for suffix in SHARD_FILES:
            assert open(a + suffix, "rb").read() == open(b + suffix, "rb").read()


def test_a_replaced_object_is_never_read_as_a_mix_of_versions(tmp_path, s3, bucket):
    """At the reader: a read pinned to the indexed version, of an object replaced since, fails."""
    from megatron_sft_idx.preprocess.records.sources import ObjectInput, input_source

    client = s3.client()
    client.put_object(Bucket=bucket, Key="x.jsonl", Body=b"a" * (9 << 20))
    source = input_source(f"s3://{bucket}/x.jsonl")
    assert isinstance(source, ObjectInput) and source.ranged
    size, version = source.stat()
    assert source.stamp(version) == {"etag": version}
    with source.open(version) as f:
        assert f.read(10) == b"a" * 10
        client.put_object(Bucket=bucket, Key="x.jsonl", Body=b"b" * (9 << 20))
        f.seek(size - 10)
        with pytest.raises(ObjectChangedError):
            f.read(10)   # (past its buffer: a GET of the version it opened, which is gone)
    with pytest.raises(ObjectChangedError, match="replaced since it was read before"):
        source.open(version)


def test_resume_proves_the_inputs_by_content(tmp_path, s3, bucket, capsys):
    from megatron_sft_idx._progress import configure_logging

    configure_logging("preprocess-sft")
    client = s3.client()
    client.put_object(Bucket=bucket, Key="in/a.jsonl", Body=jsonl_bytes(RECORDS))
    url = f"s3://{bucket}/in/a.jsonl"
    out = tmp_path / "out" / "ds"
    first = driver.run(config([url], out))
    s3.clear()
    again = driver.run(config([url], out, resume=True))
    assert again["resumed_units"] == {"done": 1}
    read = sum(n for _, _, n in object_gets(s3, bucket, ranged=True))
    assert read == len(jsonl_bytes(RECORDS))   # every byte hashed again, from the object
    before = {p: open(p + ".bin", "rb").read() for p in output_prefixes(tmp_path / "out")}
    client.put_object(Bucket=bucket, Key="in/a.jsonl", Body=jsonl_bytes(RECORDS[::-1]))  # same size
    capsys.readouterr()
    third = driver.run(config([url], out, resume=True))
    assert third.get("resumed_units") != {"done": 1}
    assert any(f"{url}: input changed since the run finished" in w for w in warnings_said(capsys))
    after = {p: open(p + ".bin", "rb").read() for p in output_prefixes(tmp_path / "out")}
    assert after != before and first["conversations"] == third["conversations"]


def test_a_large_json_lines_object_is_streamed_in_bounded_gets(tmp_path, s3, bucket):
    """24 MiB of input (records between long blank lines): every GET of it is at most the
    read-ahead, the index reads it in a few GETs, and each partition reads only its own range."""
    from megatron_sft_idx.storage.objects import READ_AHEAD

    pad = b" " * (200 << 10) + b"\n"
    body = b"".join(json.dumps(r).encode() + b"\n" + pad for r in RECORDS)
    s3.client().put_object(Bucket=bucket, Key="big.jsonl", Body=body)
    url = f"s3://{bucket}/big.jsonl"
    s3.clear()
    summary = driver.run(config([url], tmp_path / "out" / "ds", partition_bytes=4 << 20))
    assert summary["conversations"] == len(RECORDS)
    gets = [(r, n) for k, r, n in object_gets(s3, bucket, ranged=True) if k == f"/{bucket}/big.jsonl"]
    assert max(n for _, n in gets) <= READ_AHEAD
    total = sum(n for _, n in gets)
    # the index's pass (the whole object) + the tokenize stage's (each range once) + the kind sniff
    assert 2 * len(body) <= total <= 2 * len(body) + (2 << 20)
    assert len(gets) <= 2 * (len(body) // READ_AHEAD + 1) + len(body) // (4 << 20) + 4


# --------------------------------------------------------------------------- the tokenizer


def shard_files(directory):
    return {os.path.basename(p) + s: open(p + s, "rb").read() for p in output_prefixes(directory)
            for s in SHARD_FILES + (".seq.idx",)}


def test_a_tokenizer_from_the_bucket_gives_the_bytes_of_the_local_directory(tmp_path, s3, bucket):
    import tempfile

    from megatron_sft_idx.preprocess.records.tokenizer_source import resolve_tokenizer

    upload_tree(s3, bucket, TOKENIZER, "models/tokenizer")
    s3.client().put_object(Bucket=bucket, Key="models/tokenizer/model.safetensors", Body=b"\0" * 4096)  # not shipped
    write_kind(tmp_path / "data", "jsonl")
    data = str(tmp_path / "data" / "a.jsonl")
    run([data], tmp_path / "local" / "out" / "ds", tmp_path / "local" / "store")
    url = f"s3://{bucket}/models/tokenizer/"
    assert preprocess_main(["--input", data, "--tokenizer", url, "--output-prefix", str(tmp_path / "remote" / "out" / "ds"),
                            "--store", str(tmp_path / "remote" / "store"), *SETTINGS]) == 0
    assert shard_files(tmp_path / "remote" / "out") == shard_files(tmp_path / "local" / "out")   # every byte
    local, remote = store_body(tmp_path / "local" / "store"), store_body(tmp_path / "remote" / "store")
    assert remote["store_id"] == local["store_id"] and remote["identity"] == local["identity"]
    assert remote["tokenizer_path"] == url and local["tokenizer_path"] == TOKENIZER   # where it was found
    shipped = resolve_tokenizer(url)
    assert [n for n, _ in shipped.files] == sorted(os.listdir(TOKENIZER))   # the tokenizer's files, not the weights
    # this process's copy, in its cache (asked for: an encoder an earlier test of this process
    # cached for the same files may have served the run without writing one here)
    copy = shipped.materialize()
    assert copy == os.path.join(os.environ["MEGATRON_SFT_IDX_CACHE"], "tokenizers", shipped.digest[:32], "tokenizer")
    assert sorted(os.listdir(copy)) == sorted(os.listdir(TOKENIZER))
    for name in os.listdir(TOKENIZER):
        assert open(os.path.join(copy, name), "rb").read() == open(os.path.join(TOKENIZER, name), "rb").read()


def test_a_tokenizer_url_without_tokenizer_json_or_too_large_is_refused(tmp_path, s3, bucket, monkeypatch, capsys):
    from megatron_sft_idx.preprocess.records import tokenizer_source

    write_kind(tmp_path / "data", "jsonl", RECORDS[:5])
    data = str(tmp_path / "data" / "a.jsonl")
    s3.client().put_object(Bucket=bucket, Key="empty/tokenizer_config.json", Body=b"{}")
    args = ["--input", data, "--output-prefix", str(tmp_path / "o"), "--quiet"]
    assert preprocess_main(args + ["--tokenizer", f"s3://{bucket}/empty/"]) == 1
    assert f"s3://{bucket}/empty/: no tokenizer.json under this URL" in capsys.readouterr().err
    upload_tree(s3, bucket, TOKENIZER, "tok")
    monkeypatch.setattr(tokenizer_source, "MAX_TOKENIZER_BYTES", 50_000)   # (the example's files hold ~56 kB)
    assert preprocess_main(args + ["--tokenizer", f"s3://{bucket}/tok"]) == 1
    err = capsys.readouterr().err
    assert f"s3://{bucket}/tok: the tokenizer's files hold" in err and "more than the 50000" in err


def test_a_hugging_face_name_is_taken_from_the_local_cache_offline(tmp_path, monkeypatch):
    """``--tokenizer org/name`` with the hub unreachable (HF_HUB_OFFLINE=1): the snapshot in the
    Hugging Face cache, laid out as huggingface_hub lays it out, gives the local directory's bytes."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(TOKENIZER, repo / "snapshots" / revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_kind(tmp_path / "data", "jsonl", RECORDS[:40])
    data = str(tmp_path / "data" / "a.jsonl")
    run([data], tmp_path / "local" / "out" / "ds", tmp_path / "local" / "store")
    assert preprocess_main(["--input", data, "--tokenizer", "acme/tiny-chat", "--output-prefix",
                            str(tmp_path / "hf" / "out" / "ds"), "--store", str(tmp_path / "hf" / "store"),
                            *SETTINGS]) == 0
    assert shard_files(tmp_path / "hf" / "out") == shard_files(tmp_path / "local" / "out")
    assert store_body(tmp_path / "hf" / "store")["tokenizer_path"] == "acme/tiny-chat"
    with pytest.raises(Exception, match="neither a local path nor a Hugging Face tokenizer"):
        driver.run(Config([data], str(tmp_path / "x"), tokenizer="acme/not-cached", progress="off"))


# --------------------------------------------------------------------------- the Ray engine


@pytest.mark.slow
@pytest.mark.subprocess
def test_ray_tasks_read_the_inputs_and_the_shipped_tokenizer_themselves(tmp_path, s3, bucket):
    """A one-node Ray cluster whose workers have their own temporary directory: the index and
    tokenize tasks GET the input object (the driver reads only the tokenizer's files, once),
    each worker materializes the shipped tokenizer in its own cache, and the shards are the local
    engine's on the local copy."""
    ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
    from megatron_sft_idx.storage import request_counts

    write_kind(tmp_path / "data", "jsonl")
    upload_tree(s3, bucket, tmp_path / "data", "in")
    upload_tree(s3, bucket, TOKENIZER, "tok")
    size = os.path.getsize(tmp_path / "data" / "a.jsonl")
    worker_tmp = tmp_path / "worker-tmp"
    worker_tmp.mkdir()
    env = dict(s3.env(), PYTHONPATH=ROOT, TMPDIR=str(worker_tmp), MEGATRON_SFT_IDX_RETRIES="4",
               MEGATRON_SFT_IDX_CACHE=str(worker_tmp / "cache"))
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, runtime_env={"env_vars": env})
    try:
        s3.clear()
        before = request_counts()
        summary = driver.run(Config([f"s3://{bucket}/in/a.jsonl"], str(tmp_path / "ray" / "ds"),
                                    tokenizer=f"s3://{bucket}/tok/", pack_size=1024, engine="ray",
                                    partition_bytes=50_000, progress="off"))
        mine = {k: v - before.get(k, 0) for k, v in request_counts().items()}
    finally:
        ray.shutdown()
    assert summary["engine"]["kind"] == "ray"
    tokenizer_bytes = sum(os.path.getsize(os.path.join(TOKENIZER, n)) for n in os.listdir(TOKENIZER))
    assert mine.get("get_bytes", 0) == tokenizer_bytes          # the driver: the tokenizer's files only
    input_bytes = sum(n for k, _, n in object_gets(s3, bucket, ranged=True) if k == f"/{bucket}/in/a.jsonl")
    assert input_bytes >= 2 * size                               # the tasks: the index's and the partitions' reads
    copies = os.listdir(worker_tmp / "cache" / "tokenizers")
    assert len(copies) == 1 and sorted(os.listdir(worker_tmp / "cache" / "tokenizers" / copies[0] /
                                                  "tok")) == sorted(os.listdir(TOKENIZER))   # named as the URL's level
    driver.run(config([tmp_path / "data" / "a.jsonl"], tmp_path / "local" / "ds", partition_bytes=50_000))
    data_files = lambda d: {k: v for k, v in shard_files(d).items() if not k.endswith(".seq.idx")}  # noqa: E731
    assert data_files(tmp_path / "ray") == data_files(tmp_path / "local") and data_files(tmp_path / "ray")
    names = {f"s3://{bucket}/in/a.jsonl": str(tmp_path / "data" / "a.jsonl")}
    for a, b in zip(output_prefixes(tmp_path / "local"), output_prefixes(tmp_path / "ray")):
        assert renamed_metadata(b, names, {}) == renamed_metadata(a, {}, {})


def test_a_bad_record_in_an_object_is_named_by_its_url_and_line(tmp_path, s3, bucket):
    body = jsonl_bytes(RECORDS[:2]) + b'{"messages": [\n' + jsonl_bytes(RECORDS[2:4])
    s3.client().put_object(Bucket=bucket, Key="in/bad.jsonl", Body=body)
    url = f"s3://{bucket}/in/bad.jsonl"
    with pytest.raises(InputError) as info:
        driver.run(config([url], tmp_path / "o" / "ds"))
    assert str(info.value).startswith(f"{url}:3: malformed JSON")


@pytest.mark.parametrize("writer", ["stream", "file"])
def test_an_arrow_partition_reads_its_own_batches_only(tmp_path, s3, bucket, writer):
    """8 MiB of Arrow in 20 record batches: the index reads the object once, and each of its
    partitions reads its own batches (a stream's earlier batches are skipped by their framing,
    a file's by its footer), giving the rows a local read gives."""
    from megatron_sft_idx.preprocess.records.partitions import Partition, index_file, read_batches
    from megatron_sft_idx.storage.objects import SEEKING_READ_AHEAD

    table = pa.Table.from_pylist([{"id": i, "pad": "x" * 4000} for i in range(2000)])
    path = tmp_path / "a.arrow"
    new = pa.ipc.new_stream if writer == "stream" else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as w:
        for lo in range(0, 2000, 100):
            w.write_table(table.slice(lo, 100))
    s3.client().put_object(Bucket=bucket, Key="a.arrow", Body=path.read_bytes())
    url, size = f"s3://{bucket}/a.arrow", path.stat().st_size
    s3.clear()
    remote = index_file(url, 0, 1 << 20)
    index_read = sum(n for _, _, n in object_gets(s3, bucket, ranged=True))
    local = index_file(str(path), 0, 1 << 20)
    assert remote["partitions"] == local["partitions"] and remote["sha256"] == local["sha256"]
    assert len(remote["partitions"]) >= 8 and index_read <= 2 * size + (1 << 20)
    for item in remote["partitions"]:
        part = Partition.from_list(item)
        s3.clear()
        got = [r for b in read_batches(url, part, 64, 1 << 20, remote["etag"]) for r in b]
        assert got == [r for b in read_batches(str(path), part, 64, 1 << 20) for r in b]
        own = (part.end - part.start) * 100 * 4000
        read = sum(n for _, _, n in object_gets(s3, bucket, ranged=True))
        assert own <= read <= own * 1.1 + 2 * SEEKING_READ_AHEAD + (64 << 10), (item, read, own)


@pytest.mark.parametrize("action", ["stall", "ignore-if-match"])
def test_a_hostile_store_ends_the_run_in_a_named_error(tmp_path, hostile, monkeypatch, action):
    """A stalled GET of an input ends the run within the storage deadlines (RemoteTimeoutError
    naming the object); a server that ignores If-Match serves the replaced object's bytes to the
    tokenize stage, and the response checks (the ETag of every answer) refuse them: the run
    never tokenizes a mix of two versions."""
    import uuid

    from megatron_sft_idx.errors import RemoteStorageError, RemoteTimeoutError, ResponseMismatchError

    name = f"in-{uuid.uuid4().hex[:8]}"
    hostile.make_bucket(name)
    client = hostile.client()
    client.put_object(Bucket=name, Key="a.jsonl", Body=jsonl_bytes(RECORDS))
    url = f"s3://{name}/a.jsonl"
    if action == "stall":
        hostile.inject(action, method="GET", suffix="/a.jsonl", times=1000)
    else:
        real = stages.Stages._index

        def index_then_replace(self, *args, **kwargs):
            index = real(self, *args, **kwargs)
            client.put_object(Bucket=name, Key="a.jsonl", Body=jsonl_bytes(RECORDS[::-1]))
            hostile.inject(action, method="GET", suffix="/a.jsonl", times=1000)
            return index

        monkeypatch.setattr(stages.Stages, "_index", index_then_replace)
    expected = RemoteTimeoutError if action == "stall" else (ResponseMismatchError, ObjectChangedError)
    with pytest.raises(RemoteStorageError) as info:
        driver.run(config([url], tmp_path / "o" / "ds"))
    assert isinstance(info.value, expected) and url in str(info.value), info.value
    assert not [n for n in os.listdir(tmp_path / "o") if n.endswith(".idx")]
    hostile.clear()


def test_msc_urls_expand_as_s3_urls_of_the_same_bucket(tmp_path, s3, bucket, monkeypatch):
    """An MSC profile on the same bucket (msc://loop/... is s3://BUCKET/...): the same inputs,
    in the same order, left-out files said the same way, the same bytes read."""
    from megatron_sft_idx.preprocess.records.inputs import expand_inputs
    from megatron_sft_idx.preprocess.records.partitions import index_file

    monkeypatch.setenv("MSC_CONFIG", s3.msc_config(str(tmp_path / "msc.json"), "loop", bucket))
    make_tree(tmp_path / "data")
    upload_tree(s3, bucket, tmp_path / "data", "data")
    for suffix in ("/data/", "/data", "/data/*.jsonl", "/data/**/*.json", "/data/**"):
        left_s3, left_msc = [], []
        names = expand_inputs([f"s3://{bucket}{suffix}"], left_s3)
        assert expand_inputs([f"msc://loop{suffix}"], left_msc) == [n.replace(f"s3://{bucket}", "msc://loop")
                                                                      for n in names], suffix
        assert left_msc == [n.replace(f"s3://{bucket}", "msc://loop") for n in left_s3], suffix
    for name in expand_inputs(["msc://loop/data/"]):
        mine, theirs = index_file(name, 0, 1 << 12), index_file(name.replace("msc://loop", f"s3://{bucket}"), 0, 1 << 12)
        assert (mine["sha256"], mine["partitions"]) == (theirs["sha256"], theirs["partitions"])
