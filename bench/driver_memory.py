"""The driver of a run whose store and work directory are in object storage holds receipts only
(issue 32): its peak RSS and what its mirrors hold, for runs of growing size.

A one-node Ray cluster is started here, its workers with a temporary directory of their own and
the S3 API (moto behind ``bench/s3loop.py``'s proxy) on 127.0.0.1; for each size, the driver
runs ``preprocess-sft --engine ray --store s3://… --output-prefix s3://… --check --verify-masks 16``
in a fresh process (its own temporary directory) joined to that cluster, and reports its peak
RSS (VmHWM), its wall time, and the files and bytes left in its ``msi-area-*`` mirrors at their
largest (sampled after every step). Flat in the number of conversations is the claim; the
figures are in docs/PREPROCESSING.md's section on the store and work directory in object storage.

    python -m bench.driver_memory                                   # 5k and 20k conversations
    python -m bench.driver_memory --conversations 5000 20000 80000 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from bench._common import ROOT, format_table, run_child, write_json
from bench.preprocess import TOKENIZER, make_input


def _mirror(tmp: str) -> dict:
    files, size, names = 0, 0, set()
    for entry in os.listdir(tmp):
        if not entry.startswith("msi-area-"):
            continue
        for directory, _, found in os.walk(os.path.join(tmp, entry)):
            if "/.etags" in directory:
                continue
            for name in found:
                files += 1
                size += os.path.getsize(os.path.join(directory, name))
                names.add(name.rsplit(".", 1)[-1])
    return {"files": files, "bytes": size, "kinds": sorted(names)}


def child_driver(address: str, env: dict, args: list, tmp: str) -> dict:
    """One driver joined to the cluster at ``address``; what its mirrors held at their largest."""
    import logging
    import time

    import ray

    from megatron_sft_idx.preprocess.engines.mirrored import MirroredEngine
    from megatron_sft_idx.preprocess.cli import main

    ray.init(address=address, runtime_env={"env_vars": env}, logging_level=logging.WARNING)
    from bench._common import proc_status

    largest = {"files": 0, "bytes": 0, "kinds": []}
    peaks = {}   # step -> the driver's peak RSS (VmHWM, MB) when it ended
    real = MirroredEngine.map

    def map(self, step, units, on_done, on_progress=None):
        real(self, step, units, on_done, on_progress)
        peaks[step.name] = proc_status().get("VmHWM")
        now = _mirror(tmp)
        if now["bytes"] >= largest["bytes"]:
            largest.update(now, after=step.name)

    MirroredEngine.map = map
    t = time.perf_counter()
    code = main(args)
    return {"exit": code, "wall_s": round(time.perf_counter() - t, 2), "mirror_at_largest": largest,
            "peak_rss_mb_after_step": peaks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, nargs="+", default=[5000, 20000])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-packs-per-shard", type=int, default=500, help="(fewer: more materialize units)")
    parser.add_argument("--inputs-in-bucket", action="store_true", help="the input and the tokenizer as URLs too")
    opts = parser.parse_args()

    import ray

    from bench.s3loop import S3Loop

    root = tempfile.mkdtemp(prefix="bench-driver-")
    rows = []
    try:
        with S3Loop() as loop:
            bucket = loop.make_bucket("bench-driver")
            workers_tmp = os.path.join(root, "workers-tmp")
            os.makedirs(workers_tmp)
            env = dict(loop.env(), PYTHONPATH=str(ROOT), TMPDIR=workers_tmp)
            ray.init(num_cpus=opts.workers, _node_ip_address="127.0.0.1", include_dashboard=False,
                     runtime_env={"env_vars": env})
            address = ray.get_runtime_context().gcs_address
            saved = dict(os.environ)
            try:
                for n in opts.conversations:
                    data = os.path.join(root, f"conv-{n}.jsonl")
                    make_input(data, n)
                    tmp = os.path.join(root, f"driver-tmp-{n}")
                    os.makedirs(tmp)
                    os.environ.update(loop.env(), TMPDIR=tmp)
                    source, tokenizer = data, TOKENIZER
                    if opts.inputs_in_bucket:
                        client = loop.client()
                        client.upload_file(data, bucket, f"in-{n}/conv.jsonl")
                        for name in os.listdir(TOKENIZER):
                            client.upload_file(os.path.join(TOKENIZER, name), bucket, f"tok/{name}")
                        source, tokenizer = f"s3://{bucket}/in-{n}/conv.jsonl", f"s3://{bucket}/tok"
                    args = ["--input", source, "--tokenizer", tokenizer, "--pack-size", "1024",
                            "--max-packs-per-shard", str(opts.max_packs_per_shard), "--engine", "ray", "--ray-address", address,
                            "--store", f"s3://{bucket}/store-{n}", "--output-prefix", f"s3://{bucket}/out-{n}/ds",
                            "--check", "--verify-masks", "16", "--quiet"]
                    result = run_child("bench.driver_memory:child_driver", timeout=1800, address=address, env=env,
                                       args=args, tmp=tmp)
                    result["conversations"] = n
                    rows.append(result)
                    print(json.dumps(result), flush=True)
            finally:
                os.environ.clear()
                os.environ.update(saved)
                ray.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(format_table(["conversations", "driver peak RSS (MB)", "wall (s)", "mirror files at most",
                        "mirror bytes at most", "file kinds"],
                       [[r["conversations"], r["peak_rss_mb"], r["wall_s"], r["mirror_at_largest"]["files"],
                         r["mirror_at_largest"]["bytes"], " ".join(r["mirror_at_largest"]["kinds"])] for r in rows]))
    write_json("driver_memory", {"runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
