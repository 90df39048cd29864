"""Our Megatron-LM sample layout against Megatron-LM's own ``SFTDataset`` (megatron-core wheel).

``megatron.training.datasets.sft_dataset.SFTDataset`` packs the conversations of one row:
it tokenizes each with ``tokenizer.tokenize_conversation`` (targets -100 where untrained),
pads each to a multiple of ``2*CP`` with the pad token, shifts labels, masks loss where the
label is -100 or the pad token, and records ``cu_seqlens``/``max_seqlen``. The same
conversations packed into our shard (label-aligned mask, "stored" padding layout) must give,
through :class:`SFTIndexedDataset`, the same ``tokens``, ``loss_mask``, ``position_ids``,
``cu_seqlens`` and ``max_seqlen``, and the same ``labels`` wherever the loss mask is 1 (where
it is 0, SFTDataset's labels hold -100 or padding, ours the next token).

The tokenizer handed to SFTDataset looks each conversation up in a table of seeded token
ids and targets (tokenization is not what is compared; SFTDataset's packing rules are).
"""

import numpy as np
import pytest
import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.utils import Split
from megatron.training.datasets.sft_dataset import IGNORE_INDEX, SFTDataset

from megatron_sft_idx import IndexedDatasetBuilder, MMapIndexedDataset
from megatron_sft_idx.packing.padding import padded_length
from megatron_sft_idx.training.megatron import SFTIndexedDataset, SFTIndexedDatasetConfig

PAD, EOD, SEQ = 0, 1, 96


class TableTokenizer:
    """``tokenize_conversation`` by lookup: conversation k is system message ``str(k)``."""

    def __init__(self, table):
        self.table = table
        self.eod, self.pad = EOD, PAD
        self.vocab_size = 1000
        self.unique_identifiers = {"class": "TableTokenizer", "size": len(table)}

    def tokenize_conversation(self, conversation, return_target, add_generation_prompt):
        tokens, target = self.table[int(conversation[0]["content"])]
        return (tokens.copy(), target.copy()) if return_target else tokens.copy()


def seeded_rows(rng, cp, n_rows=24):
    """Rows of conversations that fit SEQ once padded to 2*CP: (table, rows of ids)."""
    mult = 2 * cp if cp > 1 else 1
    table, rows = [], []
    for _ in range(n_rows):
        row, used = [], 0
        while True:
            n = int(rng.integers(3, 30))
            if used + int(padded_length([n], mult)[0]) > SEQ or len(row) >= 5:
                break
            tokens = rng.integers(3, 1000, n)
            target = tokens.copy()
            prompt = int(rng.integers(1, n - 1))
            target[:prompt] = IGNORE_INDEX  # system/user part: untrained
            table.append((tokens, target))
            row.append(len(table) - 1)
            used += int(padded_length([n], mult)[0])
        rows.append(row or [len(table) - 1])
    return table, rows


def write_rows(prefix, table, rows, cp):
    """The same rows as packs of our format: label-aligned masks, each conversation padded."""
    mult = 2 * cp if cp > 1 else 1
    with IndexedDatasetBuilder(prefix, pack_size=SEQ, metadata={"pad_seq_to_mult": mult,
                                                                "pad_layout": "stored"}) as b:
        for row in rows:
            ids, loss, starts = [], [], []
            for k in row:
                tokens, target = table[k]
                n, total = len(tokens), int(padded_length([len(tokens)], mult)[0])
                mask = np.zeros(total, np.uint8)
                mask[: n - 1] = target[1:] != IGNORE_INDEX  # label-aligned: position j trains j+1
                starts.append(len(ids))
                ids += list(tokens) + [PAD] * (total - n)
                loss += list(mask)
            b.add_packed(np.array(ids), np.array(loss), np.array(starts))


class Rows:
    """SFTDataset's low-level dataset: row i is the merged message list of its conversations."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return [m for k in self.rows[i] for m in ({"role": "system", "content": str(k)},
                                                  {"role": "user", "content": "-"})]


@pytest.mark.parametrize("cp", [1, 2])
def test_samples_equal_megatron_lm_sft_dataset(tmp_path, cp):
    rng = np.random.default_rng(100 + cp)
    table, rows = seeded_rows(rng, cp)
    prefix = str(tmp_path / "rows")
    write_rows(prefix, table, rows, cp)
    tok = TableTokenizer(table)
    n = len(rows)
    ref_cfg = GPTDatasetConfig(random_seed=1, sequence_length=SEQ, tokenizer=tok, reset_position_ids=False,
                               reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
                               context_parallel_size=cp)
    ref = SFTDataset(Rows(rows), "rows", np.arange(n), n, Split.train, ref_cfg)
    cfg = SFTIndexedDatasetConfig(random_seed=1, sequence_length=SEQ, tokenizer=tok, shuffle=False,
                                  context_parallel_size=cp, pad_token_id=PAD)
    ours = SFTIndexedDataset(MMapIndexedDataset(prefix), prefix, np.arange(n), n, Split.train, cfg)
    assert len(ours) == len(ref) == n
    trained = 0
    for i in range(n):
        want, got = ref[i], ours[i]
        for key in ("tokens", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen"):
            assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, (i, key)
            assert torch.equal(got[key], want[key]), (i, key, got[key], want[key])
        on = want["loss_mask"] == 1
        assert torch.equal(got["labels"][on], want["labels"][on]), i
        trained += int(on.sum())
    assert trained > 0
