"""One data-parallel rank of tests/compat/test_megatron_lm.py::test_torchrun_four_ranks (gloo, CPU).

Builds the blend with megatron-core's BlendedMegatronDatasetBuilder (rank 0 builds and caches
the indices, the others load the cache: a cache miss on those ranks raises), then reads this
rank's slice of one epoch through Megatron's pretraining sampler, and writes which samples it
saw (index and token checksum) to OUT/rank<r>.json. With Megatron-Bridge installed, also reads
the Bridge datasets (bridge_datasets) through Bridge's own sampler and collate.
"""

import json
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_cpu  # noqa: E402,F401

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402

from megatron_sft_idx.training import megatron as M  # noqa: E402


def sampler_class():
    """Megatron-LM's pretraining sampler: megatron/training (in the core wheel >= 0.17), else Bridge's
    copy; megatron-core 0.16.1 ships neither, so this rank uses torch's DistributedSampler there."""
    try:
        from megatron.training.datasets.data_samplers import MegatronPretrainingSampler
        return MegatronPretrainingSampler
    except ImportError:
        return None


def main(out, blend, samples):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:  # the index cache written by rank 0 must be reused, never recomputed
        def miss(self):
            raise AssertionError(f"rank {rank}: sample index cache miss")
        M.SFTIndexedDataset._compute_sample_index = miss
    cfg = M.SFTIndexedDatasetConfig(random_seed=7, sequence_length=64, blend=M.parse_data_path(blend),
                                    split="100,0,0", path_to_cache=os.path.join(out, "cache"), tokenizer=None)
    train, _, _ = BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [samples, 0, 0], lambda: True,
                                                cfg).build()
    seen = {}
    cls = sampler_class()
    if cls is not None:
        batches = iter(cls(total_samples=len(train), consumed_samples=0, micro_batch_size=2,
                           data_parallel_rank=rank, data_parallel_size=world, drop_last=True))
        sampler = "megatron.training.datasets.data_samplers.MegatronPretrainingSampler"
    else:
        ds = torch.utils.data.DistributedSampler(range(len(train) // (2 * world) * (2 * world)),
                                                 num_replicas=world, rank=rank, shuffle=False, drop_last=True)
        order = list(ds)
        batches = (order[i:i + 2] for i in range(0, len(order), 2))
        sampler = "torch.utils.data.DistributedSampler"
    for batch in batches:
        for i in batch:
            seen[int(i)] = zlib.crc32(train[int(i)]["tokens"].numpy().tobytes())
    result = {"rank": rank, "sampler": sampler, "seen": seen, "length": len(train)}
    try:
        from megatron.bridge.data.samplers import MegatronPretrainingSampler as BridgeSampler
    except ImportError:
        BridgeSampler = None
    if BridgeSampler is not None:
        from types import SimpleNamespace

        from megatron_sft_idx.training.bridge import bridge_datasets

        first = blend.split()[1]
        bridge_train, _, _ = bridge_datasets(SimpleNamespace(train_samples=samples, valid_samples=0,
                                                             test_samples=0, tokenizer=None),
                                             train=first, eos_id=1, pad_to_max_length=True)
        got = {}
        for batch in BridgeSampler(len(bridge_train), 0, 2, rank, world):
            out_batch = bridge_train.collate_fn([bridge_train[i] for i in batch])
            for row, i in enumerate(batch):
                got[int(i)] = zlib.crc32(out_batch["tokens"][row].numpy().tobytes())
        result["bridge_seen"] = got
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
