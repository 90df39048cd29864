"""Dynamic micro-batches collated for Megatron-Bridge equal, key for key, what the installed
Bridge's own unpacked chat collate (``GPTSFTChatDataset.collate_fn``) returns for the same
sequences padded to the same width (``pad_to_max_length`` at the planned width).

The collate is Bridge's real method on a ``GPTSFTChatDataset`` whose constructor (a tokenizer and
a JSONL file) is skipped: only the attributes the collate reads are set.
"""

import numpy as np
import pytest
import torch

from support.shardgen import random_packs, write_shard

from megatron.bridge.data.datasets.gpt_sft import GPTSFTChatDataset

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.batching import DynamicCollator, SequenceDataset, plan_dynamic

EOS = 5


def bridge_collate(width, attention_mask):
    ds = GPTSFTChatDataset.__new__(GPTSFTChatDataset)
    ds.tokens_to_generate = 0
    ds.max_seq_length = width
    ds.pad_to_max_length = True
    ds.ceil_to_power_2 = False
    ds.pad_seq_length_to_mult = 16
    ds.get_attention_mask_from_fusion = not attention_mask
    ds.tokenizer = type("Tok", (), {"eos_id": EOS})()
    return ds.collate_fn


def bridge_item(pack):
    """Bridge's processed chat example for one stored sequence: its mask is token-aligned (1 on a
    trained token), ours label-aligned (1 on the position that predicts a trained token)."""
    ids = torch.as_tensor(pack.input_ids.astype(np.int64))
    mask = torch.zeros(ids.shape[0], dtype=torch.bool)
    mask[1:] = torch.as_tensor(pack.loss_mask[:-1].astype(bool))
    cut = max(1, ids.shape[0] // 2)
    return {"input_ids": ids, "loss_mask": mask, "context_ids": ids[:cut], "answer_ids": ids[cut:], "metadata": {}}


@pytest.mark.parametrize("attention_mask", [False, True])
def test_dynamic_bridge_batches_equal_bridges_chat_collate(tmp_path, attention_mask):
    prefix = str(tmp_path / "seqs")
    write_shard(prefix, random_packs(np.random.default_rng(3), 60, pack_size=64, max_seqs=1), pack_size=None)
    source = MMapIndexedDataset(prefix)
    plan = plan_dynamic(source.sequence_lengths, global_batch_size=12, data_parallel_size=2,
                        max_tokens_per_microbatch=160, sequence_length_round=16, seed=4)
    ours = DynamicCollator("bridge", pad_id=EOS, get_attention_mask_from_fusion=not attention_mask)
    dataset = SequenceDataset(source)
    checked = 0
    for rank in range(2):
        for _, ids, width in plan.iter_rank(rank):
            got = ours([dataset[(int(i), width)] for i in ids])
            theirs = bridge_collate(width, attention_mask)([bridge_item(source[int(i)]) for i in ids])
            train_keys = {"tokens", "labels", "loss_mask", "position_ids"} | ({"attention_mask"} if attention_mask
                                                                               else set())
            assert set(got) == train_keys and train_keys <= set(theirs)
            for key in train_keys:
                assert got[key].dtype == theirs[key].dtype, key
                assert torch.equal(got[key], theirs[key]), key
            checked += 1
    assert checked >= 4
