#!/usr/bin/env python3
"""The main job on the bundled example, end to end, offline.

conversations (examples/*.jsonl) + a small BPE tokenizer (examples/tokenizer)
  -> tools/preprocess_sft.py: tokenize, pack globally, write shards, self-check masks
  -> tools/check_idx.py: the promotion gate, promoting the shard into a "training" dir
  -> MMapIndexedDataset: read a few packs back, show which tokens are trained.

Run ``python tools/demo.py`` (``make demo`` installs first). Output goes to ``out/demo``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_sft_idx import MMapIndexedDataset  # noqa: E402
from megatron_sft_idx.gate import cli as gate_cli  # noqa: E402
from megatron_sft_idx.preprocess import cli as preprocess_cli  # noqa: E402

EXAMPLES = os.path.join(ROOT, "examples")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "demo"),
                        help="working directory, replaced on every run (default: out/demo)")
    parser.add_argument("--pack-size", type=int, default=2048, help="tokens per pack (default: 2048)")
    parser.add_argument("--workers", type=int, default=2, help="tokenizer processes (default: 2)")
    parser.add_argument("--show", type=int, default=3, help="packs to print (default: 3)")
    return parser


def show_pack(ds: MMapIndexedDataset, i: int, tokenizer) -> None:
    """Print pack i: its sequences, and the first one's text with trained tokens in [[...]]."""
    pack = ds[i]
    lengths = pack.seq_lengths.tolist()
    print(f"pack {i}: {pack.packed_len} tokens, {len(lengths)} sequences {lengths}, "
          f"{int(pack.loss_mask.sum())} trained positions")
    end = int(pack.seq_boundaries[1])
    ids = pack.input_ids[:end].tolist()
    # Label-aligned: loss_mask[j] trains predicting token j+1, so token j+1 is the trained one.
    trained = [False] + [bool(v) for v in pack.loss_mask[:end - 1]]
    pieces, run, state = [], [], trained[0]
    for token, is_trained in zip(ids, trained):
        if is_trained != state:
            pieces.append((state, tokenizer.decode(run, skip_special_tokens=False)))
            run, state = [], is_trained
        run.append(token)
    pieces.append((state, tokenizer.decode(run, skip_special_tokens=False)))
    text = "".join(f"[[{t}]]" if is_trained else t for is_trained, t in pieces)
    print("  first sequence, trained tokens in [[...]]:")
    for line in text.splitlines()[:12]:
        print("    " + line[:110])


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    staging, training = os.path.join(args.out, "staging"), os.path.join(args.out, "training")
    os.makedirs(training)
    print("== 1. preprocess: conversations -> packed shard")
    rc = preprocess_cli.main([
        "--input", os.path.join(EXAMPLES, "conversations.jsonl"),
        os.path.join(EXAMPLES, "conversations_sharegpt.jsonl"),
        "--tokenizer", os.path.join(EXAMPLES, "tokenizer"),
        "--output-prefix", os.path.join(staging, "example"),
        "--pack-size", str(args.pack_size), "--workers", str(args.workers),
        "--verify-masks", "50", "--summary-json", os.path.join(args.out, "summary.json")])
    if rc != 0:
        return rc
    print("\n== 2. gate: check the shard and promote it to training storage")
    rc = gate_cli.main([staging, "--promote", training])
    if rc != 0:
        return rc
    print("\n== 3. read packs back from training storage (mmap, nothing loaded at open)")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(EXAMPLES, "tokenizer", "tokenizer.json"))
    ds = MMapIndexedDataset(os.path.join(training, "example"))
    stats = ds.metadata.stats
    print(f"{ds!r}\n  {stats.pack_count} packs, {stats.sequence_count} sequences, "
          f"{stats.token_count} tokens, packing efficiency {stats.packing_efficiency:.1%}, "
          f"max {stats.max_samples_per_bin} sequences per pack")
    for i in range(min(args.show, len(ds))):
        show_pack(ds, i, tokenizer)
    print(f"\ndone: shard at {os.path.join(training, 'example')}.{{bin,idx,loss.bin,seq.idx,seq.bin}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
