"""The reader in torch DataLoader workers: each worker maps the files itself, every pack once per epoch."""

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_sft_idx import MMapIndexedDataset
from support.shardgen import random_packs, write_shard


class PackIndexDataset(Dataset):
    """Returns (index, tokens, loss mask, sequence count, worker id): what each worker read, and who."""

    def __init__(self, prefix):
        self.packs = MMapIndexedDataset(prefix)

    def __len__(self):
        return len(self.packs)

    def __getitem__(self, i):
        pack = self.packs[i]
        return (i, torch.from_numpy(pack.input_ids.astype(np.int64)), torch.from_numpy(pack.loss_mask.copy()),
                len(pack.seq_start_id), torch.utils.data.get_worker_info().id)


def reopen_by_pickle(worker_id):
    """What a spawn-started worker receives: the reader rebuilt from its pickled prefix (cheaper
    to test here than paying a spawned interpreter per worker)."""
    dataset = torch.utils.data.get_worker_info().dataset
    dataset.packs = pickle.loads(pickle.dumps(dataset.packs))
    if dataset.packs.is_mapped:
        raise AssertionError("a pickled reader must arrive without maps")


def collate(batch):
    return batch


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
def test_dataloader_workers_return_every_pack_once_per_epoch(tmp_path, rng):
    prefix = str(tmp_path / "s")
    packs = random_packs(rng, 203, pack_size=32)
    write_shard(prefix, packs, pack_size=32)
    dataset = PackIndexDataset(prefix)
    dataset.packs[0]  # the parent has mapped the files; pickled copies must arrive without the maps
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=4, persistent_workers=True,
                        collate_fn=collate, worker_init_fn=reopen_by_pickle,
                        generator=torch.Generator().manual_seed(0))
    for epoch in range(2):
        seen, workers = [], set()
        for batch in loader:
            for i, ids, loss, n_seq, worker in batch:
                seen.append(i)
                workers.add(worker)
                np.testing.assert_array_equal(ids.numpy(), packs[i][0])
                np.testing.assert_array_equal(loss.numpy(), packs[i][1])
                assert n_seq == len(packs[i][2])
        assert sorted(seen) == list(range(len(packs))), f"epoch {epoch}"
        assert workers == {0, 1, 2, 3}
    assert loader._iterator is not None and loader._iterator._persistent_workers
