"""The sequence store and the run's work directory in object storage (preprocess/workspace.py,
storage/mirror.py, storage/lease.py), against moto behind the counting proxy (the ``s3`` / ``bucket`` fixtures):
``--store s3://...`` with the local engine, byte for byte the shards of a local run; the store's
lock refuses a second run naming the first; a partition damaged in the bucket is found on
``--resume`` (checksums) and tokenized again; ``repack-sft --store s3://``, ``plan-batches
--store s3://`` and virtual packs from a store URL give what the local store gives. The Ray
engine's runs (the work directory in the bucket too) are in test_bucket_ray.py."""

import json
import os

import pytest

from megatron_sft_idx.preprocess.cli import main as preprocess_main
from megatron_sft_idx.preprocess.repack_cli import repack_main
from megatron_sft_idx.preprocess.files import commit_rank
from megatron_sft_idx.storage.mirror import Mirror

from support.buckets import bucket_files, local_files, local_reference
from support.stages import kill_after_receipt, killed_driver, run_killed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
SETTINGS = ["--input", os.path.join(EXAMPLES, "conversations.jsonl"), os.path.join(EXAMPLES, "conversations_sharegpt.jsonl"),
            "--tokenizer", os.path.join(EXAMPLES, "tokenizer"), "--pack-size", "256", "--max-packs-per-shard", "200",
            "--split", "90,10", "--partition-bytes", "60000", "--quiet"]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The reference: the same run on local disk, keeping its store."""
    return local_reference(tmp_path_factory, SETTINGS)


def forget_mirror(url):
    """Remove this node's mirror of an area (as on a fresh node): everything must come from the bucket."""
    import shutil

    shutil.rmtree(Mirror(url).home, ignore_errors=True)


def test_a_store_in_the_bucket_gives_the_bytes_of_a_local_store(s3, bucket, local_run, tmp_path, capsys):
    store = f"s3://{bucket}/stores/s1"
    assert preprocess_main(SETTINGS + ["--store", store, "--output-prefix", str(tmp_path / "out" / "ds"),
                                       "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert local_files(tmp_path / "out") == local_files(local_run / "out")
    stored = bucket_files(s3, bucket, "stores/s1/")
    local_store = {os.path.relpath(os.path.join(d, n), local_run / "store"): open(os.path.join(d, n), "rb").read()
                   for d, _, names in os.walk(local_run / "store") for n in names if n != "lock"}
    # the partitions and the receipts' committed content are the local store's (receipts carry timings)
    assert {k for k in stored} == {k for k in local_store}
    assert {k: v for k, v in stored.items() if k.startswith("parts/")} == \
        {k: v for k, v in local_store.items() if k.startswith("parts/")}
    assert "lock" not in bucket_files(s3, bucket, "stores/s1/")         # released
    assert summary["store"] == store                                      # named by its URL, not the mirror
    # every partition's receipt was written after its data, .idx after the rest
    puts = [k for m, k, _, _ in s3.requests if m == "PUT" and "/stores/s1/" in k]
    for k in [k for k in puts if "/receipts/tokenize/" in k]:
        part = "parts/part_" + k.rsplit("/", 1)[1][:-len(".json")]
        data = [i for i, p in enumerate(puts) if part in p]
        assert data and max(data) < puts.index(k), puts
        idx = [i for i, p in enumerate(puts) if p.endswith(part + ".idx")]
        assert idx and idx[0] == max(data), puts


def test_resume_from_the_bucket_redoes_a_damaged_partition(s3, bucket, local_run, tmp_path, capsys):
    store = f"s3://{bucket}/stores/s2"
    args = SETTINGS + ["--store", store, "--output-prefix", str(tmp_path / "out" / "ds")]
    assert preprocess_main(args) == 0
    client = s3.client()
    key = "stores/s2/parts/part_000001.bin"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[100] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))              # damaged in the bucket
    forget_mirror(store)                                                      # a fresh node
    again = SETTINGS + ["--store", store, "--output-prefix", str(tmp_path / "again" / "ds"), "--resume", "--json",
                        "--workers", "2"]   # (forked workers push what they make themselves)
    assert preprocess_main(again) == 0
    summary = json.loads(capsys.readouterr().out)
    partitions = len(bucket_files(s3, bucket, "stores/s2/receipts/tokenize/"))
    assert partitions > 2 and summary["resumed_units"]["tokenize"] == partitions - 1   # all but the damaged one
    assert bucket_files(s3, bucket, key)[""] == open(str(local_run / "store" / "parts" / "part_000001.bin"), "rb").read()
    assert local_files(tmp_path / "again") == local_files(local_run / "out")


def test_a_second_run_on_the_store_is_refused_naming_the_first(s3, bucket, tmp_path, capsys):
    from megatron_sft_idx.storage.lease import ObjectLock

    store = f"s3://{bucket}/stores/s3"
    holder = ObjectLock(store + "/lock", f"sequence store {store}")
    holder.acquire()                                    # a run elsewhere holds the store
    try:
        assert preprocess_main(SETTINGS + ["--store", store, "--output-prefix", str(tmp_path / "o" / "ds")]) == 1
        err = capsys.readouterr().err
        assert f"another process (pid {os.getpid()} on " in err and f"is writing sequence store {store}" in err, err
    finally:
        holder.release()
    assert preprocess_main(SETTINGS + ["--store", store, "--output-prefix", str(tmp_path / "o" / "ds")]) == 0


