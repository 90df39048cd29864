"""A mixture whose stores are in object storage (moto behind the counting proxy): with the local
engine and with ``--engine ray`` (the work directory in the bucket too), ``preprocess-sft --mix``
and ``repack-sft --mix`` publish the bytes of the same mixture on local disk."""

import json
import os

import pytest

from megatron_sft_idx.preprocess.cli import main as preprocess_main
from megatron_sft_idx.preprocess.repack_cli import repack_main

from support.buckets import bucket_files, local_files
from support.stages import CHAT, TOKENIZER

REPACK = ["--pack-size", "512", "--max-packs-per-shard", "20", "--split", "85,15", "--balance-for", "1,1,4", "--quiet"]
PACK = REPACK + ["--tokenizer", TOKENIZER, "--partition-bytes", "40000"]


def write_mix(path, chat_store, share_store):
    path.write_text(json.dumps({"version": 1, "window_steps": 2, "sources": [
        {"name": "chat", "inputs": [CHAT[0]], "store": chat_store, "weight": 2},
        {"name": "share", "inputs": [CHAT[1]], "store": share_store, "weight": 1, "max_epochs": 3}]}))
    return str(path)


@pytest.fixture(scope="module")
def local_mix(tmp_path_factory):
    """The reference: the mixture on local disk, its stores kept."""
    d = tmp_path_factory.mktemp("localmix")
    mix = write_mix(d / "mix.json", str(d / "chat"), str(d / "share"))
    assert preprocess_main(["--mix", mix, "--output-prefix", str(d / "out" / "ds")] + PACK) == 0
    return d


@pytest.mark.remote
def test_stores_in_the_bucket_give_the_bytes_of_local_stores(s3, bucket, local_mix, tmp_path):
    mix = write_mix(tmp_path / "mix.json", f"s3://{bucket}/stores/chat", str(tmp_path / "share"))
    assert preprocess_main(["--mix", mix, "--output-prefix", str(tmp_path / "out" / "ds")] + PACK) == 0
    assert local_files(tmp_path / "out") == local_files(local_mix / "out")
    stored = bucket_files(s3, bucket, "stores/chat/")
    assert any(k.endswith(".trained") for k in stored) and "lock" not in stored
    # repacked from the bucket's store, no tokenizing: the same bytes again
    assert repack_main(["--mix", mix, "--output-prefix", str(tmp_path / "again" / "ds")] + REPACK) == 0
    assert local_files(tmp_path / "again") == local_files(local_mix / "out")


ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")


@pytest.fixture(scope="module")
def cluster(loop, tmp_path_factory):
    """A one-node cluster whose workers have a temporary directory of their own (their own mirrors)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(loop.env(), PYTHONPATH=root, TMPDIR=str(tmp_path_factory.mktemp("workers-tmp")))
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, runtime_env={"env_vars": env})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.remote
def test_a_mixture_on_ray_with_everything_in_the_bucket(cluster, s3, bucket, local_mix, tmp_path, capsys):
    mix = write_mix(tmp_path / "mix.json", f"s3://{bucket}/rs/chat", f"s3://{bucket}/rs/share")
    engine = ["--engine", "ray", "--ray-address", cluster]
    assert preprocess_main(["--mix", mix, "--output-prefix", f"s3://{bucket}/out/ds", "--check", "--json"]
                           + PACK + engine) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["engine"]["kind"] == "ray" and f"s3://{bucket}/out/.ds.preprocess" in summary["engine"]["bucket_areas"]
    assert bucket_files(s3, bucket, "out/") == local_files(local_mix / "out")
    assert list(bucket_files(s3, bucket, "out/.ds.preprocess/", hidden=True)) == ["receipts/done/000000.json"]
    assert repack_main(["--mix", mix, "--output-prefix", f"s3://{bucket}/out2/ds"] + REPACK + engine) == 0
    assert bucket_files(s3, bucket, "out2/") == local_files(local_mix / "out")
