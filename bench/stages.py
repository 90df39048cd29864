"""The staged pipeline end to end at scale: throughput, peak RSS, kill + resume, repack, virtual packs,
and a projection of the wall time for 13M conversations on 1, 8 and 64 nodes.

Conversations come from the bundled example's generator (``bench/preprocess.py``), seeded;
the tokenizer is the bundled one. Every step runs the real CLI in a fresh process:

1. ``preprocess_sft --store S`` (the reference run): wall time by stage, peak RSS of the driver
   and of the largest worker, conversations per second per core;
2. the same command killed (SIGKILL to its process group) at a seeded random moment, then run
   again with ``--resume``: the time lost against the reference, and the outputs compared byte
   for byte with the reference's;
3. ``repack_sft --store S`` to another pack size and CP: its wall time against the reference's
   (what re-tokenizing would cost);
4. ``repack_sft --plan-only``, then random reads of packs from ``VirtualPackedDataset`` and from
   the materialized shards of the same plan: packs per second, ratio;
5. a projection (stated as one, with its inputs) of 13M conversations on 1, 8 and 64 nodes
   from the per-core rates measured in 1.

    python -m bench.stages                                   # 20k conversations, 2 workers
    python -m bench.stages --conversations 1000000 --workers 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench._common import ROOT, format_table, run_child, write_json
from bench.preprocess import TOKENIZER, make_input

TOOLS = ROOT / "tools"


def _cli(tool: str, *args) -> list:
    return [sys.executable, str(TOOLS / tool), *map(str, args)]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_json(cmd: list) -> tuple:
    """Run a CLI with ``--json``; returns (summary, wall seconds)."""
    t = time.perf_counter()
    proc = subprocess.run(cmd + ["--json", "--quiet"], capture_output=True, text=True, env=_env())
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[1]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), wall


def digests(directory: str) -> dict:
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not name.startswith("."):
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            out[name] = h.hexdigest()
    return out


def _commits(work_dir: str, since: float) -> list:
    """Seconds after ``since`` at which each receipt under ``work_dir`` was written (sorted)."""
    out = []
    for directory, _, names in os.walk(work_dir):
        if os.sep + "receipts" in directory:
            out += [os.path.getmtime(os.path.join(directory, n)) - since for n in names if n.endswith(".json")]
    return sorted(t for t in out if t >= 0)


def kill_and_resume(cmd: list, prefix: str, ref_wall: float, seed: int) -> dict:
    """Kill ``cmd`` (SIGKILL to its process group) at a seeded moment in [10%, 90%] of the reference
    wall time, then run it again with ``--resume``.

    Time lost is measured within the killed run, so it does not depend on how busy the machine
    was in other runs: the work since the last receipt before the kill (units in flight, redone),
    plus the resumed run's restart cost (start-up, checking the inputs and receipts).
    """
    at = random.Random(seed).uniform(0.1, 0.9) * ref_wall
    work_dir = os.path.join(os.path.dirname(prefix), f".{os.path.basename(prefix)}.preprocess")
    shutil.rmtree(work_dir, ignore_errors=True)
    start = time.time()
    proc = subprocess.Popen(cmd + ["--quiet"], env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=at)
        finished = True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        finished = False
    killed_after = time.time() - start
    commits = _commits(work_dir, start)
    last_commit = commits[-1] if commits else 0.0
    summary, resume_wall = run_json(cmd + ["--resume"])
    sec = summary["seconds"]
    restart = sum(sec.get(k, 0.0) for k in ("inputs", "index", "verify_store", "verify_shards"))
    return {"kill_at_s": killed_after, "finished_before_kill": finished, "resume_s": resume_wall,
            "units_committed_before_kill": len(commits), "last_commit_s": last_commit,
            "lost_s": killed_after - last_commit + restart, "restart_s": restart,
            "resumed_units": summary["resumed_units"],
            "verify_s": {k: sec.get(k, 0.0) for k in ("index", "verify_store", "verify_plan", "verify_shards")}}


def child_reads(store: str, plan: str, prefix: str, reads: int, seed: int) -> dict:
    """Random reads of whole packs (all three arrays touched): virtual vs materialized."""
    import numpy as np

    from megatron_sft_idx.preprocess.virtual import VirtualPackedDataset
    from megatron_sft_idx.reader import MMapIndexedDataset

    out = {}
    t = time.perf_counter()
    VirtualPackedDataset(store, plan, verify=False)
    out["virtual_open_unverified_s"] = time.perf_counter() - t
    t = time.perf_counter()
    virtual = VirtualPackedDataset(store, plan)   # every partition's checksums, every plan array
    out["virtual_open_verified_s"] = time.perf_counter() - t
    for name, ds in (("materialized", MMapIndexedDataset(prefix)), ("virtual", virtual)):
        idx = np.random.default_rng(seed).integers(0, len(ds), reads)
        total = 0
        ds[0]
        t = time.perf_counter()
        for i in idx:
            p = ds[int(i)]
            total += int(p.input_ids[-1]) + int(p.loss_mask.sum()) + int(p.seq_start_id[-1])
        out[f"{name}_packs_per_s"] = reads / (time.perf_counter() - t)
        out[f"{name}_checksum"] = total
    return out


def plan_rate(ref: dict, n_ref: int) -> tuple:
    """Plan seconds per conversation: from ``bench/results/plan.json`` (the plan stage at millions
    of conversations, where the ~2 s of loading numba's compiled kernels is amortized) when it
    exists, else from the reference run."""
    path = ROOT / "bench" / "results" / "plan.json"
    try:
        runs = [r for r in json.loads(path.read_text())["results"] if r["algorithm"] == "first_fit_decreasing"]
        big = max(runs, key=lambda r: r["n"])
        return big["plan_s"] / big["n"], f"bench/results/plan.json ({big['n']:,} conversations)"
    except (OSError, ValueError, KeyError):
        return ref["seconds"]["plan"] / n_ref, "the reference run"


def project(ref: dict, n_ref: int, workers: int, target: int, cores_per_node: int) -> dict:
    """Wall time for ``target`` conversations on 1, 8, 64 nodes from the measured per-core rates.

    Inputs (scaled linearly): tokenize conversations/s per core and materialize packs/s per core
    (from the reference run; materialize ran on as many cores as it had output shards), plan seconds per conversation (one process, see :func:`plan_rate`),
    index core-seconds per conversation (one process per input file; inputs split into enough
    files or partitions to keep every core busy).
    """
    sec = ref["seconds"]
    tok_core = n_ref / (sec["tokenize"] * workers)
    packs_per_conv = ref["packs"] / n_ref
    mat_units = min(workers, len(ref["outputs"]))  # materialize runs one unit per output shard
    mat_core = ref["packs"] / (sec["materialize"] * mat_units)
    plan_per_conv, plan_source = plan_rate(ref, n_ref)
    index_per_conv_core = sec["index"] * workers / n_ref  # hashing + cutting, parallel over files
    rows = {}
    for nodes in (1, 8, 64):
        cores = nodes * cores_per_node
        parts = {"index": target * index_per_conv_core / cores, "tokenize": target / (tok_core * cores),
                 "plan": target * plan_per_conv, "materialize": target * packs_per_conv / (mat_core * cores)}
        parts["total"] = sum(parts.values())
        rows[nodes] = parts
    return {"inputs": {"tokenize_conv_per_s_per_core": tok_core, "materialize_packs_per_s_per_core": mat_core,
                       "plan_s_per_million_conv": plan_per_conv * 1e6, "index_core_s_per_million_conv":
                       index_per_conv_core * 1e6, "packs_per_conversation": packs_per_conv,
                       "plan_rate_from": plan_source,
                       "cores_per_node": cores_per_node, "target_conversations": target,
                       "measured_on": f"{n_ref} conversations, {workers} workers"},
            "projected_s": rows}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=20000, help="conversations (default: 20000)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default: 2)")
    p.add_argument("--pack-size", type=int, default=4096, help="pack size of the reference run (default: 4096)")
    p.add_argument("--partition-bytes", default="16M", help="--partition-bytes of the runs (default: 16M)")
    p.add_argument("--seed", type=int, default=1, help="seed of the kill moment and the reads (default: 1)")
    p.add_argument("--reads", type=int, default=3000, help="random pack reads per reader (default: 3000)")
    p.add_argument("--cores-per-node", type=int, default=64, help="cores per node in the projection (default: 64)")
    p.add_argument("--target", type=int, default=13_000_000, help="conversations to project for (default: 13M)")
    p.add_argument("--work-dir", help="keep everything here (default: a temporary directory)")
    p.add_argument("--kill-only", metavar="JSON",
                   help="measure only the kill and resume again, reusing the reference run (in --work-dir) "
                        "and every other figure of this earlier results file")
    return p


def kill_only(args, work: str) -> int:
    prev = json.load(open(args.kill_only))
    common = _common(args, os.path.join(work, "in.jsonl"))
    kill_prefix = os.path.join(work, "kill", "ds")
    killed = kill_and_resume(_cli("preprocess_sft.py", *common, "--output-prefix", kill_prefix, "--overwrite"),
                             kill_prefix, prev["reference_wall_s"], args.seed)
    killed["identical_to_reference"] = digests(os.path.join(work, "kill")) == digests(os.path.join(work, "ref"))
    prev["kill_resume"] = killed
    prev["params"]["kill_only"] = args.kill_only
    report(args, prev["reference"], prev["reference_wall_s"], killed, prev["repack_wall_s"], prev["plan_only_wall_s"],
           prev["reads"], prev["projection"])
    payload = {k: v for k, v in prev.items() if k not in ("benchmark", "command", "timestamp", "machine")}
    print("wrote", write_json("stages", payload))
    return 0


def _common(args, data: str) -> list:
    return ["--input", data, "--tokenizer", TOKENIZER, "--pack-size", args.pack_size, "--workers", args.workers,
            "--partition-bytes", args.partition_bytes, "--max-shard-bytes", 1 << 30]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.kill_only:
        if not args.work_dir:
            raise SystemExit("--kill-only needs the --work-dir of the earlier run")
        return kill_only(args, args.work_dir)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-stages-")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "in.jsonl")
    try:
        if not os.path.exists(data):
            make_input(data, args.conversations)
        common = _common(args, data)
        store = os.path.join(work, "store")
        shutil.rmtree(store, ignore_errors=True)
        ref_cmd = _cli("preprocess_sft.py", *common, "--output-prefix", os.path.join(work, "ref", "ds"), "--store",
                       store, "--overwrite")
        ref, ref_wall = run_json(ref_cmd)
        noop, noop_wall = run_json(ref_cmd + ["--resume"])   # a finished run: its outputs and inputs verified
        assert noop["resumed_units"] == {"done": 1}, noop["resumed_units"]
        kill_prefix = os.path.join(work, "kill", "ds")
        killed = kill_and_resume(_cli("preprocess_sft.py", *common, "--output-prefix", kill_prefix, "--overwrite"),
                                 kill_prefix, ref_wall, args.seed)
        killed["identical_to_reference"] = digests(os.path.join(work, "kill")) == digests(os.path.join(work, "ref"))
        repack_args = ["--store", store, "--pack-size", 2 * args.pack_size, "--cp", 2, "--workers", args.workers]
        repacked, repack_wall = run_json(_cli("repack_sft.py", *repack_args, "--output-prefix",
                                              os.path.join(work, "rp", "ds"), "--overwrite"))
        plan = os.path.join(work, "v.plan")
        _, plan_wall = run_json(_cli("repack_sft.py", *repack_args, "--plan-only", plan))
        reads = run_child("bench.stages:child_reads", store=store, plan=plan, prefix=repacked["outputs"][0],
                          reads=args.reads, seed=args.seed)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    proj = project(ref, ref["conversations"], args.workers, args.target, args.cores_per_node)
    verification = {"finished_run_resume_wall_s": noop_wall, "repack_verify_store_s": repacked["seconds"]["verify_store"],
                    "resume_after_kill": killed["verify_s"], "store_bytes": _tree_bytes(store),
                    "input_bytes": os.path.getsize(data), "output_bytes": _tree_bytes(os.path.join(work, "ref"))}
    report(args, ref, ref_wall, killed, repack_wall, plan_wall, reads, proj, verification)
    payload = {"params": vars(args), "reference": ref, "reference_wall_s": ref_wall, "kill_resume": killed,
               "repack_wall_s": repack_wall, "repack": {k: repacked[k] for k in ("packs", "pack_size", "seconds")},
               "plan_only_wall_s": plan_wall, "reads": reads, "projection": proj, "verification": verification}
    print("wrote", write_json("stages", payload))
    return 0


def _tree_bytes(directory: str) -> int:
    """Bytes of the regular files under ``directory`` (hidden ones included)."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(directory) for n in names)


def report(args, ref, ref_wall, killed, repack_wall, plan_wall, reads, proj, verification=None) -> None:
    rss = ref["peak_rss_mib"]
    print(format_table(["stage", "seconds"], [[k, v] for k, v in ref["seconds"].items()] + [["wall", ref_wall]]))
    print(f"conversations {ref['conversations']:,}, packs {ref['packs']:,}; peak RSS driver {rss['main']:.0f} MiB, "
          f"largest worker {rss['workers_max']:.0f} MiB")
    print(f"kill at {killed['kill_at_s']:.1f}s ({killed['units_committed_before_kill']} units committed, the last at "
          f"{killed['last_commit_s']:.1f}s); resume {killed['resume_s']:.1f}s; lost {killed['lost_s']:.1f}s "
          f"(in-flight work {killed['kill_at_s'] - killed['last_commit_s']:.1f}s + restart {killed['restart_s']:.1f}s; "
          f"{killed['lost_s'] / ref_wall:.1%} of a run); resumed units {killed['resumed_units']}; "
          f"identical bytes: {killed['identical_to_reference']}")
    print(f"repack (pack {2 * args.pack_size}, cp 2): {repack_wall:.1f}s = {repack_wall / ref_wall:.3f}x the "
          f"tokenizing run; --plan-only {plan_wall:.1f}s = {plan_wall / ref_wall:.3f}x")
    print(f"random pack reads: virtual {reads['virtual_packs_per_s']:.0f}/s, materialized "
          f"{reads['materialized_packs_per_s']:.0f}/s (virtual/materialized "
          f"{reads['virtual_packs_per_s'] / reads['materialized_packs_per_s']:.3f}x)")
    if verification:
        v = verification
        print(f"verification: --resume of the finished run {v['finished_run_resume_wall_s']:.1f}s (outputs "
              f"{v['output_bytes'] / 1e6:.0f} MB by CRC-32, inputs {v['input_bytes'] / 1e6:.0f} MB by sha256); "
              f"repack verifies the store ({v['store_bytes'] / 1e6:.0f} MB) in {v['repack_verify_store_s']:.2f}s; "
              f"resume after the kill: {json.dumps({k: round(x, 2) for k, x in v['resume_after_kill'].items()})}; "
              f"VirtualPackedDataset opens in {reads['virtual_open_verified_s']:.2f}s verified, "
              f"{reads['virtual_open_unverified_s']:.2f}s not")
    rows = [[n, p["index"], p["tokenize"], p["plan"], p["materialize"], p["total"]]
            for n, p in proj["projected_s"].items()]
    print(f"PROJECTION for {args.target:,} conversations ({args.cores_per_node} cores/node), from "
          f"{json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in proj['inputs'].items()})}")
    print(format_table(["nodes", "index s", "tokenize s", "plan s", "materialize s", "total s"], rows))


if __name__ == "__main__":
    raise SystemExit(main())