def test_repack_plan_batches_and_virtual_packs_from_a_store_url(s3, bucket, local_run, tmp_path, capsys):
    from megatron_sft_idx.preprocess.virtual import VirtualPackedDataset
    from megatron_sft_idx.tools.plan_batches_cli import main as plan_batches_main

    store = f"s3://{bucket}/stores/s4"
    assert preprocess_main(SETTINGS + ["--store", store, "--output-prefix", str(tmp_path / "first" / "ds")]) == 0
    forget_mirror(store)
    again = ["--pack-size", "512", "--split", "90,10", "--quiet"]
    assert repack_main(["--store", store, "--output-prefix", str(tmp_path / "url" / "ds")] + again) == 0
    assert repack_main(["--store", str(local_run / "store"), "--output-prefix", str(tmp_path / "loc" / "ds")]
                       + again) == 0
    assert local_files(tmp_path / "url") == local_files(tmp_path / "loc") and local_files(tmp_path / "url")
    # plan-batches --dynamic --store URL: the statistics of the local store
    dyn = ["--dynamic", "--max-tokens-per-microbatch", "2048", "--global-batch-size", "8",
           "--dp", "2", "--json"]
    capsys.readouterr()
    assert plan_batches_main(dyn + ["--store", store]) == 0
    remote = capsys.readouterr().out
    assert not os.path.exists(Mirror(store).home)   # a one-shot reader's mirror: gone after it (issue 44, item 8)
    assert repack_main(["--store", store, "--output-prefix", str(tmp_path / "po" / "ds"), "--plan-only",
                        str(tmp_path / "plan.json")] + again) == 0
    assert os.path.isfile(tmp_path / "plan.json") and not os.path.exists(Mirror(store).home)
    assert plan_batches_main(dyn + ["--store", str(local_run / "store")]) == 0
    assert remote == capsys.readouterr().out and json.loads(remote)["sequences"] > 0
    # virtual packs from the store URL: the packs of the local store
    plan = str(tmp_path / "p.plan")
    assert repack_main(["--store", str(local_run / "store"), "--plan-only", plan, "--pack-size", "512", "--quiet"]) == 0
    a, b = VirtualPackedDataset(store, plan), VirtualPackedDataset(str(local_run / "store"), plan)
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert (x.input_ids.tolist(), x.loss_mask.tolist()) == (y.input_ids.tolist(), y.loss_mask.tolist())


def test_a_unit_commits_data_then_receipt_and_only_while_its_run_holds_the_lock(s3, bucket, tmp_path):
    """Mirrored: a unit's artifacts reach the bucket before its receipt; a task of a run that lost
    its lock (its driver was killed and another run took over) commits nothing."""
    from dataclasses import dataclass

    from megatron_sft_idx.errors import ShardError
    from megatron_sft_idx.preprocess.receipts import ReceiptBook
    from megatron_sft_idx.preprocess.engines.mirrored import Mirrored
    from megatron_sft_idx.storage.lease import ObjectLock

    @dataclass(frozen=True)
    class WriteOne:   # a step of the engines' contract: writes one artifact, then its receipt
        directory: str
        book: ReceiptBook
        name: str = "write"

        def run(self, unit):
            path = os.path.join(self.directory, "data", f"d_{unit}.bin")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(bytes([unit]) * 100)
            return self.book.write(unit, {}, [path])

    area = Mirror(f"s3://{bucket}/area", commit_rank)
    lock = area.lock("w")
    lock.acquire()
    step = WriteOne(area.local, ReceiptBook(area.child("receipts"), "write", "k", area.local))
    unit = Mirrored(step, (area,), (area.local,), held=((str(lock.url), lock.nonce),))
    s3.clear()
    assert unit.run(0)["artifacts"] == {"data/d_0.bin": 100}
    puts = [k for m, k, _, _ in s3.requests if m == "PUT"]
    assert [k.split("/area/")[1] for k in puts] == ["data/d_0.bin", "receipts/write/000000.json"]
    lock.release()
    other = ObjectLock(str(lock.url), "w")
    other.acquire()                                   # another run holds the area now
    try:
        with pytest.raises(ShardError, match="no longer holds its lock"):
            unit.run(1)
        assert sorted(bucket_files(s3, bucket, "area/")) == ["data/d_0.bin", "lock", "receipts/write/000000.json"]
    finally:
        other.release()


