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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_sft_idx.errors import InputError, ObjectChangedError
from megatron_sft_idx.metadata import ShardMetadata
from megatron_sft_idx.preprocess import driver
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
    assert preprocess_main(["--input", *inputs, "--tokenizer", TOKENIZER, "--output-prefix", str(out),
                            "--store", str(store), *SETTINGS, *extra]) == 0


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


KINDS = ["jsonl", "gz", "zst", "array", "parquet", "arrow", "arrow_stream", "saved"]


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
