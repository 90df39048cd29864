"""Convert packed SFT data of any format ``open_packed`` reads into a shard of this format.

Made for Megatron-Bridge's legacy ``.npy`` and packed Parquet: the packs are copied as they
are, except the positions Bridge never trains, which are normalised (docs/FORMAT.md, "Data
written by Megatron-Bridge"); the shard records Bridge's padding layout (``runtime``) and
multiple, so every consumer serves it as Bridge would::

    python -m megatron_sft_idx.training.convert packed_4096_seed0.npy /data/sft/train \\
        --pad-seq-to-mult 4 --eos-id 2 --vocab-size 32000

Exit codes: 0 converted, 1 the input is refused (the message names file, pack and rule),
2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ..builder import IndexedDatasetBuilder
from ..errors import ShardError
from ..format import PAD_LAYOUT_RUNTIME, PAD_LAYOUTS
from ._sources import summarize
from .factory import open_packed

__all__ = ["convert", "build_parser", "main"]


def convert(src, prefix: str, *, pad_seq_to_mult: int = 1, pad_layout: str = PAD_LAYOUT_RUNTIME,
            eos_id: Optional[int] = None, pack_size: Optional[int] = None, vocab_size: Optional[int] = None,
            overwrite: bool = False):
    """Write every pack of ``src`` to a shard at ``prefix``; returns its metadata.

    ``pack_size`` defaults to the longest pack (Bridge's stored packs may exceed its nominal
    pack size by one token per sequence).

    Raises:
        ShardError: the input does not open, a pack breaks an invariant, or the shard exists.
    """
    source = open_packed(src, pad_seq_to_mult=pad_seq_to_mult, pad_layout=pad_layout, eos_id=eos_id)
    summary = summarize(source)
    if pack_size is not None and pack_size < summary.max_packed_seqlen:
        raise ShardError("a pack is longer than --pack-size", path=str(src), field="pack_size",
                         expected=f">= {summary.max_packed_seqlen}", actual=pack_size,
                         hint="omit --pack-size to use the longest pack")
    metadata = {"pad_seq_to_mult": summary.pad_seq_to_mult, "pad_layout": summary.pad_layout,
                "source": {"converted_from": str(src)}}
    with IndexedDatasetBuilder(prefix, vocab_size=vocab_size, pack_size=pack_size or summary.max_packed_seqlen,
                               metadata=metadata, overwrite=overwrite) as builder:
        for i in range(len(source)):  # one-off conversion; the builder validates each pack
            pack = source[i]
            builder.add_packed(pack.input_ids, pack.loss_mask, pack.seq_start_id)
    return builder.metadata


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_sft_idx.training.convert",
                                description="Convert packed SFT data (Bridge .npy / Parquet, shards) to a shard.")
    p.add_argument("src", help="a legacy .npy, packed Parquet (file, directory, glob) or shard prefix")
    p.add_argument("prefix", help="output shard prefix")
    p.add_argument("--pad-seq-to-mult", type=int, default=1, help="the multiple the producer padded to (default 1)")
    p.add_argument("--pad-layout", choices=PAD_LAYOUTS, default=PAD_LAYOUT_RUNTIME,
                   help="which length the multiple applies to (Megatron-Bridge: runtime; default)")
    p.add_argument("--eos-id", type=int, default=None, help="Bridge's EOS id: zero the loss at EOS inputs")
    p.add_argument("--pack-size", type=int, default=None, help="recorded pack size (default: the longest pack)")
    p.add_argument("--vocab-size", type=int, default=None, help="refuse token ids >= this")
    p.add_argument("--overwrite", action="store_true", help="replace an existing shard")
    p.add_argument("--json", action="store_true", help="print the shard metadata as JSON")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        meta = convert(args.src, args.prefix, pad_seq_to_mult=args.pad_seq_to_mult, pad_layout=args.pad_layout,
                       eos_id=args.eos_id, pack_size=args.pack_size, vocab_size=args.vocab_size,
                       overwrite=args.overwrite)
    except ShardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(meta.to_dict(), sort_keys=True))
    else:
        print(f"{args.prefix}: {meta.stats.pack_count} packs, {meta.stats.token_count} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
