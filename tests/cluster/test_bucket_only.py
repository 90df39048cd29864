"""Issue 32's bucket-only setup on a REAL three-node Ray cluster on this machine
(tests/support/ray_cluster.py): the nodes share nothing but a bucket of the S3 server on the
host's 127.0.0.1 (moto behind bench/s3loop.py's proxy, reached from each node through its own
counting bridge). Inputs, tokenizer, store and outputs are URLs:

    preprocess-sft --engine ray --ray-address ADDR --input s3://B/in/ --tokenizer s3://B/tok/ \\
        --store s3://B/store --output-prefix s3://B/out/NAME [--resume] [--check]
    repack-sft --engine ray --ray-address ADDR --store s3://B/store --output-prefix s3://B/out2/NAME

Written against that contract before the engine side (inputs and tokenizer from URLs; the store,
the work directory and the outputs written by the tasks to the bucket) is merged: until then
these tests fail at the first command (its refusal of an s3:// input or store is in the message).

Every test: the bytes of the local engine on a local copy of the same data -- the shards' data
files byte for byte; the ``.seq.idx`` metadata and the manifests identical once the inputs' names
(a URL here, a local path there: ``source.inputs[].name``) and the set ids that digest them are
swapped, as tests/preprocess/test_remote_inputs.py compares them -- and the path audit empty with
the driver's directories and the local copy's directory forbidden to every node process.
"""

import ast
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

pytest.importorskip("ray", reason="the [ray] extra is not installed")

from support.ray_cluster import UNIT_TASK, RayCluster, finish, peak_mib, with_peak  # noqa: E402
from megatron_sft_idx.reader import MMapIndexedDataset  # noqa: E402
from support.stages import files_of  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREPROCESS = os.path.join(ROOT, "tools", "preprocess_sft.py")
REPACK = os.path.join(ROOT, "tools", "repack_sft.py")
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
FLAGS = ["--pack-size", "1024", "--split", "90,10", "--max-packs-per-shard", "20", "--partition-bytes", "60K",
         "--batch-size", "32", "--quiet"]
REPACK_FLAGS = ["--pack-size", "2048", "--cp", "2", "--max-packs-per-shard", "10", "--quiet"]
NAME = "chat"


@pytest.fixture(scope="module")
def cluster(loop, tmp_path_factory):
    """The cluster, its nodes' S3 env pointing at the ``loop`` server; the local copies (under
    ``cluster.root/local``) and the driver's directories are forbidden to every node process."""
    root = tmp_path_factory.mktemp("bucket-cluster")
    with RayCluster(str(root), env=loop.env(), forbidden=[str(root / "local")]) as c:
        yield c


