"""merge-shards and convert-packed with s3:// outputs (and s3:// merge inputs), against moto's
S3 server on loopback (the ``s3`` / ``bucket`` fixtures of tests/conftest.py): staged locally,
gated, uploaded ``.idx`` last; a refused or interrupted run leaves nothing that opens."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from support.faults import leftovers
from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.errors import IncompleteShardError, ShardNotFoundError
from megatron_sft_idx.publishing import upload_shard
from megatron_sft_idx.tools.convert_cli import main as convert_main
from megatron_sft_idx.tools.merge_cli import main as merge_main
from megatron_sft_idx.publishing import write_manifest
from support.shardgen import random_packs, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUFFIXES = (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin")


def inputs(root, counts=(30, 40, 25), seed=0):
    rng = np.random.default_rng(seed)
    prefixes, packs = [], []
    for k, n in enumerate(counts):
        part = random_packs(rng, n, pack_size=128)
        write_shard(str(root / f"in_{k}"), part, pack_size=128, vocab_size=1000)
        prefixes.append(str(root / f"in_{k}"))
        packs += part
    return prefixes, packs


def equal_packs(ds, packs) -> bool:
    return len(ds) == len(packs) and all(
        np.array_equal(ds[i].input_ids, a) and np.array_equal(ds[i].loss_mask, b)
        and np.array_equal(ds[i].seq_start_id, c) for i, (a, b, c) in enumerate(packs))


def objects(s3, bucket, prefix=""):
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in listed)


def puts(s3):
    return [k for m, k, _, _ in s3.requests if m in ("PUT", "POST")]


def test_merge_to_s3_uploads_the_gated_shard_idx_last(s3, bucket, tmp_path, capsys):
    prefixes, packs = inputs(tmp_path)
    url = f"s3://{bucket}/merged/all"
    s3.clear()
    assert merge_main([url, *prefixes, "--json", "--staging-dir", str(tmp_path / "stage")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["output"] == url and doc["metadata"]["stats"]["pack_count"] == len(packs)
    assert equal_packs(MMapIndexedDataset(url), packs)
    assert puts(s3)[-1].endswith("merged/all.idx")  # the commit point, last
    assert objects(s3, bucket) == sorted(f"merged/all{s}" for s in SUFFIXES)
    assert os.listdir(tmp_path / "stage") == []  # the local copy is gone
    # Byte for byte what a local merge writes.
    assert merge_main([str(tmp_path / "local"), *prefixes, "--quiet"]) == 0
    body = s3.client().get_object(Bucket=bucket, Key="merged/all.bin")["Body"].read()
    assert body == open(tmp_path / "local.bin", "rb").read()


def test_merge_and_convert_to_an_msc_profile(s3, bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("MSC_CONFIG", s3.msc_config(str(tmp_path / "msc.json"), "loop", bucket))
    prefixes, packs = inputs(tmp_path)
    assert merge_main(["msc://loop/m/all", *prefixes, "--quiet"]) == 0
    assert equal_packs(MMapIndexedDataset("msc://loop/m/all"), packs)
    assert merge_main([str(tmp_path / "back"), "msc://loop/m/all", "--quiet"]) == 0  # and read back as input
    assert equal_packs(MMapIndexedDataset(str(tmp_path / "back")), packs)
    assert convert_main([prefixes[0], "msc://loop/c/p.parquet", "--quiet"]) == 0
    assert objects(s3, bucket, "c/") == ["c/p.parquet"]


def test_an_existing_s3_output_needs_overwrite(s3, bucket, tmp_path, capsys):
    prefixes, packs = inputs(tmp_path)
    url = f"s3://{bucket}/m/all"
    assert merge_main([url, prefixes[0], "--quiet"]) == 0
    capsys.readouterr()
    assert merge_main([url, *prefixes, "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert len(MMapIndexedDataset(url)) == 30  # untouched
    assert merge_main([url, *prefixes, "--quiet", "--overwrite"]) == 0
    assert equal_packs(MMapIndexedDataset(url), packs)


def test_a_refused_merge_uploads_nothing(s3, bucket, tmp_path, capsys):
    prefixes, _ = inputs(tmp_path)
    with open(prefixes[1] + ".loss.bin", "r+b") as f:  # flipped bytes: the CRC no longer matches
        f.seek(5)
        f.write(b"\x07")
    s3.clear()
    assert merge_main([f"s3://{bucket}/bad/all", *prefixes, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "failed the gate" in err and "nothing was published" in err and "Traceback" not in err
    assert objects(s3, bucket) == [] and puts(s3) == []


def test_merge_reads_s3_inputs_prefix_glob_and_manifest(s3, bucket, tmp_path):
    prefixes, packs = inputs(tmp_path)
    for k, p in enumerate(prefixes):
        upload_shard(p, f"s3://{bucket}/parts/in_{k}")
    manifest = tmp_path / "m" / "all.json"
    manifest.parent.mkdir()
    for k, p in enumerate(prefixes):  # a manifest next to the shards, uploaded beside them
        for s in SUFFIXES:
            os.link(p + s, str(manifest.parent / f"in_{k}{s}"))
    write_manifest(str(manifest), [str(manifest.parent / f"in_{k}") for k in range(3)])
    s3.client().upload_file(str(manifest), bucket, "parts/all.json")
    cases = {"prefixes": [f"s3://{bucket}/parts/in_{k}" for k in range(3)],
             "glob": [f"s3://{bucket}/parts/in_*"], "manifest": [f"s3://{bucket}/parts/all.json"],
             "mixed": [f"s3://{bucket}/parts/in_0", prefixes[1], f"s3://{bucket}/parts/in_2"]}
    for name, spec in cases.items():
        out = str(tmp_path / "out" / name)
        assert merge_main([out, *spec, "--quiet"]) == 0, name
        assert equal_packs(MMapIndexedDataset(out), packs), name
        assert not leftovers(tmp_path / "out"), name
    # s3 -> s3
    assert merge_main([f"s3://{bucket}/merged/all", f"s3://{bucket}/parts/in_*", "--quiet"]) == 0
    assert equal_packs(MMapIndexedDataset(f"s3://{bucket}/merged/all"), packs)


@pytest.mark.parametrize("upload,after", [(1, False), (4, False), (5, False), (5, True)])
def test_sigterm_during_the_upload(s3, bucket, tmp_path, upload, after):
    """SIGTERM just before (or after) upload number ``upload`` of five (``.idx`` is the fifth):
    before the ``.idx`` landed nothing opens and the tool says nothing was published; after, the
    shard is complete and the tool says so. A rerun succeeds either way."""
    prefixes, packs = inputs(tmp_path)
    url = f"s3://{bucket}/t/all"
    script = f"""
