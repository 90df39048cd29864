"""``--engine ray`` on a REAL three-node Ray cluster on this machine (tests/support/ray_cluster.py):
a head and two worker nodes, 1 CPU each, each with its own HOME, TMPDIR and Ray session
directory, in a network namespace with only loopback. Today's shared-filesystem mode: inputs,
tokenizer, store and outputs are absolute paths every node sees (this machine's /tmp).

The drivers are ``preprocess-sft`` processes in the namespace with their own HOME/TMPDIR and
working directory (``cluster.driver_dir``): the path audit asserts no task touched any of it.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

pytest.importorskip("ray", reason="the [ray] extra is not installed")

from support.ray_cluster import UNIT_TASK, RayCluster, finish  # noqa: E402
from support.stages import files_of  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "preprocess_sft.py")
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
FLAGS = ["--pack-size", "1024", "--split", "90,10", "--max-packs-per-shard", "20", "--partition-bytes", "60K",
         "--batch-size", "32", "--quiet"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RayCluster(str(tmp_path_factory.mktemp("cluster"))) as c:
        yield c


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """1,600 conversations (the bundled example x4: 20 partitions of 60K) and the bytes of the
    local engine on them (the reference every cluster run is compared with)."""
    d = tmp_path_factory.mktemp("corpus")
    data = open(os.path.join(ROOT, "examples", "conversations.jsonl"), encoding="utf-8").read()
    (d / "in.jsonl").write_text(data * 4)
    proc = subprocess.run(command(d / "local" / "ds", d / "in.jsonl", "--engine", "local", "--workers", "2"),
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d


def command(prefix, inputs, *extra):
    """The tool's command line; its summary goes to ``<prefix's directory>.summary.json`` (not
    stdout: Ray forwards its workers' and raylets' messages to the driver's stdout)."""
    return [sys.executable, TOOL, "--input", str(inputs), "--tokenizer", TOKENIZER, "--output-prefix", str(prefix),
            "--summary-json", summary_path(prefix), *FLAGS, *extra]


def summary_path(prefix):
    return os.path.dirname(str(prefix)) + ".summary.json"


def summary(prefix):
    with open(summary_path(prefix)) as f:
        return json.load(f)


def on_cluster(cluster, prefix, inputs, *extra):
    return command(prefix, inputs, "--engine", "ray", "--ray-address", cluster.address, *extra)


def outputs(directory):
    return {n: b for n, b in files_of(directory).items() if not n.startswith(".")}


def test_the_cluster_is_loopback_only_and_the_audit_catches_a_task_touching_a_driver_path(cluster):
    checked = cluster.verify_loopback()
    assert checked["interfaces"] == ["lo"] and len(checked["listeners"]) >= 3 and checked["processes"] >= 6
    mark = cluster.audit_mark()
    target = os.path.join(cluster.driver_dir, "planted")
    code = ("import os, ray\n"
            "ray.init()\n"
            "@ray.remote(num_cpus=1)\n"
            "def touch(path):\n"
            "    os.makedirs(path, exist_ok=True)\n"
            "    open(os.path.join(path, 'w'), 'w').write('x')\n"
            "    os.rename(os.path.join(path, 'w'), os.path.join(path, 'r'))\n"
            "    open(os.path.join(path, 'r')).read()\n"
            "    os.remove(os.path.join(path, 'r'))\n"
            "    return ray.get_runtime_context().get_node_id()\n"
            f"print(ray.get(touch.remote({target!r})))\n")
    proc = cluster.run([sys.executable, "-c", code], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = cluster.findings(mark)
    assert len(found) == 1, found  # the one node the task ran on
    events = [line.split(" ", 2)[1:] for line in next(iter(found.values()))]
    for event, path in (["os.mkdir", target], ["open", os.path.join(target, "w")],
                        ["os.rename", os.path.join(target, "w")], ["os.rename", os.path.join(target, "r")],
                        ["open", os.path.join(target, "r")], ["os.remove", os.path.join(target, "r")]):
        assert [event, path] in events, (event, path, events)


def test_the_cluster_gives_the_bytes_of_the_local_engine_on_several_nodes_touching_no_driver_path(cluster, corpus,
                                                                                                  tmp_path):
    mark, before = cluster.audit_mark(), cluster.task_nodes(UNIT_TASK)
    prefix = tmp_path / "ray" / "ds"
    proc = cluster.run(on_cluster(cluster, prefix, corpus / "in.jsonl", "--check"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(prefix)
    assert s["engine"] == {"kind": "ray", "address": cluster.address, "started_here": False, "cpus": 3}
    assert s["units"]["tokenize"] == 20
    assert outputs(tmp_path / "ray") == outputs(corpus / "local") and len(outputs(corpus / "local")) > 4
    after = cluster.task_nodes(UNIT_TASK)
    ran = {n: after.get(n, 0) - before.get(n, 0) for n in cluster.names}
    assert sum(ran.values()) >= 20 and len([n for n, k in ran.items() if k]) >= 2, ran
    assert cluster.findings(mark) == {}


def test_a_worker_node_killed_mid_run_is_retried_by_ray_with_identical_bytes(cluster, corpus, tmp_path):
    """The node is killed (SIGKILL of its raylet, agents and workers at once) while one of its
    tokenize units is in flight (held: part and receipt written, receipt not returned); Ray
    retries the unit elsewhere (``max_retries=1``) and the run completes with the local bytes."""
    mark = cluster.audit_mark()
    cluster.hold("worker2")
    prefix = tmp_path / "ray" / "ds"
    try:
        proc = cluster.popen(on_cluster(cluster, prefix, corpus / "in.jsonl"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        (node, unit, pid), = cluster.wait_held(1, proc=proc)
        assert node == "worker2"
        killed = cluster.kill_node("worker2")
        assert pid in killed and proc.poll() is None  # mid-run: the driver is waiting for that unit
        code, out, err = finish(proc)
        assert code == 0, err[-3000:]
        assert outputs(tmp_path / "ray") == outputs(corpus / "local")
        assert summary(prefix)["units"]["tokenize"] == 20
        assert cluster.findings(mark) == {}
    finally:
        cluster.release(clear=True)
        if "worker2" not in cluster.procs:
            cluster.restart_node("worker2")


def test_the_driver_killed_mid_run_then_resume_redoes_only_the_missing_units(cluster, corpus, tmp_path):
    """SIGKILL of the driver while every node holds a finished tokenize unit: Ray ends the job's
    tasks; ``--resume`` (a new driver) reuses the units whose receipts were written and redoes
    only the rest, with the local bytes."""
    mark = cluster.audit_mark()
    cluster.hold("*")
    prefix = tmp_path / "ray" / "ds"
    try:
        proc = cluster.popen(on_cluster(cluster, prefix, corpus / "in.jsonl"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        held = cluster.wait_held(3, proc=proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        held = cluster.held()  # (a unit may have finished between the wait and the kill)
        cluster.release(clear=True)
        assert not outputs(tmp_path / "ray")  # nothing published
        again = cluster.run(on_cluster(cluster, prefix, corpus / "in.jsonl", "--resume"), timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        s = summary(prefix)
        assert s["resumed_units"]["tokenize"] == len({unit for _, unit, _ in held}) >= 3
        assert s["resumed_units"]["index"] == 1
        assert outputs(tmp_path / "ray") == outputs(corpus / "local")
        assert cluster.findings(mark) == {}
    finally:
        cluster.release(clear=True)