@pytest.fixture(scope="module")
def local_copy(cluster):
    """The bundled example x4 and the tokenizer on local disk (under the root forbidden to the
    nodes), and the local engine's outputs and store from them: made once per module."""
    local = os.path.join(cluster.root, "local", "copy")
    os.makedirs(os.path.join(local, "in"))
    text = open(os.path.join(ROOT, "examples", "conversations.jsonl"), encoding="utf-8").read()
    with open(os.path.join(local, "in", "chat.jsonl"), "w", encoding="utf-8") as f:
        f.write(text * 4)
    shutil.copytree(TOKENIZER, os.path.join(local, "tok"))
    ref = os.path.join(local, "ref")
    proc = subprocess.run([sys.executable, PREPROCESS, "--input", os.path.join(local, "in", "chat.jsonl"),
                           "--tokenizer", os.path.join(local, "tok"), "--output-prefix", os.path.join(ref, NAME),
                           "--store", os.path.join(local, "store"), "--engine", "local", "--workers", "2", *FLAGS],
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return local


@pytest.fixture
def data(local_copy, s3, bucket, tmp_path):
    """The local copy's files in a fresh ``bucket`` under in/ and tok/; scratch space in tmp_path."""
    client = s3.client()
    client.upload_file(os.path.join(local_copy, "in", "chat.jsonl"), bucket, "in/chat.jsonl")
    for name in os.listdir(os.path.join(local_copy, "tok")):
        client.upload_file(os.path.join(local_copy, "tok", name), bucket, f"tok/{name}")
    return {"bucket": bucket, "local": local_copy, "ref": os.path.join(local_copy, "ref"), "client": client,
            "scratch": str(tmp_path)}


def preprocess(cluster, b, run, *extra, store="store"):
    """The contract's command; run ``run`` publishes s3://B/<run>/NAME*."""
    return [sys.executable, PREPROCESS, "--engine", "ray", "--ray-address", cluster.address,
            "--input", f"s3://{b}/in/", "--tokenizer", f"s3://{b}/tok/", "--store", f"s3://{b}/{store}",
            "--output-prefix", f"s3://{b}/{run}/{NAME}", "--summary-json", summary_path(cluster, run), *FLAGS, *extra]


def summary_path(cluster, run):
    return os.path.join(cluster.driver_dir, f"{run}.summary.json")


def summary(cluster, run):
    with open(summary_path(cluster, run)) as f:
        return json.load(f)


def published(client, bucket, run):
    """{file name: bytes} of the objects ``<run>/NAME*`` (not the hidden work directory)."""
    out = {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{run}/{NAME}")
    for page in pages:
        for obj in page.get("Contents", []):
            rest = obj["Key"][len(run) + 1:]
            if "/" not in rest:
                out[rest] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def reference(data):
    """The local engine's outputs on the local copy (the same NAME: manifests name their shards)."""
    return {n: b for n, b in files_of(data["ref"]).items() if not n.startswith(".")}


def assert_same_as_local(got, expected, data, scratch):
    """``got`` (published objects) against ``expected`` (the local engine's files): data files
    byte-identical; every ``.seq.idx``'s metadata and every manifest identical once the input's
    URL and the set ids are swapped for the local path and the local run's set ids."""
    assert sorted(got) == sorted(expected) and got
    os.makedirs(scratch, exist_ok=True)
    for name, body in got.items():
        with open(os.path.join(scratch, name), "wb") as f:
            f.write(body)
    names = {f"s3://{data['bucket']}/in/chat.jsonl": os.path.join(data["local"], "in", "chat.jsonl")}
    ref_dir = os.path.join(scratch, "..", os.path.basename(scratch) + "-expected")
    os.makedirs(ref_dir, exist_ok=True)
    for name, body in expected.items():
        with open(os.path.join(ref_dir, name), "wb") as f:
            f.write(body)
    swaps, metas = dict(names), []
    for name in sorted(got):
        if name.endswith(".seq.idx"):
            prefix = name[:-len(".seq.idx")]
            mine = MMapIndexedDataset(os.path.join(scratch, prefix)).metadata.to_dict()
            theirs = MMapIndexedDataset(os.path.join(ref_dir, prefix)).metadata.to_dict()
            if "set" in mine:
                swaps[mine["set"]["id"]] = theirs["set"]["id"]
            metas.append((name, mine, theirs))
        elif not name.endswith(".json"):
            assert got[name] == expected[name], name
    assert [i["name"] for m in metas for i in m[1]["source"]["inputs"]] == list(names) * len(metas)

    def swapped(text):
        for a, b in swaps.items():
            text = text.replace(json.dumps(a)[1:-1], json.dumps(b)[1:-1])
        return text

    for name, mine, theirs in metas:
        assert json.loads(swapped(json.dumps(mine, sort_keys=True))) == theirs, name
    for name in got:
        if name.endswith(".json"):
            assert swapped(got[name].decode()) == expected[name].decode(), name


def test_every_node_reaches_the_bucket_through_its_own_bridge_and_nothing_else(cluster, s3, bucket):
    """The harness itself: a task on each node writes an object with the storage layer's client
    env (AWS_ENDPOINT_URL = that node's bridge); each bridge counts its own node's bytes."""
    cluster.verify_loopback()
    before = cluster.s3_bytes()
    code = ("import os, ray, boto3\n"
            "ray.init()\n"
            "@ray.remote(num_cpus=1)\n"
            "def put(bucket, i):\n"
            "    import time; time.sleep(1.0)\n"
            "    boto3.client('s3').put_object(Bucket=bucket, Key=f'probe/{i}', Body=b'x' * 100000)\n"
            "    return os.environ['AWS_ENDPOINT_URL']\n"
            f"print(sorted(set(ray.get([put.remote({bucket!r}, i) for i in range(6)]))))\n")
    proc = cluster.run([sys.executable, "-c", code], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    endpoints = {b.endpoint for b in cluster.bridges.values()}
    used = set(ast.literal_eval(proc.stdout.strip().splitlines()[-1]))
    assert len(used) >= 2 and used <= endpoints and cluster.bridges["driver"].endpoint not in used
    after = cluster.s3_bytes()
    wrote = {n: after[n]["written"] - before[n]["written"] for n in cluster.names}
    assert sum(wrote.values()) >= 600000 and len([n for n in wrote if wrote[n] >= 100000]) >= 2, wrote
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket, Prefix="probe/")["Contents"]]
    assert sorted(keys) == [f"probe/{i}" for i in range(6)]


def test_bucket_only_gives_the_local_bytes_on_several_nodes_and_repacks_them(cluster, data):
    b, client = data["bucket"], data["client"]
    mark, before, bytes_before = cluster.audit_mark(), cluster.task_nodes(UNIT_TASK), cluster.s3_bytes()
    proc = cluster.run(preprocess(cluster, b, "out", "--check"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = published(client, b, "out")
    assert_same_as_local(out, reference(data), data, os.path.join(data["scratch"], "got"))
    s = summary(cluster, "out")
    assert s["engine"]["kind"] == "ray" and s["engine"]["cpus"] == 3 and s["units"]["tokenize"] == 20
    after = cluster.task_nodes(UNIT_TASK)
    ran = [n for n in cluster.names if after.get(n, 0) > before.get(n, 0)]
    assert len(ran) >= 2, (before, after)
    # the nodes that ran units read and wrote the bucket themselves; the shards never went
    # through the driver: none of its requests carried a shard's data (a server-side copy has none)
    moved = {n: {k: v - bytes_before[n][k] for k, v in c.items()} for n, c in cluster.s3_bytes().items()}
    assert all(moved[n]["written"] > 0 and moved[n]["read"] > 0 for n in ran), moved
    requests = cluster.s3_requests()["driver"]
    assert requests and ("?", "", 0, "") not in requests
    data_files = (".bin", ".idx", ".loss.bin", ".seq.bin", ".seq.idx")
    uploads = [r for r in requests if r[0] in ("PUT", "POST") and r[2] > 0 and r[1].split("?")[0].endswith(data_files)]
    assert uploads == [], uploads[:5]
    assert _driver_files(cluster) == []   # nothing staged on the driver's disk: receipts and its tokenizer only
    assert cluster.findings(mark) == {}
    # the run's success removed its mirrors from every node and from the driver (issue 44, item 8)
    for where in [cluster.driver_dir] + [cluster.node_dir(n) for n in cluster.names]:
        assert not [n for n in os.listdir(os.path.join(where, "tmp")) if n.startswith("msi-area-")], where

    # repack-sft from the bucket's store on the cluster: the bytes of a local repack of the local store
    proc = cluster.run([sys.executable, REPACK, "--engine", "ray", "--ray-address", cluster.address, "--store",
                        f"s3://{b}/store", "--output-prefix", f"s3://{b}/out2/{NAME}", *REPACK_FLAGS], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    local_repack = os.path.join(data["scratch"], "repack")
    ref = subprocess.run([sys.executable, REPACK, "--store", os.path.join(data["local"], "store"), "--output-prefix",
                          os.path.join(local_repack, NAME), *REPACK_FLAGS], env=dict(os.environ, PYTHONPATH=ROOT),
                         capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = {n: v for n, v in files_of(local_repack).items() if not n.startswith(".")}
    assert len(expected) > 2
    assert_same_as_local(published(client, b, "out2"), expected, data, os.path.join(data["scratch"], "got2"))
    assert cluster.findings(mark) == {}


def test_bucket_only_driver_killed_mid_run_then_resume_redoes_only_the_missing_units(cluster, data):
    b, client = data["bucket"], data["client"]
    mark = cluster.audit_mark()
    cluster.hold("*")
    try:
        proc = cluster.popen(preprocess(cluster, b, "out"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        cluster.wait_held(3, proc=proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        held = cluster.held()
        cluster.release(clear=True)
        assert published(client, b, "out") == {}  # nothing published
        again = cluster.run(preprocess(cluster, b, "out", "--resume"), timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        s = summary(cluster, "out")
        assert s["resumed_units"]["tokenize"] == len({unit for _, unit, _ in held}) >= 3
        assert_same_as_local(published(client, b, "out"), reference(data), data, os.path.join(data["scratch"], "got"))
        assert cluster.findings(mark) == {}
    finally:
        cluster.release(clear=True)


def test_bucket_only_worker_node_killed_mid_run_is_retried_with_identical_bytes(cluster, data):
    b, client = data["bucket"], data["client"]
    mark = cluster.audit_mark()
    cluster.hold("worker2")
    try:
        proc = cluster.popen(preprocess(cluster, b, "out"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        (node, _, pid), = cluster.wait_held(1, proc=proc)
        assert pid in cluster.kill_node("worker2") and proc.poll() is None
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
        assert_same_as_local(published(client, b, "out"), reference(data), data, os.path.join(data["scratch"], "got"))
        assert cluster.findings(mark) == {}
    finally:
        cluster.release(clear=True)
        if "worker2" not in cluster.procs:
            cluster.restart_node("worker2")


def test_two_concurrent_runs_on_one_bucket_store_the_second_refuses_naming_the_first(cluster, data):
    """No local lock file can see another driver: the refusal comes from the bucket (conditional
    writes). The first run is held mid-tokenize while the second starts on the same store."""
    b, client = data["bucket"], data["client"]
    cluster.hold("*")
    try:
        first = cluster.popen(preprocess(cluster, b, "first"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        cluster.wait_held(1, proc=first)
        # --resume: a run that may continue a store is still refused while another holds it
        second = cluster.run(preprocess(cluster, b, "second", "--resume"), timeout=300)
        assert second.returncode == 1, second.stderr[-3000:]
        # named: the store, and the first run's driver (its pid; the host, this machine)
        assert f"s3://{b}/store" in second.stderr and f"pid {first.pid} " in second.stderr, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        assert published(client, b, "second") == {}
        cluster.release()
        code, _, err = finish(first)
        assert code == 0, err[-3000:]
        assert_same_as_local(published(client, b, "first"), reference(data), data,
                             os.path.join(data["scratch"], "got"))
    finally:
        cluster.release(clear=True)


def _driver_files(cluster):
    """Files under the driver's temporary directory that are neither a receipt nor ``store.json``
    in its mirrors of the bucket's areas (``msi-area-*``), nor the tokenizer it resolved itself
    (``megatron_sft_idx-tokenizers``): a partition, a ``.rows``, the plan or a shard there would
    mean data went through the driver's disk."""
    root = os.path.join(cluster.driver_dir, "tmp")
    out = []
    for top in os.listdir(root):
        for d, _, names in os.walk(os.path.join(root, top)):
            for n in names:
                rel = os.path.relpath(os.path.join(d, n), root)
                if top == "megatron_sft_idx-tokenizers":
                    continue
                if top.startswith("msi-area-") and (n.endswith(".json") or os.sep + ".etags" + os.sep in os.sep + rel):
                    continue
                out.append(rel)
    return sorted(out)


def _driver_peak_rss_mib(cluster, cmd, timeout=600):
    peak = os.path.join(cluster.driver_dir, "driver-peak-kib")
    proc = cluster.popen(with_peak(cmd, peak), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the driver did not finish within {timeout} s") from None
    assert proc.returncode == 0, err[-3000:]
    return peak_mib(peak)


def test_the_drivers_memory_stays_flat_in_the_number_of_conversations(cluster, data):
    """The driver holds receipts only: 16x the conversations moves its peak RSS by less than a
    quarter of the extra input it never holds (the tokens alone would be about as large). (For
    scale: in the shared-filesystem setup, 20,000 -> 100,000 conversations moved it by 0.3 MiB,
    bench.ray_cluster.)"""
    b, client = data["bucket"], data["client"]
    local_in = os.path.join(data["local"], "in", "chat.jsonl")
    big = os.path.join(data["scratch"], "big.jsonl")
    with open(big, "w", encoding="utf-8") as f:
        f.write(open(local_in, encoding="utf-8").read() * 16)
    client.upload_file(big, b, "big/chat.jsonl")
    # a few units, the same number in both runs: the test is about data, not task count (the
    # driver keeps a receipt per unit: bench.driver_memory measures that part)
    units = ["--partition-bytes", "4M", "--max-packs-per-shard", "1000000"]
    small_rss = _driver_peak_rss_mib(cluster, preprocess(cluster, b, "small", *units, store="small-store"))
    cmd = preprocess(cluster, b, "big", *units, store="big-store")
    cmd[cmd.index(f"s3://{b}/in/")] = f"s3://{b}/big/"
    big_rss = _driver_peak_rss_mib(cluster, cmd)
    extra_mib = 15 * os.path.getsize(local_in) / 2**20   # the extra input bytes
    assert big_rss - small_rss < extra_mib / 4, (small_rss, big_rss, extra_mib)
