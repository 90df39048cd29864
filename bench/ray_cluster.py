"""``preprocess-sft --engine ray`` on a real multi-node Ray cluster on this machine against the
local engine on the same data: a ratio, the bytes each node reads and writes per million
conversations, the driver's peak memory, and a projection (stated as one, with its model) for
8 and 64 nodes.

The cluster is the tests' (``tests/support/ray_cluster.py``): a head and ``--nodes - 1`` worker
nodes, 1 CPU each, each with its own HOME, TMPDIR and Ray session directory, in a network
namespace with only loopback (needs root or CAP_SYS_ADMIN for ``unshare --net``). The driver
is the ``preprocess-sft`` command in that namespace with its own HOME and TMPDIR.

Two setups:

* shared filesystem (default): inputs, tokenizer, store and outputs are absolute paths of this
  machine every node sees. Bytes per node: the ``rchar``/``wchar`` (every read/write call:
  files, pipes, sockets) and ``write_bytes`` (what reached the filesystem) of all the node's
  processes, sampled from /proc every 0.1 s during the run (a process's last 0.1 s may be missed;
  ``rchar`` includes what each worker reads to start: Python, Ray, the package, the tokenizer --
  a fixed cost per worker, not per conversation).
* ``--bucket``: inputs, tokenizer, store and outputs in a bucket of moto's S3 server on the
  host's 127.0.0.1 (``bench/s3loop.py``), reached from each node through its own counting bridge
  (the namespace has no other way out): the S3 bytes each node read and wrote, exactly.
  The command is the issue-32 contract (``--input s3://B/in/ --tokenizer s3://B/tok/ --store
  s3://B/store --output-prefix s3://B/out/NAME``).

The cluster command runs twice: "cold" (the nodes' first job: every worker starts and imports)
and "warm" (the same work again into a fresh store and output): the figures are the warm run's,
the cold run is reported beside them.

Outputs: in the shared-filesystem setup every file is compared byte for byte; in the bucket
setup the shards' data files (``DATA_FILES``) and the file names, since the ``.seq.idx`` metadata
and the manifests record the inputs' names (URLs there).

The local engine runs the same command with local paths (``--engine local --workers`` = the
cluster's CPUs). Both on the same 2-core machine: the cluster's 3 CPUs are 3 processes on 2
cores, so the ratio measures Ray's overhead here, not a speed-up.

    python -m bench.ray_cluster                          # 20k conversations, 3 nodes
    python -m bench.ray_cluster --conversations 100000 --bucket
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from bench._common import ROOT, format_table, write_json
from bench.preprocess import TOKENIZER, make_input

sys.path.insert(0, str(ROOT / "tests"))  # the cluster harness lives with the tests that use it
from support.ray_cluster import RayCluster, peak_mib, with_peak  # noqa: E402

TOOL = str(ROOT / "tools" / "preprocess_sft.py")


def _flags(args) -> list:
    return ["--pack-size", str(args.pack_size), "--partition-bytes", args.partition_bytes, "--quiet"]


def _wait(proc: subprocess.Popen, timeout: float, peak: str) -> tuple:
    """(exit status, wall s, peak RSS MiB) of a child started by ``with_peak(cmd, peak)`` (its own
    ru_maxrss would be this benchmark's size when it forked), with a deadline."""
    t, end = time.perf_counter(), time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return proc.returncode, time.perf_counter() - t, peak_mib(peak) if proc.returncode == 0 else None
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"{proc.args[:4]} did not finish within {timeout:.0f} s")


def _proc_io(pid: int):
    try:
        with open(f"/proc/{pid}/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f)}
    except (OSError, ValueError):
        return None


class IoSampler:
    """Per node: the growth of rchar, wchar, write_bytes of its processes while running."""

    def __init__(self, cluster: RayCluster) -> None:
        self.cluster, self.first, self.last = cluster, {}, {}
        self._stop = threading.Event()
        self._sample(baseline=True)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self, baseline=False) -> None:
        for name in self.cluster.names:
            for pid in self.cluster.processes(name):
                io = _proc_io(pid)
                if io is None:
                    continue
                key = (name, pid)
                if key not in self.first:
                    self.first[key] = io if baseline else {k: 0 for k in io}
                self.last[key] = io

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._sample()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        self._sample()
        out = {n: {"rchar": 0, "wchar": 0, "write_bytes": 0} for n in self.cluster.names}
        for (name, pid), last in self.last.items():
            for k in out[name]:
                out[name][k] += last.get(k, 0) - self.first[(name, pid)].get(k, 0)
        return out


