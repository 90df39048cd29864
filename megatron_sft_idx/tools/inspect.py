"""What a shard (or a set of shards) holds, in a summary a person reads in ten seconds.

:func:`summarize` folds the shards' metadata (counts, statistics, provenance: no data
read) and three histograms computed from the indexes in numba, a chunk at a time:
sequences per pack (from the CSR offsets), pack fill (packed length / pack size, from
``.idx``) and sequence lengths (from ``.seq.bin`` and the pack lengths). ``.bin`` and
``.loss.bin`` are never read. :func:`format_summary` renders it as text; the dict is the
``--json`` output; :mod:`.plot` draws the same histograms.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .. import _kernels
from ..errors import FormatError
from ..reader import MMapIndexedDataset
from .._units import plural
from .._units import human_bytes

CHUNK_PACKS = 1 << 20
BINS = 12
_BAR = 28


def _edges(top: int, bins: int) -> np.ndarray:
    """Integer bin edges covering [1, top]: one bin per value when there are few values."""
    top = max(int(top), 1)
    if top <= bins:
        return np.arange(1, top + 2, dtype=np.int64)
    width = -(-top // bins)
    return np.arange(1, top + width + 1, width, dtype=np.int64)[: bins + 1]


class _Histograms:
    def __init__(self, max_samples: int, capacity: int, max_seqlen: int, bins: int) -> None:
        self.edges = {"sequences_per_pack": _edges(max_samples, bins),
                      "pack_fill": np.linspace(0.0, 1.0, 11),
                      "sequence_length": _edges(max_seqlen, bins)}
        self.counts = {k: np.zeros(len(e) - 1, dtype=np.int64) for k, e in self.edges.items()}
        self.capacity = capacity

    def _add(self, key: str, values: np.ndarray) -> None:
        edges = self.edges[key]
        if key != "pack_fill":  # integer bins [e_i, e_{i+1}); the last edge is exclusive
            values = np.minimum(values, edges[-1] - 1)
        self.counts[key] += np.histogram(values, bins=edges)[0]

    def add_chunk(self, lengths: np.ndarray, offsets: np.ndarray, starts: np.ndarray) -> None:
        self._add("sequences_per_pack", np.diff(offsets))
        self._add("pack_fill", lengths / self.capacity)
        seqlens = np.empty(int(offsets[-1] - offsets[0]), dtype=np.int64)
        _kernels.sequence_lengths_of(lengths, offsets, starts, seqlens)
        self._add("sequence_length", seqlens)

    def to_dict(self) -> Dict[str, Dict[str, list]]:
        return {k: {"edges": [round(float(x), 4) for x in self.edges[k]], "counts": self.counts[k].tolist()}
                for k in self.edges}


def _provenance(meta) -> Dict[str, Any]:
    out: Dict[str, Any] = {"producer": meta.producer}
    tok = meta.tokenizer or {}
    if tok:
        out["tokenizer"] = {k: tok.get(k) for k in ("name", "path", "files_sha256", "chat_template_sha256",
                                                     "vocab_size") if tok.get(k) is not None}
    for key in ("packing", "parallelism", "source", "extra"):
        value = getattr(meta, key)
        if value:
            out[key] = value
    return out


def summarize(prefixes: Sequence[str], bins: int = BINS) -> Dict[str, Any]:
    """The summary of ``prefixes`` read as one dataset (see the module docstring).

    Raises:
        FormatError: a prefix holds upstream pretrain data (nothing SFT to summarise).
        ShardError (any subclass): a shard is missing or unreadable.
    """
    shards = [MMapIndexedDataset(p) for p in prefixes]
    for shard in shards:
        if shard.is_pretrain:
            raise FormatError("upstream pretrain data: no loss mask or sequence boundaries to summarise",
                              path=shard.prefix, field="kind", expected="sft", actual="pretrain",
                              hint="check it with check-idx --allow-pretrain, or convert it with convert-packed")
    stats = [s.metadata.stats for s in shards]
    sizes = [s.metadata.pack_size for s in shards]
    capacity = max(sizes) if all(sizes) else max(s.max_packed_seqlen for s in stats)
    hist = _Histograms(max(s.max_samples_per_bin for s in stats), capacity,
                       max(s.dataset_max_seqlen for s in stats), bins)
    for shard in shards:
        arrays = shard.arrays()
        for a in range(0, len(shard), CHUNK_PACKS):
            b = min(len(shard), a + CHUNK_PACKS)
            hist.add_chunk(np.asarray(arrays.sequence_lengths[a:b]), np.asarray(arrays.seq_offsets[a:b + 1]),
                           arrays.seq_starts)
            shard.release_pages()
    packs, tokens = sum(s.pack_count for s in stats), sum(s.token_count for s in stats)
    trained = sum(s.loss_token_count for s in stats)
    sequences = sum(s.sequence_count for s in stats)
    files = sum(sum(s.file_sizes.values()) for s in shards)  # (local files or objects alike)
    return {
        "shards": [s.prefix for s in shards], "packs": packs, "sequences": sequences, "tokens": tokens,
        "trainable_tokens": trained, "trainable_share": round(trained / tokens, 6),
        "token_dtype": sorted({s.metadata.token_dtype for s in shards}),
        "pack_size": sorted({s for s in sizes if s}) or None, "vocab_size": sorted({s.metadata.vocab_size or 0
                                                                                    for s in shards}),
        "pad_seq_to_mult": sorted({s.metadata.pad_seq_to_mult for s in shards}),
        "pad_layout": sorted({getattr(s.metadata, "pad_layout", "stored") for s in shards}),
        "packing_efficiency": round(tokens / (packs * capacity), 6),
        "sequences_per_pack": {"mean": round(sequences / packs, 3), "max": max(s.max_samples_per_bin for s in stats)},
        "packed_length": {"min": min(s.min_packed_seqlen for s in stats), "max": max(s.max_packed_seqlen for s in stats)},
        "sequence_length": {"min": min(s.min_seqlen for s in stats), "max": max(s.dataset_max_seqlen for s in stats),
                            "mean": round(tokens / sequences, 1)},
        "bytes": files, "histograms": hist.to_dict(), "provenance": _provenance(shards[0].metadata),
        "sources": _sources(shards),
        "provenance_differs": any(_provenance(s.metadata) != _provenance(shards[0].metadata) for s in shards[1:]),
    }


def _sources(shards) -> Optional[Dict[str, int]]:
    """A mixture's sequences per source over the shards (format 1.2), None when they record none."""
    if any(s.metadata.sources is None for s in shards):
        return None
    out: Dict[str, int] = {}
    for shard in shards:
        for src in shard.metadata.sources:
            out[src.name] = out.get(src.name, 0) + src.sequences
    return out