import os, signal, sys
from megatron_sft_idx.storage import objects
from megatron_sft_idx.tools.merge_cli import main
real, seen = objects.ObjectStore.upload, [0]
def upload(self, path, url):
    seen[0] += 1
    if seen[0] == {upload} and not {after}:
        os.kill(os.getpid(), signal.SIGTERM)
    real(self, path, url)
    if seen[0] == {upload} and {after}:
        os.kill(os.getpid(), signal.SIGTERM)
objects.ObjectStore.upload = upload
sys.exit(main([{url!r}, *{prefixes!r}, "--staging-dir", {str(tmp_path / "stage")!r}]))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "stage").mkdir()
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr
    assert os.listdir(tmp_path / "stage") == []
    if after:
        assert "published completely" in proc.stderr, proc.stderr
        assert equal_packs(MMapIndexedDataset(url), packs)
    else:
        assert "nothing was published" in proc.stderr, proc.stderr
        with pytest.raises((ShardNotFoundError, IncompleteShardError)):
            MMapIndexedDataset(url)
    assert merge_main([url, *prefixes, "--quiet"] + ["--overwrite"] * after) == 0
    assert equal_packs(MMapIndexedDataset(url), packs)


def test_convert_to_s3_shard_and_parquet(s3, bucket, tmp_path, capsys):
    prefixes, packs = inputs(tmp_path, counts=(40,))
    parquet = str(tmp_path / "p.parquet")
    assert convert_main([prefixes[0], parquet, "--quiet"]) == 0
    # Parquet -> shard in the bucket: staged, gated, uploaded .idx last.
    s3.clear()
    url = f"s3://{bucket}/conv/train"
    assert convert_main([parquet, url, "--json", "--check", "--staging-dir", str(tmp_path / "st")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["output"] == url and doc["gate_passed"] is True
    assert equal_packs(MMapIndexedDataset(url), packs)
    assert puts(s3)[-1].endswith("conv/train.idx") and os.listdir(tmp_path / "st") == []
    assert convert_main([parquet, url, "--quiet"]) == 2 and "already exists" in capsys.readouterr().err
    # Shard -> Parquet in the bucket, with Bridge's pack metadata beside it.
    pq_url, meta_url = f"s3://{bucket}/conv/train.parquet", f"s3://{bucket}/conv/train.meta.json"
    assert convert_main([prefixes[0], pq_url, "--pack-metadata", meta_url, "--quiet"]) == 0
    client = s3.client()
    assert client.get_object(Bucket=bucket, Key="conv/train.parquet")["Body"].read() == open(parquet, "rb").read()
    record = json.loads(client.get_object(Bucket=bucket, Key="conv/train.meta.json")["Body"].read())[0]
    assert record["max_samples_per_bin"] == MMapIndexedDataset(prefixes[0]).metadata.stats.max_samples_per_bin
    assert convert_main([prefixes[0], pq_url, "--quiet"]) == 2  # exists
    assert convert_main([prefixes[0], pq_url, "--quiet", "--overwrite"]) == 0


def test_convert_refuses_s3_inputs_saying_what_to_do(s3, bucket, tmp_path, capsys):
    prefixes, _ = inputs(tmp_path, counts=(5,))
    upload_shard(prefixes[0], f"s3://{bucket}/x/s")
    assert convert_main([f"s3://{bucket}/x/s", str(tmp_path / "o.parquet")]) == 1
    err = capsys.readouterr().err
    assert "reads local inputs only" in err and "merge-shards" in err and "Traceback" not in err


def test_an_upload_that_lands_different_is_found_by_the_read_back(s3, bucket, tmp_path, capsys, monkeypatch):
    """The store acknowledges the .seq.idx, but what landed has one byte of its metadata flipped
    (same size: the listed sizes agree): the read-back after the commit names the object."""
    from megatron_sft_idx.storage.destination import ObjectDestination

    prefixes, _ = inputs(tmp_path)
    real = ObjectDestination.put

    def corrupting(self, source, final):
        if final.endswith(".seq.idx"):
            data = bytearray(open(source, "rb").read())
            data[70] ^= 0x01
            source = str(tmp_path / "corrupted")
            with open(source, "wb") as f:
                f.write(data)
        real(self, source, final)

    monkeypatch.setattr(ObjectDestination, "put", corrupting)
    url = f"s3://{bucket}/merged/all"
    assert merge_main([url, *prefixes, "--quiet", "--staging-dir", str(tmp_path / "stage")]) == 1
    err = capsys.readouterr().err
    assert "not whole" in err and "header differs" in err and f"{url}.seq.idx" in err, err
    monkeypatch.setattr(ObjectDestination, "put", real)
    assert merge_main([url, *prefixes, "--quiet", "--overwrite", "--staging-dir", str(tmp_path / "stage")]) == 0
    MMapIndexedDataset(url)
