"""Preprocessing: tokenization throughput (1 and 2 workers) and peak RSS vs the legacy all-in-RAM path.

The legacy peer does what ``prepare_gpt_sft_packed_data.py``-style scripts do:
every tokenized conversation as Python lists in RAM, pack, every pack as a
dict of lists in RAM, then one pickled ``.npy``. Both sides run in fresh child
processes on the same generated conversations (the bundled example's
generator, seeded). Peak RSS of ours is the larger of the main process and
its biggest worker.

    python -m bench.preprocess                      # 2k and 20k conversations
    python -m bench.preprocess --sizes 100000,1000000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

from bench._common import ROOT, format_table, ratio_cell, run_child, write_json

TOKENIZER = str(ROOT / "examples" / "tokenizer")


def make_input(path: str, count: int, seed: int = 7) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    from make_example_conversations import make_conversation

    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps({"messages": make_conversation(rng)}) + "\n")


def child_ours(path: str, out: str, workers: int, pack_size: int) -> dict:
    from megatron_sft_idx.preprocess import Config, run

    t = time.perf_counter()
    s = run(Config(inputs=[path], output_prefix=out, tokenizer=TOKENIZER, pack_size=pack_size,
                   workers=workers, progress=False, overwrite=True))
    return {"wall_s": time.perf_counter() - t, "tokenize_s": s["seconds"]["tokenize"],
            "conversations": s["conversations"], "tokens": s["tokens"], "packs": s["packs"],
            "main_rss_mb": s["peak_rss_mib"]["main"], "workers_rss_mb": s["peak_rss_mib"]["workers_max"]}


def child_legacy(path: str, out: str, pack_size: int) -> dict:
    """All-in-RAM: lists of token ids per conversation, packs as dicts of lists, pickled .npy."""
    import numpy as np

    from megatron_sft_idx.preprocess.records.chat import ChatTokenizer

    tok = ChatTokenizer(TOKENIZER)
    t = time.perf_counter()
    samples = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            ids, mask = tok.encode_chat(json.loads(line)["messages"], "assistant", path, n)
            samples.append({"input_ids": ids.tolist(), "loss_mask": mask.tolist()})
    samples.sort(key=lambda s: -len(s["input_ids"]))
    packs, current = [], None
    for s in samples:  # next fit on the sorted list: enough for a memory comparison
        if current is None or len(current["input_ids"]) + len(s["input_ids"]) > pack_size:
            current = {"input_ids": [], "loss_mask": [], "seq_start_id": []}
            packs.append(current)
        current["seq_start_id"].append(len(current["input_ids"]))
        current["input_ids"] += s["input_ids"][:pack_size]
        current["loss_mask"] += s["loss_mask"][:pack_size]
    np.save(out + ".npy", np.array(packs, dtype=object), allow_pickle=True)
    return {"wall_s": time.perf_counter() - t, "conversations": len(samples), "packs": len(packs)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2000,20000", help="conversation counts for RSS (default: 2000,20000)")
    p.add_argument("--throughput-n", type=int, default=8000,
                   help="conversations for the 1- vs 2-worker throughput run (default: 8000)")
    p.add_argument("--pack-size", type=int, default=4096, help="pack size (default: 4096)")
    p.add_argument("--skip-legacy", action="store_true", help="do not run the legacy peer")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    results = {"throughput": [], "rss": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "tp.jsonl")
        make_input(data, args.throughput_n)
        rows = []
        for workers in (1, 2):
            r = run_child("bench.preprocess:child_ours", path=data, out=os.path.join(tmp, "tp"),
                          workers=workers, pack_size=args.pack_size)
            r.update(workers=workers, conv_per_s=r["conversations"] / r["tokenize_s"],
                     tokens_per_s=r["tokens"] / r["tokenize_s"])
            results["throughput"].append(r)
            rows.append([workers, r["conversations"], r["tokenize_s"], r["conv_per_s"], r["tokens_per_s"],
                         ratio_cell(r["conv_per_s"], results["throughput"][0]["conv_per_s"], True)])
        print(format_table(["workers", "conversations", "tokenize s", "conv/s", "tokens/s", "vs 1 worker"], rows))
        rows = []
        for n in sizes:
            data = os.path.join(tmp, f"rss_{n}.jsonl")
            make_input(data, n)
            ours = run_child("bench.preprocess:child_ours", path=data, out=os.path.join(tmp, f"o{n}"),
                             workers=1, pack_size=args.pack_size)
            peak = max(ours["main_rss_mb"], ours["workers_rss_mb"], ours["peak_rss_mb"])
            legacy = None if args.skip_legacy else run_child(
                "bench.preprocess:child_legacy", path=data, out=os.path.join(tmp, f"l{n}"), pack_size=args.pack_size)
            lpeak = legacy["peak_rss_mb"] if legacy else None
            results["rss"].append({"n": n, "ours": ours, "ours_peak_mb": peak, "legacy": legacy})
            rows.append([f"{n:,}", peak, ours["wall_s"], lpeak, legacy and legacy["wall_s"],
                         ratio_cell(peak, lpeak, False)])
            os.unlink(data)
        print(format_table(["conversations", "ours peak MiB", "ours s", "legacy peak MiB", "legacy s",
                            "ours/legacy RSS"], rows))
    print("wrote", write_json("preprocess", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