def _one(values: list):
    return values[0] if len(values) == 1 else " / ".join(str(v) for v in values)


def _histogram_lines(title: str, hist: Dict[str, list], label) -> List[str]:
    counts = hist["counts"]
    top = max(counts) or 1
    lines = [title]
    for i, count in enumerate(counts):
        bar = "█" * int(round(_BAR * count / top)) or ("▏" if count else "")
        lines.append(f"  {label(hist['edges'][i], hist['edges'][i + 1]):>13} {bar:<{_BAR}} {count:,}")
    return lines


def _int_range(lo, hi) -> str:
    lo, hi = int(lo), int(hi) - 1
    return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"


def format_summary(s: Dict[str, Any]) -> str:
    """The summary as ~30 lines of text."""
    prov = s["provenance"]
    where = s["shards"][0] if len(s["shards"]) == 1 else f"{len(s['shards'])} shards ({s['shards'][0]}, ...)"
    lines = [
        f"{where}",
        f"  packs        {s['packs']:,}   sequences {s['sequences']:,} "
        f"({s['sequences_per_pack']['mean']:.2f} per pack, max {s['sequences_per_pack']['max']:,})",
        f"  tokens       {s['tokens']:,} ({_one(s['token_dtype'])}), trainable {s['trainable_tokens']:,} "
        f"({s['trainable_share']:.1%})",
        f"  pack size    {_one(s['pack_size'] or ['unknown'])}, packing efficiency {s['packing_efficiency']:.1%}, "
        f"packs {s['packed_length']['min']:,}-{s['packed_length']['max']:,} tokens",
        f"  sequences    {s['sequence_length']['min']:,}-{s['sequence_length']['max']:,} tokens "
        f"(mean {s['sequence_length']['mean']:,}), pad multiple {_one(s['pad_seq_to_mult'])}"
        + (f" ({_one(s['pad_layout'])} layout)" if max(s["pad_seq_to_mult"]) > 1 else ""),
        f"  on disk      {human_bytes(s['bytes'])}",
    ]
    lines += _provenance_lines(prov, s["vocab_size"])
    if s.get("sources"):
        lines.append("  sources      " + ", ".join(f"{name} {n:,}" for name, n in s["sources"].items())
                     + " sequences (--sql over 'sequences' groups by source)")
    if s["provenance_differs"]:
        lines.append("  (provenance of the first shard; the shards differ: --json lists each)")
    h = s["histograms"]
    lines += [""] + _histogram_lines("sequences per pack", h["sequences_per_pack"], _int_range)
    lines += _histogram_lines("pack fill (packed length / pack size)", h["pack_fill"],
                              lambda a, b: f"{a:.0%}-{b:.0%}")
    lines += _histogram_lines("sequence length (tokens)", h["sequence_length"], _int_range)
    return "\n".join(lines)


def _provenance_lines(prov: Dict[str, Any], vocab: list) -> List[str]:
    lines = []
    tok = prov.get("tokenizer")
    if tok:
        digest = (tok.get("files_sha256") or "")[:12]
        lines.append(f"  tokenizer    {tok.get('name', '?')} (vocab {tok.get('vocab_size') or _one(vocab)}"
                     f"{', files sha256 ' + digest if digest else ''})")
    elif any(vocab):
        lines.append(f"  tokenizer    unknown (vocab {_one(vocab)})")
    packing, par = prov.get("packing") or {}, prov.get("parallelism") or {}
    if packing or par:
        text = ", ".join(f"{k} {v}" for k, v in sorted(packing.items()) if k != "pack_size")
        if par:
            text += (", " if text else "") + " ".join(f"{k}={v}" for k, v in sorted(par.items()))
        lines.append(f"  packing      {text}")
    source = prov.get("source") or {}
    if source.get("merged"):
        lines.append(f"  merged from  {plural(int(source['merged'].get('shards') or 0), 'shard')}: "
                     f"{', '.join(source['merged'].get('inputs', []))[:100]}")
    if source.get("converted_from"):
        c = source["converted_from"]
        lines.append(f"  converted    from {c.get('format')} {c.get('path')}")
    if isinstance(source.get("inputs"), list):
        names = [os.path.basename(str(i.get("name", i)) if isinstance(i, dict) else str(i)) for i in source["inputs"]]
        lines.append(f"  inputs       {len(names)}: {', '.join(names)[:100]}")
    producer = prov.get("producer") or {}
    lines.append(f"  written by   {producer.get('name', '?')} {producer.get('version', '')}".rstrip())
    return lines
