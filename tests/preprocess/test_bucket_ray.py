"""``--engine ray`` with the store and the work directory in object storage, on a REAL one-node Ray
cluster whose workers have a temporary directory of their own (so each task mirrors the areas on
"its node" and everything it makes reaches the driver through the bucket), and moto behind the
counting proxy. The runs publish the bytes of the local engine; a driver killed mid-tokenize is
``--resume``d from the bucket's receipts, redoing only the missing partitions; the driver's mirrors
hold receipts and store.json only, the data being verified and checked in the tasks."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from megatron_sft_idx.preprocess.cli import main as preprocess_main  # noqa: E402
from megatron_sft_idx.preprocess.repack_cli import repack_main  # noqa: E402
from megatron_sft_idx.storage import request_counts  # noqa: E402

from support.buckets import bucket_files, local_files, local_reference  # noqa: E402
from support.stages import kill_after_receipt, kill_after_step, kill_at_call, killed_driver, run_killed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
SETTINGS = ["--input", os.path.join(EXAMPLES, "conversations.jsonl"), os.path.join(EXAMPLES, "conversations_sharegpt.jsonl"),
            "--tokenizer", os.path.join(EXAMPLES, "tokenizer"), "--pack-size", "256", "--max-packs-per-shard", "200",
            "--split", "90,10", "--partition-bytes", "30000", "--quiet"]


@pytest.fixture(scope="module")
def workers_tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("workers-tmp"))


@pytest.fixture(scope="module")
def workers_env(loop, workers_tmp):
    """The workers' environment: the S3 server, this checkout, and a TMPDIR not the driver's."""
    return dict(loop.env(), PYTHONPATH=ROOT, TMPDIR=workers_tmp)


@pytest.fixture(scope="module")
def cluster(workers_env):
    """A one-node cluster started here, its workers in ``workers_env``."""
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, runtime_env={"env_vars": workers_env})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The reference: the same run on local disk, keeping its store, and a repack of that store in ``rp``."""
    root = local_reference(tmp_path_factory, SETTINGS)
    assert repack_main(["--store", str(root / "store"), "--output-prefix", str(root / "rp" / "ds"), "--pack-size", "512",
                        "--quiet"]) == 0
    return root


