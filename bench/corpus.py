"""A seeded synthetic packed-SFT corpus, generated streaming and read back streaming.

Sequence lengths (tokens, for a 4096-token pack; scaled by ``pack_size / 4096`` so a
small ``--pack-size`` keeps the same shape) are a mixture of three log-normals,
because real SFT mixtures are: many short chat turns, a body of instruction /
multi-turn samples, and a long tail of code, math and reasoning traces (the
Nemotron-style post-training mixtures the RFC cites). Log-normal is the usual fit
for document and turn lengths: positive, right-skewed, heavy upper tail.

| component              | weight | median | sigma | mean (approx.) |
|------------------------|--------|--------|-------|----------------|
| short chat turns       | 0.55   | 180    | 0.8   | 250            |
| instruction/multi-turn | 0.30   | 700    | 0.6   | 840            |
| long code/math/reason. | 0.15   | 2200   | 0.7   | 2800           |

Lengths are clipped to ``[max(2, 8 * scale), pack_size]`` (longer samples are
truncated to one pack, as the packers do). Mean ≈ 810 tokens, ≈ 5 sequences
per 4096-token pack.

Packing is first-fit-decreasing over a streaming window of ``_WINDOW`` sequences
(what Megatron-Bridge's ``first_fit_decreasing`` does over the whole dataset, made
streaming): each window's packs are emitted in a seeded random order, so packs look
like real ones (a few long samples topped up with short ones, ~95% full).

Token ids follow a Zipf(1.1) rank-frequency law over ``vocab_size`` with the ranks
mapped to ids by a fixed random permutation (real BPE ids are not sorted by
frequency; sorting them would let Python cache small ints and flatter the pickled
``.npy`` peer). Each sequence is a prompt (no loss) followed by a response (loss),
the split uniform in [10%, 70%] of its length; the loss mask is label-aligned:
``loss[j] = 1`` trains predicting token ``j + 1``, the last position of every
sequence is 0.

On disk (``Corpus.generate``): raw little-endian arrays ``tokens.bin`` (uint16 or
int32), ``loss.bin`` (uint8), ``starts.bin`` (int32), ``lengths.bin`` /
``nseq.bin`` (int32 per pack) and ``meta.json``. Readers use ``pread``-style
``np.fromfile`` chunks, never mmap, so a consumer's RSS does not grow with the
corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import numpy as np

MIXTURE = (  # (weight, median tokens at pack_size 4096, sigma of log)
    (0.55, 180.0, 0.8),
    (0.30, 700.0, 0.6),
    (0.15, 2200.0, 0.7),
)
REFERENCE_PACK_SIZE = 4096
ZIPF_EXPONENT = 1.1
_WINDOW = 8192          # sequences per first-fit-decreasing window
_CHUNK_TOKENS = 1 << 22  # tokens per read chunk when streaming packs back


def sample_lengths(rng: np.random.Generator, count: int, pack_size: int) -> np.ndarray:
    """``count`` sequence lengths (int64) from the mixture, clipped to one pack."""
    scale = pack_size / REFERENCE_PACK_SIZE
    weights = np.array([w for w, _, _ in MIXTURE])
    comp = rng.choice(len(MIXTURE), size=count, p=weights / weights.sum())
    medians = np.array([m for _, m, _ in MIXTURE])[comp] * scale
    sigmas = np.array([s for _, _, s in MIXTURE])[comp]
    lengths = np.rint(medians * np.exp(sigmas * rng.standard_normal(count))).astype(np.int64)
    return np.clip(lengths, max(2, int(8 * scale)), pack_size)


def first_fit_decreasing(lengths: np.ndarray, pack_size: int) -> np.ndarray:
    """Bin number of every sequence, first-fit over lengths sorted decreasing."""
    order = np.argsort(-lengths, kind="stable")
    free = np.empty(0, dtype=np.int64)
    bins = np.empty(lengths.size, dtype=np.int64)
    for i in order:  # generator only, not a hot path of the library
        length = lengths[i]
        fits = np.flatnonzero(free >= length)
        if fits.size:
            b = int(fits[0])
            free[b] -= length
        else:
            b = free.size
            free = np.append(free, pack_size - length)
        bins[i] = b
    return bins


def _zipf_sampler(rng: np.random.Generator, vocab_size: int):
    ranks = np.arange(1, vocab_size + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -ZIPF_EXPONENT)
    cdf /= cdf[-1]
    ids_by_rank = rng.permutation(vocab_size)

    def draw(n: int) -> np.ndarray:
        return ids_by_rank[np.minimum(np.searchsorted(cdf, rng.random(n)), vocab_size - 1)]
    return draw


def _loss_mask(rng: np.random.Generator, seq_starts: np.ndarray, seq_lengths: np.ndarray,
               n_tokens: int) -> np.ndarray:
    """Label-aligned loss over a concatenation of sequences: 1 on [s+P-1, e-1) per sequence."""
    prompt = np.maximum(1, np.rint(seq_lengths * rng.uniform(0.1, 0.7, seq_lengths.size)).astype(np.int64))
    first = seq_starts + prompt - 1
    last = seq_starts + seq_lengths - 1          # exclusive end: the last position stays 0
    keep = first < last
    diff = np.zeros(n_tokens + 1, dtype=np.int64)
    np.add.at(diff, first[keep], 1)
    np.add.at(diff, last[keep], -1)
    return (np.cumsum(diff[:-1]) > 0).astype(np.uint8)


class Corpus:
    """A generated corpus on disk (see the module docstring for the layout)."""

    def __init__(self, directory, packs: Optional[int] = None) -> None:
        """Open a generated corpus; ``packs`` limits it to its first ``packs`` packs."""
        self.dir = Path(directory)
        self.meta = json.loads((self.dir / "meta.json").read_text())
        self.token_dtype = np.dtype(self.meta["token_dtype"])
        self.lengths = np.fromfile(self.dir / "lengths.bin", dtype=np.int32, count=-1 if packs is None else packs)
        self.nseq = np.fromfile(self.dir / "nseq.bin", dtype=np.int32, count=-1 if packs is None else packs)
        self.token_offsets = np.concatenate(([0], np.cumsum(self.lengths, dtype=np.int64)))
        self.seq_offsets = np.concatenate(([0], np.cumsum(self.nseq, dtype=np.int64)))

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def pack_size(self) -> int:
        return int(self.meta["pack_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def n_tokens(self) -> int:
        return int(self.token_offsets[-1])

    @property
    def n_sequences(self) -> int:
        return int(self.seq_offsets[-1])

    # ------------------------------------------------------------ generation

    @classmethod
    def generate(cls, directory, packs: int, pack_size: int = 4096, vocab_size: int = 32000,
                 seed: int = 1234) -> "Corpus":
        """Write ``packs`` packs to ``directory`` (reused when the same parameters exist)."""
        directory = Path(directory)
        params = {"packs": packs, "pack_size": pack_size, "vocab_size": vocab_size, "seed": seed,
                  "mixture": [list(m) for m in MIXTURE], "zipf": ZIPF_EXPONENT, "window": _WINDOW}
        meta_path = directory / "meta.json"
        if meta_path.exists():
            old = json.loads(meta_path.read_text())
            if old.get("params") == params:
                return cls(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta_path.unlink(missing_ok=True)
        rng = np.random.default_rng(seed)
        draw = _zipf_sampler(rng, vocab_size)
        token_dtype = np.uint16 if vocab_size <= 65535 else np.int32
        files = {name: open(directory / f"{name}.bin", "wb")
                 for name in ("tokens", "loss", "starts", "lengths", "nseq")}
        written = 0
        try:
            while written < packs:
                lengths = sample_lengths(rng, _WINDOW, pack_size)
                bins = first_fit_decreasing(lengths, pack_size)
                written += cls._write_window(rng, draw, lengths, bins, packs - written, files, token_dtype)
        finally:
            for f in files.values():
                f.close()
        meta = {"params": params, "packs": packs, "pack_size": pack_size, "vocab_size": vocab_size,
                "token_dtype": np.dtype(token_dtype).name}
        corpus_meta_tmp = directory / "meta.json.tmp"
        corpus_meta_tmp.write_text(json.dumps(meta, indent=2))
        os.replace(corpus_meta_tmp, meta_path)
        corpus = cls(directory)
        corpus.meta.update(corpus.summary())
        meta_path.write_text(json.dumps(corpus.meta, indent=2))
        return corpus

    @staticmethod
    def _write_window(rng, draw, lengths, bins, want, files, token_dtype) -> int:
        n_bins = int(bins.max()) + 1
        # Emit packs in a seeded random order; within a pack, sequences in sample order.
        pack_order = rng.permutation(n_bins)[:want]
        rank = np.full(n_bins, -1, dtype=np.int64)
        rank[pack_order] = np.arange(pack_order.size)
        take = np.flatnonzero(rank[bins] >= 0)
        take = take[np.lexsort((take, rank[bins[take]]))]
        seq_len = lengths[take]
        seq_pack = rank[bins[take]]
        pack_len = np.bincount(seq_pack, weights=seq_len, minlength=pack_order.size).astype(np.int64)
        pack_nseq = np.bincount(seq_pack, minlength=pack_order.size).astype(np.int64)
        seq_global = np.concatenate(([0], np.cumsum(seq_len)[:-1]))
        pack_start = np.concatenate(([0], np.cumsum(pack_len)[:-1]))
        seq_start_in_pack = seq_global - pack_start[seq_pack]
        n_tokens = int(seq_len.sum())
        files["tokens"].write(draw(n_tokens).astype(token_dtype).tobytes())
        files["loss"].write(_loss_mask(rng, seq_global, seq_len, n_tokens).tobytes())
        files["starts"].write(seq_start_in_pack.astype(np.int32).tobytes())
        files["lengths"].write(pack_len.astype(np.int32).tobytes())
        files["nseq"].write(pack_nseq.astype(np.int32).tobytes())
        return int(pack_order.size)

    # ------------------------------------------------------------ reading

    def _read(self, name: str, dtype, first: int, count: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        return np.fromfile(self.dir / f"{name}.bin", dtype=dtype, count=count, offset=first * dtype.itemsize)

    def iter_chunks(self, first: int = 0, last: Optional[int] = None,
                    chunk_tokens: int = _CHUNK_TOKENS) -> Iterator[Tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
        """Yield ``(p0, p1, tokens, loss, starts)`` for consecutive pack ranges of ~chunk_tokens."""
        last = len(self) if last is None else last
        p0 = first
        while p0 < last:
            t0 = int(self.token_offsets[p0])
            p1 = int(np.searchsorted(self.token_offsets, t0 + chunk_tokens, side="right")) - 1
            p1 = min(max(p1, p0 + 1), last)
            t1 = int(self.token_offsets[p1])
            s0, s1 = int(self.seq_offsets[p0]), int(self.seq_offsets[p1])
            yield (p0, p1, self._read("tokens", self.token_dtype, t0, t1 - t0),
                   self._read("loss", np.uint8, t0, t1 - t0), self._read("starts", np.int32, s0, s1 - s0))
            p0 = p1

    def iter_packs(self, first: int = 0, last: Optional[int] = None) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Yield every pack as ``(input_ids, loss_mask, seq_start_id)`` views into a chunk buffer."""
        for p0, p1, tokens, loss, starts in self.iter_chunks(first, last):
            t_base, s_base = int(self.token_offsets[p0]), int(self.seq_offsets[p0])
            for p in range(p0, p1):
                a, b = int(self.token_offsets[p]) - t_base, int(self.token_offsets[p + 1]) - t_base
                c, d = int(self.seq_offsets[p]) - s_base, int(self.seq_offsets[p + 1]) - s_base
                yield tokens[a:b], loss[a:b], starts[c:d]

    def pack(self, i: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pack ``i`` read directly from the files."""
        return next(self.iter_packs(i, i + 1))

    def digests(self) -> np.ndarray:
        """Per pack ``[length, sum(input_ids), sum(loss_mask), sum(seq_start_id)]`` (int64, n×4)."""
        out = np.empty((len(self), 4), dtype=np.int64)
        out[:, 0] = self.lengths
        for p0, p1, tokens, loss, starts in self.iter_chunks():
            tok_idx = self.token_offsets[p0:p1] - self.token_offsets[p0]
            seq_idx = self.seq_offsets[p0:p1] - self.seq_offsets[p0]
            out[p0:p1, 1] = np.add.reduceat(tokens.astype(np.int64), tok_idx)
            out[p0:p1, 2] = np.add.reduceat(loss.astype(np.int64), tok_idx)
            out[p0:p1, 3] = np.add.reduceat(starts.astype(np.int64), seq_idx)
        return out

    def summary(self) -> Dict[str, float]:
        """Counts and the realised length distribution (for the docs and the JSON)."""
        seq_lengths = []
        loss_tokens = 0
        for p0, p1, _, loss, starts in self.iter_chunks():
            loss_tokens += int(loss.sum(dtype=np.int64))
            ends = np.empty_like(starts, dtype=np.int64)
            ends[:-1] = starts[1:]
            last_of_pack = (self.seq_offsets[p0 + 1:p1 + 1] - self.seq_offsets[p0] - 1)
            ends[last_of_pack] = self.lengths[p0:p1]
            seq_lengths.append(ends - starts)
        sl = np.concatenate(seq_lengths)
        pct = np.percentile(sl, [50, 90, 99])
        return {"n_tokens": self.n_tokens, "n_sequences": self.n_sequences,
                "seq_len_mean": round(float(sl.mean()), 1), "seq_len_p50": float(pct[0]),
                "seq_len_p90": float(pct[1]), "seq_len_p99": float(pct[2]),
                "seqs_per_pack": round(self.n_sequences / len(self), 3),
                "pack_fill": round(self.n_tokens / (len(self) * self.pack_size), 4),
                "loss_fraction": round(loss_tokens / max(1, self.n_tokens), 4)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.corpus", description="Generate the synthetic corpus.")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--packs", type=int, default=1000)
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seed", type=int, default=1234)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    corpus = Corpus.generate(args.out, args.packs, args.pack_size, args.vocab_size, args.seed)
    print(json.dumps(corpus.meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
