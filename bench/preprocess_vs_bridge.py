"""The main job against Megatron-Bridge 0.6.2's offline chat packing, same inputs, same tokenizer.

Bridge runs its own code: ``megatron.bridge.data.packing.offline.prepare_gpt_sft_packed_data``
with its dataset builder (``build_gpt_sft_split``), its HF tokenizer wrapper and its chat path
(``chat=True, use_hf_tokenizer_chat_template=True``: the template's ``{% generation %}``
assistant mask), first-fit-decreasing into packed Parquet. Ours runs ``pipeline.run`` on the
same JSONL with the same tokenizer directory and pack size. Each run is a fresh interpreter;
throughput is tokens each system wrote per wall second and per CPU-second (process plus its
workers), peak RSS the largest of the process and its workers.

Bridge is not in the system environment: ``make install-compat`` installs it (with
megatron-core 0.19.2) into ``.deps/megatron-bridge-0.6.2`` (``--bridge-deps`` points elsewhere),
and the test suite's ``tests/compat/megatron_cpu.py`` makes it importable on a CPU-only
Python 3.11; nothing else is changed, the packing code runs unmodified.

    python -m bench.preprocess_vs_bridge --count 3000
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

from bench._common import ROOT, format_table, ratio, run_child, write_json

DEPS = os.path.join(str(ROOT), ".deps", "megatron-bridge-0.6.2")


def _import_bridge(deps: str) -> None:
    """Put the ``make install-compat`` stack first on sys.path and apply the test suite's CPU
    import measures (``tests/compat/megatron_cpu.py``, the one place they live)."""
    sys.path.insert(0, deps)
    sys.path.insert(0, os.path.join(str(ROOT), "tests", "compat"))
    import megatron_cpu  # noqa: F401  (applies its measures on import)
    import megatron.core

    if not os.path.realpath(megatron.core.__file__).startswith(os.path.realpath(deps)):
        raise RuntimeError(f"megatron.core came from {megatron.core.__file__}, not {deps}")


def _usage() -> dict:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"cpu": own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime,
            "peak_mb": max(own.ru_maxrss, kids.ru_maxrss) / 1024}


def child_bridge(path: str, tokenizer: str, workers: int, pack_size: int, out: str, deps: str) -> dict:
    _import_bridge(deps)
    import logging
    from pathlib import Path

    import pyarrow.parquet as pq

    logging.disable(logging.INFO)
    from megatron.bridge import package_info
    from megatron.bridge.data.builders.gpt_sft import build_gpt_sft_split
    from megatron.bridge.data.packing.offline import prepare_gpt_sft_packed_data
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    u0, t = _usage(), time.perf_counter()
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer))
    prepare_gpt_sft_packed_data(
        input_path=Path(path), output_path=Path(out + ".parquet"), output_metadata_path=Path(out + ".meta.json"),
        packed_sequence_size=pack_size, tokenizer=tok, max_seq_length=pack_size, seed=0,
        packing_algorithm="first_fit_decreasing", dataset_kwargs={"chat": True, "use_hf_tokenizer_chat_template": True},
        pad_seq_to_mult=1, num_tokenizer_workers=workers, dataset_builder=build_gpt_sft_split)
    wall = time.perf_counter() - t
    u1 = _usage()
    table = pq.read_table(out + ".parquet", columns=["input_ids"])
    tokens = int(sum(len(x) for x in table.column("input_ids").to_pylist()))
    return {"version": package_info.__version__, "wall_s": wall, "cpu_s": u1["cpu"] - u0["cpu"], "tokens": tokens,
            "packs": table.num_rows, "peak_mb": u1["peak_mb"]}


def child_ours(path: str, tokenizer: str, workers: int, pack_size: int, out: str) -> dict:
    """``preprocess-sft`` as its console script runs it (``_console.preprocess_sft`` with this
    command line), in this process so that its RSS is the one measured."""
    import json

    from megatron_sft_idx import _console

    summary = out + ".summary.json"
    sys.argv = ["preprocess-sft", "--input", path, "--output-prefix", out, "--tokenizer", tokenizer,
                "--pack-size", str(pack_size), "--workers", str(workers), "--packing-algorithm", "first_fit_decreasing",
                "--overlong", "drop", "--overwrite", "--quiet", "--summary-json", summary]
    u0, t = _usage(), time.perf_counter()
    status = _console.preprocess_sft()
    wall = time.perf_counter() - t
    u1 = _usage()
    if status != 0:
        raise RuntimeError(f"preprocess-sft exited {status}")
    with open(summary, encoding="utf-8") as f:
        s = json.load(f)
    return {"wall_s": wall, "cpu_s": u1["cpu"] - u0["cpu"], "tokens": s["tokens"], "packs": s["packs"],
            "peak_mb": u1["peak_mb"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=3000, help="conversations (default: 3000)")
    p.add_argument("--pack-size", type=int, default=4096, help="pack size (default: 4096)")
    p.add_argument("--bridge-deps", default=DEPS, help=f"Bridge --target install (default: {DEPS})")
    p.add_argument("--workers", default="1,2", help="worker counts to run (default: 1,2)")
    p.add_argument("--bridge-workers", default="1", help="Bridge worker counts (default: 1; 2 is slow)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isdir(os.path.join(args.bridge_deps, "megatron", "bridge")):
        print(f"Megatron-Bridge is not installed under {args.bridge_deps}; see --help", file=sys.stderr)
        return 2
    from bench.chat_corpus import corpus_stats, production_tokenizer, write_corpus

    results = {"count": args.count, "pack_size": args.pack_size, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_corpus(os.path.join(tmp, "chat.jsonl"), args.count)
        tok, desc = production_tokenizer(os.path.join(tmp, "tokenizer"))
        results["corpus"] = dict(corpus_stats(data), tokenizer=desc)
        warm = os.path.join(tmp, "warm.jsonl")
        with open(data, "rb") as src, open(warm, "wb") as dst:
            dst.writelines(line for line, _ in zip(src, range(200)))
        run_child("bench.preprocess_vs_bridge:child_ours", path=warm, tokenizer=tok, workers=1,
                  pack_size=args.pack_size, out=os.path.join(tmp, "warm"))  # numba cache, not measured
        for w in [int(x) for x in args.workers.split(",")]:
            results["runs"][f"ours_{w}"] = run_child("bench.preprocess_vs_bridge:child_ours", path=data, tokenizer=tok,
                                                     workers=w, pack_size=args.pack_size,
                                                     out=os.path.join(tmp, f"ours{w}"))
        for w in [int(x) for x in args.bridge_workers.split(",")]:
            results["runs"][f"bridge_{w}"] = run_child("bench.preprocess_vs_bridge:child_bridge", path=data,
                                                       tokenizer=tok, workers=w, pack_size=args.pack_size,
                                                       out=os.path.join(tmp, f"bridge{w}"), deps=args.bridge_deps)
    runs = results["runs"]
    for r in runs.values():
        r["tokens_per_s"] = r["tokens"] / r["wall_s"]
        r["tokens_per_cpu_s"] = r["tokens"] / r["cpu_s"]
        r["peak_mb"] = max(r["peak_mb"], r.get("peak_rss_mb") or 0)
    b1, o1 = runs.get("bridge_1"), runs.get("ours_1")
    if b1 and o1:
        results["ours_vs_bridge_1_worker"] = {
            "tokens_per_s": ratio(o1["tokens_per_s"], b1["tokens_per_s"]),
            "tokens_per_cpu_s": ratio(o1["tokens_per_cpu_s"], b1["tokens_per_cpu_s"]),
            "peak_rss": ratio(o1["peak_mb"], b1["peak_mb"])}
    if "ours_2" in runs and o1:
        results["ours_2_workers_scaling"] = ratio(runs["ours_2"]["tokens_per_s"], o1["tokens_per_s"])
    rows = [[name, r["tokens"], r["packs"], r["wall_s"], r["tokens_per_s"], r["tokens_per_cpu_s"], r["peak_mb"]]
            for name, r in runs.items()]
    print(format_table(["run", "tokens", "packs", "wall s", "tokens/s", "tokens/CPU-s", "peak RSS MiB"], rows))
    for key in ("ours_vs_bridge_1_worker", "ours_2_workers_scaling"):
        print(key, results.get(key))
    print("wrote", write_json("preprocess_vs_bridge", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