def test_store_and_work_directory_in_the_bucket_give_the_local_bytes(cluster, workers_tmp, s3, bucket, local_run,
                                                                     tmp_path, capsys):
    store, out = f"s3://{bucket}/store", f"s3://{bucket}/out/ds"
    copies = request_counts().get("copy", 0)
    assert preprocess_main(SETTINGS + ["--engine", "ray", "--ray-address", cluster, "--store", store,
                                       "--output-prefix", out, "--check", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["engine"]["kind"] == "ray" and summary["engine"]["bucket_areas"] == [
        store, f"s3://{bucket}/out/.ds.preprocess"]
    published = bucket_files(s3, bucket, "out/")
    assert published == local_files(local_run / "out") and len(published) > 6
    # the shards were copied from the staged objects server-side, not uploaded by the driver
    shards = [n for n in published if not n.endswith(".json")]
    assert request_counts().get("copy", 0) - copies == len(shards)
    # the work directory in the bucket is reduced to the run's record; the store's lock released
    assert list(bucket_files(s3, bucket, "out/.ds.preprocess/", hidden=True)) == ["receipts/done/000000.json"]
    assert "lock" not in bucket_files(s3, bucket, "store/")
    # --resume of the finished run: the bucket's record says done, nothing is run again
    assert preprocess_main(SETTINGS + ["--engine", "ray", "--ray-address", cluster, "--store", store,
                                       "--output-prefix", out, "--check", "--json", "--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["resumed_units"] == {"done": 1}
    # the run's success removed its mirrors from every node (issue 44, item 8): the workers' own
    # temporary directory (a node of its own here) is back to no mirror at all
    assert not [n for n in os.listdir(workers_tmp) if n.startswith("msi-area-")]
    # repack-sft on the cluster from the store URL to an output URL: the bytes of a local repack
    assert repack_main(["--engine", "ray", "--ray-address", cluster, "--store", store, "--output-prefix",
                        f"s3://{bucket}/out2/ds", "--pack-size", "512", "--quiet"]) == 0
    assert bucket_files(s3, bucket, "out2/") == local_files(local_run / "rp")


def test_a_driver_killed_mid_tokenize_resumes_from_the_bucket(cluster, workers_env, s3, bucket, local_run,
                                                              tmp_path, capsys):
    store, out = f"s3://{bucket}/store", f"s3://{bucket}/out/ds"
    args = SETTINGS + ["--engine", "ray", "--ray-address", cluster, "--store", store, "--output-prefix", out]
    # the driver dies after the third partition's receipt: its lock and work stay
    proc = run_killed(killed_driver(args, kill_after_receipt("tokenize", 3), cluster, workers_env))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    time.sleep(2)   # (tasks of the dead driver end with it)
    done = bucket_files(s3, bucket, "store/receipts/tokenize/")
    partitions = len(json.loads(bucket_files(s3, bucket, "store/store.json")[""])["partitions"])
    assert 3 <= len(done) < partitions
    assert "lock" in bucket_files(s3, bucket, "store/")          # the dead driver's lock is left
    assert preprocess_main(args + ["--resume", "--json"]) == 0   # its holder is dead: taken over at once
    summary = json.loads(capsys.readouterr().out)
    assert summary["resumed_units"]["tokenize"] == len(done)     # only the missing partitions redone
    assert bucket_files(s3, bucket, "out/") == local_files(local_run / "out")
    assert len(bucket_files(s3, bucket, "store/receipts/tokenize/")) == partitions


def test_a_second_run_on_the_work_directory_is_refused_and_an_expired_lease_taken_over(
        cluster, s3, bucket, local_run, tmp_path, capsys, monkeypatch):
    """The run's lock in the bucket (.ds.preprocess/lock) held by a run on another host refuses this
    one, naming its holder; once that holder's lease runs out (it stopped renewing), it is taken over."""
    monkeypatch.setenv("MEGATRON_SFT_IDX_LEASE_SECONDS", "3")
    monkeypatch.setenv("MEGATRON_SFT_IDX_REQUEST_TIMEOUT", "2")   # (the lease's floor: 1.5 x the request timeout)
    out = f"s3://{bucket}/out/ds"
    code = ("import socket,sys; socket.gethostname=lambda: 'elsewhere';"
            "from megatron_sft_idx.storage.lease import ObjectLock; ObjectLock(sys.argv[1], 'w').acquire();"
            "import os; os._exit(0)")   # (killed: it never renews)
    subprocess.run([sys.executable, "-c", code, f"s3://{bucket}/out/.ds.preprocess/lock"], check=True,
                   env=dict(os.environ, PYTHONPATH=ROOT))
    args = SETTINGS + ["--engine", "ray", "--ray-address", cluster, "--output-prefix", out]
    assert preprocess_main(args) == 1
    err = capsys.readouterr().err
    assert "another process (pid " in err and " on elsewhere) is writing output " + out in err, err
    assert bucket_files(s3, bucket, "out/") == {}                 # nothing written
    time.sleep(3.1)
    assert preprocess_main(args + ["--resume"]) == 0
    assert bucket_files(s3, bucket, "out/") == local_files(local_run / "out")


def test_a_driver_killed_mid_publish_is_finished_by_another_driver(cluster, workers_env, s3, bucket, local_run,
                                                                  tmp_path, capsys):
    """The driver dies while copying the staged shards to their final names; a driver on "another
    machine" (its mirrors gone) finishes the publish from the bucket's intent and receipts."""
    import shutil

    from megatron_sft_idx.storage.mirror import Mirror

    out = f"s3://{bucket}/out/ds"
    args = SETTINGS + ["--engine", "ray", "--ray-address", cluster, "--output-prefix", out]
    # mid-publish: two shards copied, the third not
    proc = run_killed(killed_driver(args, kill_at_call("copy", 3), cluster, workers_env))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "receipts/intent/000000.json" in bucket_files(s3, bucket, "out/.ds.preprocess/", hidden=True)
    shutil.rmtree(Mirror(f"s3://{bucket}/out/.ds.preprocess").home)   # another driver machine
    assert preprocess_main(args + ["--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["resumed_units"]["materialize"] == len([n for n in local_files(local_run / "out")
                                                           if n.endswith(".seq.idx")])
    assert bucket_files(s3, bucket, "out/") == local_files(local_run / "out")


def test_nothing_but_the_bucket(cluster, s3, bucket, tmp_path, capsys):
    """Inputs, tokenizer, store and output all URLs: the Ray engine publishes the bytes the local
    engine publishes from the same URLs."""
    from megatron_sft_idx.storage.destination import destination_for

    dest = destination_for(f"s3://{bucket}/in/")
    for path in SETTINGS[1:3]:
        dest.put(path, f"s3://{bucket}/in/{os.path.basename(path)}")
    tokenizer = SETTINGS[4]
    for name in os.listdir(tokenizer):
        dest.put(os.path.join(tokenizer, name), f"s3://{bucket}/tok/{name}")
    urls = ["--input", f"s3://{bucket}/in/*.jsonl", "--tokenizer", f"s3://{bucket}/tok"] + SETTINGS[5:]
    assert preprocess_main(urls + ["--engine", "ray", "--ray-address", cluster, "--store", f"s3://{bucket}/store",
                                   "--output-prefix", f"s3://{bucket}/ray/ds"]) == 0
    assert preprocess_main(urls + ["--output-prefix", f"s3://{bucket}/local/ds"]) == 0
    ray_files = bucket_files(s3, bucket, "ray/")
    assert len(ray_files) > 6 and ray_files == bucket_files(s3, bucket, "local/")


def _mirror_files(urls):
    """Every file under the driver's mirrors of ``urls`` (their ``msi-area-*`` homes), relative."""
    from megatron_sft_idx.storage.mirror import Mirror

    out = []
    for url in urls:
        home = Mirror(url).home
        for directory, _, names in os.walk(home):
            for name in names:
                rel = os.path.relpath(os.path.join(directory, name), home).replace(os.sep, "/")
                if not rel.startswith(".etags/"):
                    out.append(f"{url} {rel}")
    return out


def test_the_driver_holds_receipts_only(cluster, s3, bucket, local_run, monkeypatch, capsys):
    """A run whose store and work directory are in the bucket, with --check and --verify-masks:
    store verification, the plan and its checks, the shards, the gate and the mask check run in
    the tasks; the driver's mirrors (listed after every step, and every object it downloaded)
    hold receipts and store.json only -- no partition, .rows, plan body or shard -- and the
    published bytes are the local engine's."""
    from megatron_sft_idx.preprocess.engines.mirrored import MirroredEngine
    from megatron_sft_idx.storage import objects

    store, out = f"s3://{bucket}/store", f"s3://{bucket}/out/ds"
    areas = [store, f"s3://{bucket}/out/.ds.preprocess"]
    seen, downloaded, steps = set(), [], []
    real_map, real_download = MirroredEngine.map, objects.ObjectStore.download

    def listing_map(self, step, units, on_done, on_progress=None):
        real_map(self, step, units, on_done, on_progress)
        steps.append(step.name)
        seen.update(_mirror_files(areas))

    def download(self, url, path, *args, **kwargs):   # (into a mirror: the published output's read-back is not)
        if any(str(url).startswith(a + "/") for a in areas):
            downloaded.append(str(url))
        return real_download(self, url, path, *args, **kwargs)

    monkeypatch.setattr(MirroredEngine, "map", listing_map)
    monkeypatch.setattr(objects.ObjectStore, "download", download)
    args = SETTINGS + ["--engine", "ray", "--ray-address", cluster, "--store", store, "--output-prefix", out,
                       "--check", "--verify-masks", "8", "--json"]
    assert preprocess_main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["verify_masks"]["checked"] == 8 and summary["check"]["passed"]
    assert bucket_files(s3, bucket, "out/") == local_files(local_run / "out")
    assert {"plan", "materialize", "verify-masks", "check"} <= set(steps)
    # the store's partitions, .rows, the plan body and the staged shards are in the bucket ...
    held = bucket_files(s3, bucket, "store/")
    assert any(n.endswith(".rows") for n in held) and any(n.endswith(".seq.bin") for n in held)
    # ... and never on the driver's disk
    assert seen and downloaded
    for entry in sorted(seen) + downloaded:
        name = entry.rsplit("/", 1)[-1]
        assert "/receipts/" in entry.replace(" ", "/") and name.endswith(".json") or name == "store.json", entry
    # a resumed run whose store is complete verifies it again, in the tasks: still receipts only here
    seen.clear(), downloaded.clear(), steps.clear()
    assert preprocess_main(args[:-1] + ["--output-prefix", f"s3://{bucket}/again/ds", "--resume"]) == 0
    assert "verify-store" in steps
    for entry in sorted(seen) + downloaded:
        name = entry.rsplit("/", 1)[-1]
        assert "/receipts/" in entry.replace(" ", "/") and name.endswith(".json") or name == "store.json", entry
    assert bucket_files(s3, bucket, "again/") == local_files(local_run / "out")
    # repack-sft from the store URL: the store verified in the tasks, the driver's store mirror untouched
    seen.clear(), downloaded.clear(), steps.clear()
    assert repack_main(["--engine", "ray", "--ray-address", cluster, "--store", store, "--output-prefix",
                        f"s3://{bucket}/rp/ds", "--pack-size", "512", "--check", "--quiet"]) == 0
    assert {"verify-store", "plan", "materialize", "check"} <= set(steps)
    assert bucket_files(s3, bucket, "rp/") == local_files(local_run / "rp")
    areas[1] = f"s3://{bucket}/rp/.ds.preprocess"
    seen.update(_mirror_files(areas))
    for entry in sorted(seen) + downloaded:
        name = entry.rsplit("/", 1)[-1]
        assert "/receipts/" in entry.replace(" ", "/") and name.endswith(".json") or name == "store.json", entry


def test_a_partition_damaged_in_the_bucket_is_found_by_the_tasks(cluster, s3, bucket, local_run, capsys):
    """The store's verification runs in the tasks (one per partition): a partition damaged in the
    bucket stops a repack, named, and a --resume on the cluster tokenizes it (and only it) again."""
    store = f"s3://{bucket}/store"
    args = SETTINGS + ["--engine", "ray", "--ray-address", cluster, "--store", store]
    assert preprocess_main(args + ["--output-prefix", f"s3://{bucket}/out/ds"]) == 0
    client = s3.client()
    key = "store/parts/part_000001.bin"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[100] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))              # damaged in the bucket
    capsys.readouterr()
    assert repack_main(["--engine", "ray", "--ray-address", cluster, "--store", store, "--output-prefix",
                        f"s3://{bucket}/rp/ds", "--pack-size", "512", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "store partition 1 does not verify" in err and "part_000001.bin" in err, err
    assert bucket_files(s3, bucket, "rp/") == {}
    assert preprocess_main(args + ["--output-prefix", f"s3://{bucket}/again/ds", "--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    partitions = len(bucket_files(s3, bucket, "store/receipts/tokenize/"))
    assert partitions > 2 and summary["resumed_units"]["tokenize"] == partitions - 1   # all but the damaged one
    assert bucket_files(s3, bucket, key)[""] == open(str(local_run / "store" / "parts" / "part_000001.bin"), "rb").read()
    assert bucket_files(s3, bucket, "again/") == local_files(local_run / "out")


def test_balanced_orders_are_planned_in_a_task(cluster, s3, bucket, tmp_path, monkeypatch, capsys):
    """--balance-for with the work directory in the bucket: the orders are planned by a task from the
    staged shards (the driver pulls none of them) and published with the bytes of a local run's."""
    from megatron_sft_idx.storage import objects

    balanced = SETTINGS[:-1] + ["--balance-for", "2,1,4", "--cost-model", "llama3.2-1b", "--quiet"]
    assert preprocess_main(balanced + ["--output-prefix", str(tmp_path / "local" / "ds")]) == 0
    work = f"s3://{bucket}/bal/.ds.preprocess/"
    downloaded = []
    real = objects.ObjectStore.download

    def download(self, url, path, *args, **kwargs):
        if str(url).startswith(work):
            downloaded.append(str(url))
        return real(self, url, path, *args, **kwargs)

    monkeypatch.setattr(objects.ObjectStore, "download", download)
    assert preprocess_main(balanced + ["--engine", "ray", "--ray-address", cluster, "--output-prefix",
                                       f"s3://{bucket}/bal/ds", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["orders"] and all(o.endswith(".order") for o in summary["orders"])
    published = bucket_files(s3, bucket, "bal/")
    assert published == local_files(tmp_path / "local") and any(n.endswith(".order") for n in published)
    assert downloaded and all("/receipts/" in u and u.endswith(".json") for u in downloaded), downloaded


def test_the_skip_report_is_made_in_a_task(cluster, s3, bucket, tmp_path, monkeypatch):
    """--skip-report with the store in the bucket: a task pulls the partitions' .skips and .rows
    (and, for a conversation the plan truncates, its partition) and the driver gets the lines
    alone; the report is the local run's, byte for byte: a bad record, and the plan's drop of a
    conversation that keeps nothing trained once truncated."""
    from megatron_sft_idx.storage import objects
    from support.sft_fixtures import write_jsonl

    long_prompt = {"messages": [{"role": "user", "content": " ".join(f"ask{k}" for k in range(900))},
                                {"role": "assistant", "content": "short"}]}
    long_reply = {"messages": [{"role": "user", "content": "q"},
                               {"role": "assistant", "content": " ".join(f"say{k}" for k in range(900))}]}
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"messages": "nope"}, long_prompt, long_reply, long_prompt])
    settings = SETTINGS[:1] + [str(odd)] + SETTINGS[1:] + ["--skip-bad", "--overlong", "truncate"]
    assert preprocess_main(settings + ["--output-prefix", str(tmp_path / "local" / "ds"),
                                       "--skip-report", str(tmp_path / "local.jsonl")]) == 0
    store = f"s3://{bucket}/skips/store"
    downloaded = []
    real = objects.ObjectStore.download

    def download(self, url, path, *args, **kwargs):
        if str(url).startswith(store + "/"):
            downloaded.append(str(url))
        return real(self, url, path, *args, **kwargs)

    monkeypatch.setattr(objects.ObjectStore, "download", download)
    assert preprocess_main(settings + ["--engine", "ray", "--ray-address", cluster, "--store", store,
                                       "--output-prefix", f"s3://{bucket}/skips/out/ds",
                                       "--skip-report", str(tmp_path / "bucket.jsonl")]) == 0
    report = (tmp_path / "bucket.jsonl").read_bytes()
    assert report == (tmp_path / "local.jsonl").read_bytes()
    lines = [json.loads(x) for x in report.decode().splitlines()]
    assert [(x["line"], x["reason"]) for x in lines] == [
        (1, "missing_key"), (2, "overlong_untrainable_after_truncation"), (4, "overlong_untrainable_after_truncation")]
    assert downloaded and all(u.endswith("/store.json") or "/receipts/" in u for u in downloaded), downloaded


def test_a_staged_shard_damaged_in_the_bucket_is_found_by_a_task_and_written_again(
        cluster, workers_env, s3, bucket, local_run, capsys):
    """--resume checks the staged shards of the killed attempt in the tasks (one per shard, each
    pulling its shard): the one damaged in the bucket is written again, the others kept."""
    out = f"s3://{bucket}/out/ds"
    args = SETTINGS + ["--engine", "ray", "--ray-address", cluster, "--output-prefix", out, "--check"]
    # every shard staged in the bucket, nothing checked or published
    proc = run_killed(killed_driver(args, kill_after_step("materialize"), cluster, workers_env))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    staged = bucket_files(s3, bucket, "out/.ds.preprocess/staged/", hidden=True)
    shards = sorted(n[:-len(".seq.idx")] for n in staged if n.endswith(".seq.idx"))
    assert len(shards) > 2 and bucket_files(s3, bucket, "out/") == {}
    client = s3.client()
    key = f"out/.ds.preprocess/staged/{shards[1]}.seq.idx"
    data = bytearray(staged[f"{shards[1]}.seq.idx"])
    data[-1] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))               # damaged in the bucket
    assert preprocess_main(args + ["--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["resumed_units"]["materialize"] == len(shards) - 1         # all but the damaged one
    assert bucket_files(s3, bucket, "out/") == local_files(local_run / "out")


def test_verify_masks_pulls_what_its_sample_reads(cluster, workers_tmp, s3, bucket, local_run, monkeypatch, capsys):
    """The --verify-masks task, on a node whose mirrors are empty, pulls the plan and the store's
    rows, then only the partitions and staged shards its sample lands in."""
    import shutil

    from megatron_sft_idx.preprocess.engines.mirrored import MirroredEngine

    real = MirroredEngine.map
    held = {}

    def map(self, step, units, on_done, on_progress=None):
        if step.name == "verify-masks":   # a node that holds nothing yet
            for name in os.listdir(workers_tmp):
                if name.startswith("msi-area-") and not name.endswith(".use"):   # (not the lock file beside it)
                    shutil.rmtree(os.path.join(workers_tmp, name))
        real(self, step, units, on_done, on_progress)
        if step.name == "verify-masks":
            held.update((name, os.path.join(directory, name)) for directory, _, names in os.walk(workers_tmp)
                        for name in names if "/.etags" not in directory and "msi-area-" in directory)

    monkeypatch.setattr(MirroredEngine, "map", map)
    args = SETTINGS + ["--engine", "ray", "--ray-address", cluster, "--store", f"s3://{bucket}/store",
                       "--output-prefix", f"s3://{bucket}/out/ds", "--verify-masks", "2", "--json"]
    assert preprocess_main(args) == 0
    assert json.loads(capsys.readouterr().out)["verify_masks"]["checked"] == 2
    partitions = len(json.loads(bucket_files(s3, bucket, "store/store.json")[""])["partitions"])
    rows = [n for n in held if n.endswith(".rows")]
    parts = [n for n in held if n.startswith("part_") and n.endswith(".seq.idx")]
    shards = [n for n in held if n.startswith("ds_") and n.endswith(".seq.idx")]
    assert partitions > 2 and len(rows) == partitions and "out.plan" in held
    assert 1 <= len(parts) <= 2 and 1 <= len(shards) <= 2, sorted(held)
    assert bucket_files(s3, bucket, "out/") == local_files(local_run / "out")
