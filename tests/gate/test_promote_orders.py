"""``check-idx --promote`` carries the balanced orders ``--balance-for`` wrote beside the data.

A set's order (``BASE.order``, recorded in ``BASE.json``) is copied after the set's shards and
before its manifest, which keeps the record; a single shard's order (``P.order``) follows the
shard. For a move nothing is left at the source; the adapters' ``"auto"`` order finds and
proves the promoted order against the promoted data.
"""

from __future__ import annotations

import json
import os

import pytest

from megatron_sft_idx import open_packed
from megatron_sft_idx.batching import Order
from megatron_sft_idx.batching.serve import checked_order, resolve_order
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.gate.cli import main as check_idx
from support.stages import copy_runs, files_of, preprocess, visible

TOPOLOGY = (2, 1, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs with --balance-for: a set (5 train shards, ds_train.json, ds_train.order) and one
    shard (ds, ds.order)."""
    root = tmp_path_factory.mktemp("runs")
    sets, single = str(root / "set"), str(root / "single")
    preprocess(sets, pack_size=512, split=[100], max_packs_per_shard=30, balance_for=TOPOLOGY)
    preprocess(single, pack_size=1024, balance_for=TOPOLOGY)
    assert "ds_train.order" in os.listdir(sets) and "ds_train.json" in os.listdir(sets), os.listdir(sets)
    assert "ds.order" in os.listdir(single) and "ds.json" not in os.listdir(single), os.listdir(single)
    return sets, single


@pytest.fixture
def run(runs, tmp_path):
    return copy_runs(runs, tmp_path)



def record(manifest):
    with open(manifest) as f:
        return json.load(f).get("order")


def auto_order(data_path):
    """The order training would serve for ``data_path`` with ``"auto"``, proven against it."""
    order = resolve_order("auto", data_path)
    checked_order(order, open_packed(data_path), seed=1234, topology=None, path=data_path)
    return order


def test_a_sets_order_travels_with_its_manifest(run, tmp_path, capsys):
    sets, _ = run
    order_bytes = open(os.path.join(sets, "ds_train.order"), "rb").read()
    rec = record(os.path.join(sets, "ds_train.json"))
    assert rec is not None and rec["file"] == "ds_train.order"
    dest = str(tmp_path / "storage")
    assert check_idx([sets, "--promote", dest]) == 0
    out = capsys.readouterr().out
    assert f"order {os.path.join(sets, 'ds_train.order')} -> {os.path.join(dest, 'ds_train.order')}" in out
    assert visible(sets) == []                            # nothing stranded at the source
    assert open(os.path.join(dest, "ds_train.order"), "rb").read() == order_bytes
    assert record(os.path.join(dest, "ds_train.json")) == rec   # the manifest still records it
    assert auto_order(os.path.join(dest, "ds_train.json")).to_bytes() == order_bytes


def test_a_single_shards_order_follows_the_shard(run, tmp_path):
    _, single = run
    order_bytes = open(os.path.join(single, "ds.order"), "rb").read()
    dest = str(tmp_path / "storage")
    assert check_idx([os.path.join(single, "ds"), "--promote", dest]) == 0
    assert visible(single) == []
    assert open(os.path.join(dest, "ds.order"), "rb").read() == order_bytes
    assert auto_order(os.path.join(dest, "ds")).to_bytes() == order_bytes


def test_link_copies_the_order_and_leaves_the_source(run, tmp_path):
    sets, _ = run
    source = files_of(sets)
    dest = str(tmp_path / "linked")
    assert check_idx([sets, "--promote", dest, "--link"]) == 0
    assert files_of(sets) == source
    assert open(os.path.join(dest, "ds_train.order"), "rb").read() == source["ds_train.order"]


def test_an_order_at_the_destination_is_not_replaced_without_replace(run, tmp_path, capsys):
    sets, single = run
    dest = tmp_path / "storage"
    dest.mkdir()
    (dest / "ds_train.order").write_bytes(b"someone else's")
    assert check_idx([sets, "--promote", str(dest)]) != 0
    assert "a balanced order exists at" in capsys.readouterr().out
    assert (dest / "ds_train.order").read_bytes() == b"someone else's"
    assert "ds_train.order" in visible(sets) and "ds_train.json" in visible(sets)   # nothing moved
    assert check_idx([sets, "--promote", str(dest), "--replace"]) == 0
    assert auto_order(str(dest / "ds_train.json"))


def test_a_sets_order_is_uploaded_after_its_shards_and_before_its_manifest_and_read_from_there(run, bucket, s3):
    sets, _ = run
    order_bytes = open(os.path.join(sets, "ds_train.order"), "rb").read()
    dest = f"s3://{bucket}/promoted-orders/"
    s3.requests.clear()
    assert check_idx([os.path.join(sets, "ds_train.json"), "--promote", dest]) == 0
    puts = [key for method, key, _, _ in s3.requests if method == "PUT"]
    assert puts[-1].endswith("promoted-orders/ds_train.json"), puts      # the set's commit point
    assert puts[-2].endswith("promoted-orders/ds_train.order"), puts     # its order just before
    import boto3

    body = boto3.client("s3").get_object(Bucket=bucket, Key="promoted-orders/ds_train.order")["Body"].read()
    assert body == order_bytes and visible(sets) == []
    # training from object storage: "auto" finds the order beside the promoted manifest, and a
    # named order URL loads the same bytes
    assert auto_order(dest + "ds_train.json").to_bytes() == order_bytes
    assert Order.load(dest + "ds_train.order").to_bytes() == order_bytes
    with pytest.raises(ShardError, match="cannot read the order file"):
        Order.load(dest + "missing.order")
    with pytest.raises(ShardError, match="no balanced order beside the data"):
        resolve_order("auto", dest + "ds_train_000000")
