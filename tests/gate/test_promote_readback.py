"""``check-idx --promote`` exits 0 only when the destination, read back, is whole (issue 30).

An order or manifest upload that fails for good (the S3 proxy of tests/conftest.py answers 500
to every attempt) ends the run non-zero with a ``DESTINATION_INCOMPLETE`` finding naming the
missing file, keeps the sources, and a rerun with ``--replace`` finishes; locally, a balanced
order with one flipped byte (or one that is not the order its manifest records) is refused
before anything moves (``TRAVELLER_INVALID``); ``--replace`` removes an old order the new
generation does not bring.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from megatron_sft_idx import open_packed
from megatron_sft_idx.batching.serve import resolve_order
from megatron_sft_idx.gate.cli import main as check_idx
from support.stages import copy_runs, preprocess, visible

TOPOLOGY = (2, 1, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same set written three times: with a balanced order (ds_train.json recording
    ds_train.order), without one, and without one in fewer, larger shards."""
    root = tmp_path_factory.mktemp("runs")
    balanced, plain, fewer = str(root / "balanced"), str(root / "plain"), str(root / "fewer")
    preprocess(balanced, pack_size=512, split=[100], max_packs_per_shard=30, balance_for=TOPOLOGY)
    preprocess(plain, pack_size=512, split=[100], max_packs_per_shard=30)
    preprocess(fewer, pack_size=512, split=[100], max_packs_per_shard=60)
    assert "ds_train.order" in os.listdir(balanced) and "ds_train.order" not in os.listdir(plain)
    assert len(os.listdir(fewer)) < len(os.listdir(plain))
    return balanced, plain, fewer


@pytest.fixture
def run(runs, tmp_path):
    return copy_runs(runs, tmp_path)