def test_a_run_killed_mid_tokenize_resumes_from_the_buckets_receipts(s3, bucket, local_run, tmp_path, capsys):
    """SIGKILL after the third partition; the store's mirror lost with the machine; --resume elsewhere
    keeps exactly the partitions whose receipts reached the bucket and gives the local bytes."""
    import signal

    store = f"s3://{bucket}/stores/s5"
    args = SETTINGS + ["--store", store, "--output-prefix", str(tmp_path / "out" / "ds")]
    proc = run_killed(killed_driver(args, kill_after_receipt("tokenize", 3)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    done = bucket_files(s3, bucket, "stores/s5/receipts/tokenize/")
    partitions = len(json.loads(bucket_files(s3, bucket, "stores/s5/store.json")[""])["partitions"])
    assert len(done) == 3 < partitions and "lock" in bucket_files(s3, bucket, "stores/s5/")
    forget_mirror(store)
    assert preprocess_main(args + ["--resume", "--json"]) == 0   # the dead holder's lock is taken over
    summary = json.loads(capsys.readouterr().out)
    assert summary["resumed_units"]["tokenize"] == 3
    assert local_files(tmp_path / "out") == local_files(local_run / "out")
    assert len(bucket_files(s3, bucket, "stores/s5/receipts/tokenize/")) == partitions


def test_msc_cannot_hold_a_store_being_written_or_a_ray_work_directory(tmp_path, capsys):
    """msc:// offers no conditional writes, so no lock: refused in one line before any work, saying why."""
    assert preprocess_main(SETTINGS + ["--store", "msc://p/store", "--output-prefix", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--store msc://p/store: a store written in object storage is locked by conditional writes" in err, err
    assert repack_main(["--store", str(tmp_path / "s"), "--output-prefix", "msc://p/out/ds", "--engine", "ray"]) == 2
    err = capsys.readouterr().err
    assert "--output-prefix msc://p/out/ds: with --engine ray the work directory goes beside it" in err, err


def test_a_run_leaves_no_mirror_after_success_and_keeps_it_after_a_failure(s3, bucket, local_run, tmp_path,
                                                                            monkeypatch, capsys):
    """Issue 44, item 8: this node's mirror of a bucket store (and the tokenizer's copy, which
    belongs in the cache) is gone from the temporary directory after a successful run, kept after a
    failed one (for --resume), and removed by the resumed run's success; repack-sft the same."""
    import tempfile

    from megatron_sft_idx.errors import ShardError
    from megatron_sft_idx.preprocess import stages

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))            # this process and its forked workers
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    client = s3.client()
    tokenizer = os.path.join(EXAMPLES, "tokenizer")
    for name in os.listdir(tokenizer):
        client.put_object(Bucket=bucket, Key=f"tok/{name}", Body=open(os.path.join(tokenizer, name), "rb").read())
    store = f"s3://{bucket}/stores/s5"
    settings = [a if a != tokenizer else f"s3://{bucket}/tok/" for a in SETTINGS] + ["--store", store, "--workers", "2"]
    assert preprocess_main(settings + ["--output-prefix", str(tmp_path / "ok" / "ds")]) == 0
    assert os.listdir(temp) == []                                         # nothing left behind
    assert local_files(tmp_path / "ok") == local_files(local_run / "out")
    copies = os.listdir(os.path.join(os.environ["MEGATRON_SFT_IDX_CACHE"], "tokenizers"))
    assert len(copies) == 1                                               # the tokenizer: in the cache
    assert repack_main(["--store", store, "--pack-size", "512", "--quiet",
                        "--output-prefix", str(tmp_path / "re" / "ds")]) == 0
    assert os.listdir(temp) == [] and local_files(tmp_path / "re")

    def fail(self, store):
        raise ShardError("injected after the store was made")

    with monkeypatch.context() as m:
        m.setattr(stages.Stages, "pack", fail)
        assert preprocess_main(settings + ["--output-prefix", str(tmp_path / "failed" / "ds"), "--overwrite"]) == 1
    assert "injected after the store was made" in capsys.readouterr().err
    mirror = Mirror(store)
    assert os.listdir(temp) and os.path.isfile(os.path.join(mirror.local, "store.json"))   # kept for --resume
    assert preprocess_main(settings + ["--output-prefix", str(tmp_path / "failed" / "ds"), "--resume"]) == 0
    assert os.listdir(temp) == []
    assert local_files(tmp_path / "failed") == local_files(local_run / "out")


def test_a_mirror_another_run_holds_is_not_removed(tmp_path, monkeypatch):
    """Two runs of one node on one store share its mirror: the first to succeed leaves it to the other."""
    import multiprocessing as mp
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mirror = Mirror("s3://bkt/stores/shared")
    os.makedirs(mirror.local)
    open(os.path.join(mirror.local, "store.json"), "w").close()
    ctx = mp.get_context("fork")
    holding, done = ctx.Event(), ctx.Event()

    def other_run():
        with Mirror("s3://bkt/stores/shared").in_use():
            holding.set()
            done.wait(60)

    proc = ctx.Process(target=other_run)
    proc.start()
    try:
        assert holding.wait(60)
        with mirror.in_use():
            pass
        assert not mirror.remove_if_unused() and os.path.isfile(os.path.join(mirror.local, "store.json"))
    finally:
        done.set()
        proc.join(60)
    assert mirror.remove_if_unused() and os.listdir(tmp_path) == []     # the tree, what is known, the lock file
