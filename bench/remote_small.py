"""Small work on object storage against the same work on local disk: seconds per stage, requests.

``python -m bench.remote_small [--tokenizer DIR] [--input-mib 1.3] [--repeats 1]``

A user's first try (issue 44, item 3): two JSONL inputs of ``--input-mib`` MiB each (made from
``examples/conversations.jsonl``) and ``--tokenizer``'s files, run by the commands as a user
runs them (fresh processes, ``--json``), twice:

* ``local`` -- inputs, tokenizer and ``--store`` on local disk;
* ``bucket`` -- the same inputs and tokenizer as objects (``s3://.../in/``, ``s3://.../tok/``) and
  ``--store s3://.../store``, on moto's S3 server in a process of its own behind the counting
  proxy (``bench/s3loop.py``; loopback, so what is left is the fixed cost of each request and of
  the client, not the network's);

each as ``preprocess-sft`` then ``repack-sft --verify-masks 16 --balance-for 2,1,4`` of its store
(output on local disk; in ``bucket`` mode once more with the output in the bucket, against the
same local repack).
Reported per command: the stages' seconds (the summary's ``seconds``), the wall time, and the
requests the proxy saw (by method, and by what they touched: inputs, tokenizer, the store's
partitions, receipts, ``store.json``, the lock). Results: ``bench/results/remote_small.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from ._common import RESULTS_DIR, ROOT, format_table, write_json
from .s3loop import LoopProcess

BUCKET = "bench-small"
TOOLS = ROOT / "tools"


def make_inputs(directory: str, mib: float) -> List[str]:
    """Two JSONL files of about ``mib`` MiB each, cut from the example conversations."""
    with open(ROOT / "examples" / "conversations.jsonl", encoding="utf-8") as f:
        lines = f.readlines()
    paths = []
    for k in range(2):
        path = os.path.join(directory, f"part{k}.jsonl")
        size, i = 0, k * 7
        with open(path, "w", encoding="utf-8") as out:
            while size < mib * (1 << 20):
                out.write(lines[i % len(lines)])
                size += len(lines[i % len(lines)].encode())
                i += 1
        paths.append(path)
    return paths


def _kind(key: str) -> str:
    rel = key.split("/", 2)[2] if key.count("/") >= 2 else key
    for prefix, name in (("in/", "inputs"), ("tok/", "tokenizer"), ("store/parts/", "partitions"),
                         ("store/receipts/", "receipts"), ("store/lock", "lock"), ("store/store.json", "store.json")):
        if rel.startswith(prefix):
            return name
    return "listing" if rel in ("", "store/") or rel.startswith("?") else "other"


def run_command(tool: str, argv: List[str], env: dict, loop) -> Dict[str, object]:
    """One command in a fresh process: its summary's seconds, wall time and the requests seen."""
    if loop is not None:
        loop.clear()
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, str(TOOLS / tool), *argv, "--json", "--quiet"], env=env,
                          capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout)
    requests = loop.stats()["requests"] if loop is not None else []
    by_method = collections.Counter(m for m, _, _, _ in requests)
    by_kind = collections.Counter(f"{m} {_kind(k)}" for m, k, _, _ in requests)
    return {"wall_s": wall, "seconds": summary.get("seconds", {}), "requests": len(requests),
            "by_method": dict(by_method), "by_kind": dict(sorted(by_kind.items())),
            "log": [[m, k, r, n] for m, k, r, n in requests]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.remote_small", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=str(ROOT / "examples" / "tokenizer"))
    p.add_argument("--input-mib", type=float, default=1.3)
    p.add_argument("--repeats", type=int, default=1, help="runs of each command (the last is reported)")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench-remote-small-")
    inputs = make_inputs(work, args.input_mib)
    tok_files = [n for n in os.listdir(args.tokenizer) if os.path.isfile(os.path.join(args.tokenizer, n))]
    results: Dict[str, Dict[str, dict]] = {}
    with LoopProcess() as loop:
        client = loop.client()
        client.create_bucket(Bucket=BUCKET)
        for path in inputs:
            client.upload_file(path, BUCKET, "in/" + os.path.basename(path))
        for name in tok_files:
            client.upload_file(os.path.join(args.tokenizer, name), BUCKET, "tok/" + name)
        base_env = dict(os.environ, PYTHONPATH=str(ROOT), **loop.env(),
                        MEGATRON_SFT_IDX_CACHE=os.path.join(work, "cache"))
        for mode in ("local", "bucket"):
            store = os.path.join(work, mode, "store") if mode == "local" else f"s3://{BUCKET}/store"
            ins = inputs if mode == "local" else [f"s3://{BUCKET}/in/{os.path.basename(x)}" for x in inputs]
            tok = args.tokenizer if mode == "local" else f"s3://{BUCKET}/tok/"
            for r in range(args.repeats):
                out = os.path.join(work, mode, f"r{r}")
                pre = run_command("preprocess_sft.py", ["--input", *ins, "--tokenizer", tok, "--store", store,
                                                        "--output-prefix", os.path.join(out, "sft", "ds"),
                                                        "--pack-size", "2048", "--overwrite"],
                                  base_env, loop if mode == "bucket" else None)
                rep = run_command("repack_sft.py", ["--store", store, "--tokenizer", tok,
                                                    "--output-prefix", os.path.join(out, "re", "ds"),
                                                    "--pack-size", "4096", "--verify-masks", "16",
                                                    "--balance-for", "2,1,4", "--overwrite"],
                                  base_env, loop if mode == "bucket" else None)
            results[mode] = {"preprocess-sft": pre, "repack-sft": rep}
            if mode == "bucket":   # (and the output in the bucket too: staged, checked and published there)
                results[mode]["repack-sft to s3"] = run_command(
                    "repack_sft.py", ["--store", store, "--tokenizer", tok, "--output-prefix", f"s3://{BUCKET}/re/ds",
                                      "--pack-size", "4096", "--verify-masks", "16", "--balance-for", "2,1,4",
                                      "--overwrite"], base_env, loop)
    rows = []
    for command in ("preprocess-sft", "repack-sft", "repack-sft to s3"):
        local, bucket = results["local"].get(command, results["local"]["repack-sft"]), results["bucket"][command]
        for stage in sorted(set(local["seconds"]) | set(bucket["seconds"])):
            rows.append([command, stage, local["seconds"].get(stage), bucket["seconds"].get(stage), ""])
        rows.append([command, "(wall)", local["wall_s"], bucket["wall_s"],
                     f"{bucket['requests']}: " + ", ".join(f"{k} {v}" for k, v in bucket["by_kind"].items())])
    print(format_table(["command", "stage", "local s", "bucket s", "bucket requests"], rows))
    path = write_json("remote_small", {"input_mib": args.input_mib, "tokenizer": args.tokenizer,
                                       "tokenizer_bytes": sum(os.path.getsize(os.path.join(args.tokenizer, n))
                                                              for n in tok_files),
                                       "results": results}, args.results_dir)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