#: The plan stage's rate at scale when bench/results/plan.json is absent: ``python -m bench.plan`` at
#: 13M conversations, docs/BENCHMARKS.md (one process, 5.5 s for 13M).
PLAN_S_PER_MILLION, PLAN_SOURCE = 0.42, "docs/BENCHMARKS.md: bench.plan at 13M conversations, 0.42 s per million"
#: The shards' data files: byte-identical to the local engine's in both setups. The ``.seq.idx``
#: metadata and the manifests record the inputs' names (URLs in the bucket setup) and the set id
#: that digests them, so in the bucket setup only the data files are compared.
DATA_FILES = (".bin", ".idx", ".loss.bin", ".seq.bin")


def _data_files(files: dict) -> dict:
    return {n: b for n, b in files.items() if n.endswith(DATA_FILES) and not n.endswith(".seq.idx")}


def _digest(files: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def _local_files(directory: str) -> dict:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if os.path.isfile(os.path.join(directory, n)) and not n.startswith(".")}


def run_local(args, work: str, inp: str, tokenizer: str, cpus: int) -> dict:
    out = os.path.join(work, "local")
    cmd = [sys.executable, TOOL, "--input", inp, "--tokenizer", tokenizer, "--output-prefix", os.path.join(out, "ds"),
           "--store", os.path.join(work, "local-store"), "--engine", "local", "--workers", str(cpus), *_flags(args)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(with_peak(cmd, os.path.join(work, "local.peak")), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    code, wall, peak = _wait(proc, args.timeout, os.path.join(work, "local.peak"))
    if code != 0:
        raise RuntimeError(f"the local run failed (exit {code}): {proc.stderr.read()[-3000:]}")
    files = _local_files(out)
    return {"command": " ".join(cmd[1:]), "wall_s": wall, "peak_rss_mib_with_workers": peak, "files": len(files),
            "digest": _digest(files), "data_digest": _digest(_data_files(files)), "names": sorted(files)}


def run_cluster(args, cluster: RayCluster, cmd: list, summary_path: str) -> dict:
    sampler = IoSampler(cluster)
    peak_file = summary_path + ".peak"
    proc = cluster.popen(with_peak(cmd, peak_file), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    code, wall, peak = _wait(proc, args.timeout, peak_file)
    io = sampler.stop()
    err = proc.stderr.read()
    result = {"command": " ".join(cmd[1:]), "exit": code, "wall_s": wall, "driver_peak_rss_mib": peak,
              "io_by_node": io, "s3_by_node": cluster.s3_bytes()}
    if code != 0:
        result["error"] = err[-2000:]
    elif os.path.exists(summary_path):
        from megatron_sft_idx.jsondoc import load_json

        s = load_json(summary_path)
        result.update(seconds=s.get("seconds"), units=s.get("units"), packs=s.get("packs"),
                      engine=s.get("engine"))
    return result


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def per_million(value: float, n: int) -> float:
    return value * 1e6 / n


def project(cluster_run: dict, n: int, cpus: int, cores_per_node: int, target: int, node_bandwidth: float,
            bytes_per_million: float, bytes_from: str) -> dict:
    """Projection (a model, not a measurement) of one run of ``target`` conversations on 8 and 64
    nodes of ``cores_per_node`` cores, from the warm cluster run measured here: tokenize and
    materialize take their measured CPU-seconds per conversation (Ray's per-task overhead
    included) spread over all cores (the inputs cut into, and the output split into, enough
    units to keep them busy); index is one task per input file, its measured time kept
    as is (the inputs split into at least as many files as cores); the plan is one process on
    the driver at the rate of bench.stages's plan_rate; and each node moves its share of the
    cluster's data bytes per million conversations (``bytes_from``) at ``node_bandwidth``
    bytes/s, overlapped with nothing (an upper bound). Worker start-up (imports, the tokenizer)
    is in the measured times."""
    from bench.stages import plan_rate

    sec = cluster_run["seconds"]
    plan_per_conv, plan_source = plan_rate({"seconds": sec}, n)
    if plan_source == "the reference run":   # no bench/results/plan.json: a small run's plan is its fixed cost
        plan_per_conv, plan_source = PLAN_S_PER_MILLION / 1e6, PLAN_SOURCE
    rows = {}
    for nodes in (8, 64):
        cores = nodes * cores_per_node
        parts = {k: sec.get(k, 0.0) * cpus / cores * target / n for k in ("tokenize", "materialize")}
        parts["index"] = sec.get("index", 0.0)
        parts["plan"] = plan_per_conv * target
        parts["transfer"] = bytes_per_million * (target / 1e6) / nodes / node_bandwidth
        parts["total"] = sum(parts.values())
        rows[str(nodes)] = parts
    return {"model": " ".join(project.__doc__.split()), "target_conversations": target,
            "cores_per_node": cores_per_node, "node_bandwidth_bytes_per_s": node_bandwidth,
            "plan_rate_from": plan_source, "bytes_per_million": bytes_per_million, "bytes_from": bytes_from,
            "measured_on": f"{n} conversations, {cpus} nodes of 1 CPU on one machine", "projected_s": rows}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=20000, help="conversations (default: 20000)")
    p.add_argument("--nodes", type=int, default=3, help="nodes of the cluster, head included (default: 3)")
    p.add_argument("--pack-size", type=int, default=4096, help="pack size (default: 4096)")
    p.add_argument("--partition-bytes", default="1M", help="--partition-bytes (default: 1M)")
    p.add_argument("--bucket", action="store_true", help="inputs, tokenizer, store and outputs in a bucket")
    p.add_argument("--cores-per-node", type=int, default=64, help="cores per node in the projection (default: 64)")
    p.add_argument("--target", type=int, default=13_000_000, help="conversations to project for (default: 13M)")
    p.add_argument("--node-bandwidth", type=float, default=1e9,
                   help="bytes/s per node to and from storage in the projection (default: 1e9)")
    p.add_argument("--timeout", type=float, default=3600.0, help="deadline of each run in seconds (default: 3600)")
    p.add_argument("--work-dir", help="keep everything here (default: a temporary directory, removed)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    work = os.path.abspath(args.work_dir) if args.work_dir else tempfile.mkdtemp(prefix="bench-ray-cluster-")
    os.makedirs(work, exist_ok=True)
    try:
        return _main(args, work)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def _main(args, work: str) -> int:
    n = args.conversations
    inp = os.path.join(work, "in.jsonl")
    if not os.path.exists(inp):
        make_input(inp, n)
    cpus = args.nodes
    local = run_local(args, work, inp, str(TOKENIZER), cpus)
    loop = None
    if args.bucket:
        from bench.s3loop import LoopProcess

        loop = LoopProcess().__enter__()
    try:
        env = loop.env() if loop else None
        with RayCluster(os.path.join(work, "cluster"), workers=args.nodes - 1, env=env) as cluster:
            summary_path = os.path.join(cluster.driver_dir, "summary.json")
            if loop:
                bucket = loop.make_bucket("bench-ray-cluster")
                client = loop.client()
                client.upload_file(inp, bucket, "in/in.jsonl")
                for name in os.listdir(TOKENIZER):
                    client.upload_file(os.path.join(TOKENIZER, name), bucket, f"tok/{name}")
            loopback = cluster.verify_loopback()
            runs = []
            for attempt in ("cold", "warm"):
                if loop:
                    cmd = [sys.executable, TOOL, "--input", f"s3://{bucket}/in/", "--tokenizer", f"s3://{bucket}/tok/",
                           "--store", f"s3://{bucket}/{attempt}/store", "--output-prefix",
                           f"s3://{bucket}/{attempt}/out/ds"]
                else:
                    shared = os.path.join(work, "shared", attempt)
                    cmd = [sys.executable, TOOL, "--input", inp, "--tokenizer", str(TOKENIZER), "--store",
                           os.path.join(shared, "store"), "--output-prefix", os.path.join(shared, "out", "ds")]
                cmd += ["--engine", "ray", "--ray-address", cluster.address, "--summary-json", summary_path,
                        *_flags(args)]
                for bridge in cluster.bridges.values():
                    bridge.reset()
                before = cluster.task_nodes("_ray_unit")
                ran = run_cluster(args, cluster, cmd, summary_path)
                ran["attempt"] = attempt
                after = cluster.task_nodes("_ray_unit")
                ran["task_runs_by_node"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
                ran["path_audit"] = cluster.findings()
                if ran["exit"] == 0:
                    if loop:
                        files, prefix = {}, f"{attempt}/out/"
                        listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
                        for obj in listed:
                            name = obj["Key"][len(prefix):]
                            if "/" not in name and not name.startswith("."):
                                files[name] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
                    else:
                        files = _local_files(os.path.join(shared, "out"))
                    ran["identical_to_local"] = _digest(files) == local["digest"]
                    ran["data_files_identical_to_local"] = (_digest(_data_files(files)) == local["data_digest"]
                                                            and sorted(files) == local["names"])
                runs.append(ran)
                if ran["exit"] != 0:
                    break
    finally:
        if loop:
            loop.__exit__(None, None, None)
    payload = {"mode": "bucket" if args.bucket else "shared filesystem", "conversations": n, "nodes": args.nodes,
               "local": local, "cluster": ran, "cluster_cold": runs[0],
               "loopback": {"interfaces": loopback["interfaces"], "listeners": len(loopback["listeners"])}}
    if ran["exit"] == 0:
        payload["ratio_cluster_over_local_wall"] = ran["wall_s"] / local["wall_s"]
        if args.bucket:
            nodes_only = {k: v for k, v in ran["s3_by_node"].items() if k != "driver"}
            moved = sum(v["read"] + v["written"] for v in nodes_only.values())
            bytes_from = "the S3 bytes the nodes read and wrote in the warm run (the bridges' counts)"
            payload["per_million_conversations_by_node"] = {
                k: {"s3_read": per_million(v["read"], n), "s3_written": per_million(v["written"], n)}
                for k, v in ran["s3_by_node"].items()}
        else:
            sizes = {"input": _size(inp), "store": _size(os.path.join(work, "local-store")),
                     "outputs": _size(os.path.join(work, "local"))}
            moved = sizes["input"] + 2 * sizes["store"] + sizes["outputs"]
            bytes_from = ("the data volume: the input read, the store written and read back, the shards written "
                          f"({sizes})")
            payload["per_million_conversations_by_node"] = {
                k: {key: per_million(value, n) for key, value in v.items()} for k, v in ran["io_by_node"].items()}
        payload["projection"] = project(ran, n, args.nodes, args.cores_per_node, args.target, args.node_bandwidth,
                                        per_million(moved, n), bytes_from)
    print("wrote", write_json("ray_cluster", payload))
    _print(payload)
    same = ran.get("data_files_identical_to_local") if args.bucket else ran.get("identical_to_local")
    return 0 if ran["exit"] == 0 and same else 1


def _print(payload: dict) -> None:
    local, ran = payload["local"], payload["cluster"]
    print(f"{payload['mode']}: {payload['conversations']:,} conversations, {payload['nodes']} nodes of 1 CPU")
    print(f"local engine {local['wall_s']:.1f} s; cluster {ran['wall_s']:.1f} s (exit {ran['exit']}), "
          f"driver peak RSS {ran['driver_peak_rss_mib']:.0f} MiB, identical: {ran.get('identical_to_local')}, "
          f"data files identical: {ran.get('data_files_identical_to_local')}")
    if "error" in ran:
        print(ran["error"])
        return
    per_node = payload["per_million_conversations_by_node"]
    rows = [(k, *(f"{x / 1e6:.1f}" for x in v.values())) for k, v in per_node.items()]
    first = next(iter(payload["per_million_conversations_by_node"].values()))
    print(format_table(["node", *(f"{k} MB/M conv" for k in first)], rows))
    proj = payload["projection"]["projected_s"]
    print("projection (a model, not a measurement): "
          + ", ".join(f"{k} nodes {v['total']:.1f} s" for k, v in proj.items()))
    print("peak RSS of this benchmark process: %.0f MiB" % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


if __name__ == "__main__":
    sys.exit(main())
