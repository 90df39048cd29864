"""Random valid packs and shards for tests (shared by every test module)."""

from __future__ import annotations

import numpy as np

from megatron_sft_idx import IndexedDatasetBuilder


def random_pack(rng, pack_size=64, vocab=1000, max_seqs=6, pad_mult=1, full=False):
    """A valid pack: (input_ids int64, loss_mask uint8, seq_start_id int64)."""
    units = pack_size // pad_mult
    n_units = units if full else int(rng.integers(1, units + 1))
    k = int(rng.integers(1, min(n_units, max_seqs) + 1))
    cuts = np.sort(rng.choice(np.arange(1, n_units), k - 1, replace=False)) if k > 1 else np.empty(0, int)
    starts = np.concatenate([[0], cuts]).astype(np.int64) * pad_mult
    n = n_units * pad_mult
    ids = rng.integers(0, vocab, n).astype(np.int64)
    loss = rng.integers(0, 2, n).astype(np.uint8)
    ends = np.append(starts[1:], n)
    loss[ends - 1] = 0  # label-aligned: nothing to predict after a sequence's last token
    return ids, loss, starts


def random_packs(rng, count, **kw):
    return [random_pack(rng, **kw) for _ in range(count)]


def write_shard(prefix, packs, **builder_kw):
    builder_kw.setdefault("pack_size", 64)
    with IndexedDatasetBuilder(prefix, **builder_kw) as b:
        for p in packs:
            b.add_packed(*p)
    return b.metadata