def promote(capsys, *args):
    code = check_idx([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def findings(report, code):
    return [f for s in report["shards"] for f in s["findings"] if f["code"] == code]


def keys(s3, bucket, prefix):
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"][len(prefix):] for o in listed)


@pytest.mark.parametrize("failing", ["ds_train.json", "ds_train.order"])
def test_a_failed_upload_of_the_manifest_or_order_fails_the_promotion_naming_it(run, s3, bucket, capsys, failing):
    balanced = run[0]
    before = visible(balanced)
    dest = f"s3://{bucket}/promoted/"
    s3.inject("500", lambda m, k, h: m == "PUT" and k.endswith("/promoted/" + failing), times=1000)
    code, report = promote(capsys, balanced, "--promote", dest)
    assert code == 1 and not report["passed"]
    named = {f["file"] for f in findings(report, "DESTINATION_INCOMPLETE")}
    assert dest + failing in named, named
    if failing.endswith(".order"):   # the manifest that records it is not written either
        assert dest + "ds_train.json" in named
    message = findings(report, "DESTINATION_INCOMPLETE")[0]["message"]
    assert "--replace" in message and re.search(r"the destination holds (\d+) of the \1 shards", message), message
    assert "ds_train.json" not in keys(s3, bucket, "promoted/")   # no manifest points at an incomplete set
    assert visible(balanced) == before                            # the sources are kept
    s3.clear()
    code, report = promote(capsys, balanced, "--promote", dest, "--replace")
    assert code == 0 and not findings(report, "DESTINATION_INCOMPLETE")
    assert visible(balanced) == []
    assert len(open_packed(dest + "ds_train.json")) > 0
    assert resolve_order("auto", dest + "ds_train.json") is not None


def test_a_failed_manifest_upload_through_an_msc_profile_fails_the_promotion(run, s3, bucket, capsys, tmp_path,
                                                                             monkeypatch):
    balanced = run[0]
    monkeypatch.setenv("MSC_CONFIG", s3.msc_config(str(tmp_path / "msc.json"), "loop", bucket))
    dest = "msc://loop/promoted/"
    s3.inject("500", lambda m, k, h: m == "PUT" and k.endswith("/promoted/ds_train.json"), times=1000)
    code, report = promote(capsys, balanced, "--promote", dest)
    assert code == 1
    assert dest + "ds_train.json" in {f["file"] for f in findings(report, "DESTINATION_INCOMPLETE")}
    assert "ds_train.json" in visible(balanced)
    s3.clear()
    assert promote(capsys, balanced, "--promote", dest, "--replace")[0] == 0
    assert len(open_packed(dest + "ds_train.json")) > 0


@pytest.mark.parametrize("damage", ["flipped byte", "not the recorded order"])
def test_a_damaged_order_is_refused_before_anything_moves(run, tmp_path, capsys, damage):
    balanced = run[0]
    order = os.path.join(balanced, "ds_train.order")
    data = bytearray(open(order, "rb").read())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x01
    else:   # a whole order, but another one than the manifest records
        from megatron_sft_idx.batching import Order

        other = Order.from_bytes(bytes(data), order)
        other.seed += 1
        data = bytearray(other.to_bytes())
    with open(order, "wb") as f:
        f.write(data)
    before = visible(balanced)
    dest = tmp_path / "storage"
    code, report = promote(capsys, balanced, "--promote", str(dest))
    assert code == 1
    refused = findings(report, "TRAVELLER_INVALID")
    assert refused and len(refused) == len(report["shards"]), report
    assert ("not whole" if damage == "flipped byte" else "not the one its manifest records") in refused[0]["message"]
    assert not findings(report, "PROMOTED")
    assert visible(balanced) == before and (not dest.exists() or visible(dest) == [])


def test_an_order_whose_denominators_are_not_the_shards_is_refused(run, tmp_path, capsys):
    """A whole order, the one its manifest records, but counting one more trained token in the
    first sequence than the shards hold: the promotion recounts them and refuses it."""
    import zlib

    from megatron_sft_idx.batching import Order

    balanced = run[0]
    path, manifest = os.path.join(balanced, "ds_train.order"), os.path.join(balanced, "ds_train.json")
    order = Order.load(path)
    order.trained.sequence["stored"][0] += 1
    order.trained._packs.clear()
    data = order.to_bytes()   # (its step denominators follow from the edited count: it is whole)
    with open(path, "wb") as f:
        f.write(data)
    doc = json.load(open(manifest))
    doc["order"].update(size=len(data), crc32=zlib.crc32(data))
    with open(manifest, "w") as f:
        json.dump(doc, f)
    before = visible(balanced)
    code, report = promote(capsys, balanced, "--promote", str(tmp_path / "storage"))
    refused = findings(report, "TRAVELLER_INVALID")
    assert code == 1 and refused and len(refused) == len(report["shards"]), report
    assert "not the order of these shards" in refused[0]["message"]
    assert "pack 0's trained tokens" in refused[0]["message"]
    assert visible(balanced) == before


def test_a_missing_recorded_order_is_refused(run, tmp_path, capsys):
    balanced = run[0]
    os.remove(os.path.join(balanced, "ds_train.order"))
    code, report = promote(capsys, balanced, "--promote", str(tmp_path / "storage"))
    assert code == 1 and "not beside it" in findings(report, "TRAVELLER_INVALID")[0]["message"]


def test_replace_leaves_no_stale_order(run, tmp_path, capsys):
    balanced, plain = run[:2]
    dest = tmp_path / "storage"
    assert promote(capsys, balanced, "--promote", str(dest))[0] == 0
    assert "ds_train.order" in visible(dest)
    code, report = promote(capsys, plain, "--promote", str(dest))   # without --replace: refused, untouched
    assert code == 1 and "ds_train.order" in visible(dest) and "ds_train.json" in visible(plain)
    code, report = promote(capsys, plain, "--promote", str(dest), "--replace")
    assert code == 0, report
    assert "ds_train.order" not in visible(dest) and "ds_train.json" in visible(dest)
    assert {"source": str(dest / "ds_train.order"), "removed": "an old order the new generation does not bring"} \
        in report["manifests"]
    assert json.load(open(dest / "ds_train.json")).get("order") is None
    assert len(open_packed(str(dest / "ds_train.json"))) > 0


def test_replace_removes_the_old_generations_shards_the_new_manifest_does_not_list(run, tmp_path, capsys):
    _, plain, fewer = run
    dest = tmp_path / "storage"
    assert promote(capsys, plain, "--promote", str(dest))[0] == 0
    old = visible(dest)
    code, report = promote(capsys, fewer, "--promote", str(dest), "--replace")
    assert code == 0, report
    listed = [os.path.basename(p) for p in open_packed(str(dest / "ds_train.json")).prefixes]
    assert visible(dest) == sorted([n + s for n in listed for s in (".bin", ".idx", ".loss.bin", ".seq.bin",
                                                                       ".seq.idx")] + ["ds_train.json"])
    assert len(visible(dest)) < len(old)
    assert any("old shard's file" in m.get("removed", "") for m in report["manifests"])
    assert len(open_packed(str(dest))) == len(open_packed(str(dest / "ds_train.json")))   # the directory is one set


def test_replace_leaves_no_stale_order_in_object_storage(run, s3, bucket, capsys):
    balanced, plain = run[:2]
    dest = f"s3://{bucket}/promoted/"
    assert promote(capsys, balanced, "--promote", dest)[0] == 0
    assert "ds_train.order" in keys(s3, bucket, "promoted/")
    code, report = promote(capsys, plain, "--promote", dest, "--replace")
    assert code == 0, report
    assert "ds_train.order" not in keys(s3, bucket, "promoted/") and "ds_train.json" in keys(s3, bucket, "promoted/")
    assert len(open_packed(dest + "ds_train.json")) > 0


# --------------------------------------------------------------------------- the data files' identity (issue 41)


@pytest.mark.parametrize("suffix", [".bin", ".loss.bin", ".seq.bin"])
def test_a_server_that_stores_other_bytes_than_sent_fails_the_promotion(run, s3, bucket, capsys, suffix):
    """The proxy flips a byte of one data file's upload (and drops its checksum headers): the
    server answers for the bytes it stored, which are not those sent. The promotion fails (exit 1)
    naming the object, the sources stay, and nothing points at the shard; a rerun finishes."""
    plain = run[1]
    before = visible(plain)
    dest = f"s3://{bucket}/promoted/"
    victim = "ds_train_000001" + suffix
    s3.inject("corrupt-write", lambda m, k, h: m == "PUT" and k.endswith("/promoted/" + victim), times=1000)
    code, report = promote(capsys, plain, "--promote", dest)
    assert code == 1 and not report["passed"]
    failed = findings(report, "PROMOTION_FAILED")
    assert failed and "other bytes than were sent" in failed[0]["message"] and victim in failed[0]["message"], failed
    assert visible(plain) == before                                   # the sources are kept
    assert "ds_train.json" not in keys(s3, bucket, "promoted/")
    assert "ds_train_000001.idx" not in keys(s3, bucket, "promoted/")  # the shard's commit point never sent
    s3.clear()
    code, report = promote(capsys, plain, "--promote", dest, "--replace")
    assert code == 0 and visible(plain) == []
    assert len(open_packed(dest + "ds_train.json")) > 0


def test_a_data_file_replaced_before_the_read_back_fails_the_promotion(run, s3, bucket, capsys, monkeypatch):
    """Another writer replaces a data file after its upload with as many other bytes: its size and
    the headers read back are right, its identity is not (the ETag its upload's answer proved)."""
    from megatron_sft_idx.storage.destination import ObjectDestination

    plain = run[1]
    before = visible(plain)
    dest = f"s3://{bucket}/promoted/"
    real = ObjectDestination.read_back

    def read_back(self, expected):
        client = s3.client()
        key = "promoted/ds_train_000000.bin"
        body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        body[len(body) // 2] ^= 0xFF
        client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
        return real(self, expected)

    monkeypatch.setattr(ObjectDestination, "read_back", read_back)
    code, report = promote(capsys, plain, "--promote", dest)
    assert code == 1 and not report["passed"]
    incomplete = findings(report, "DESTINATION_INCOMPLETE")
    assert incomplete and "another writer replaced it" in incomplete[0]["message"], incomplete
    assert dest + "ds_train_000000.bin" in {f["file"] for f in incomplete}
    kept = visible(plain)                           # that shard's source is kept, with its manifest
    assert {n for n in before if n.startswith("ds_train_000000.")} | {"ds_train.json"} <= set(kept), kept
