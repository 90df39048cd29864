"""One data-parallel rank of tests/compat/test_batching_torchrun.py (gloo, CPU).

Loads a balanced order file, wraps the shard in ``OrderedDataset`` and reads this rank's
micro-batches from ``consumed_samples`` on through the stock loaders, recording a CRC-32 of
every pack (or collated row) it receives, micro-batch by micro-batch:

* ``megatron``: Megatron-LM's ``MegatronPretrainingSampler`` (``dataloader_type="single"``,
  ``megatron/training/datasets/data_samplers.py``) in a DataLoader with two workers;
* ``bridge_single``: Megatron-Bridge's ``build_pretraining_data_loader(..., "single", ...)`` over
  Bridge-style ``PackedSFTDataset`` (its collate);
* ``bridge_batch``: the same with ``dataloader_type="batch"`` (Bridge's SFT default), which
  re-shuffles: the negative control;
* ``mlm_door``: the Megatron-LM door itself: ``SFTIndexedDataset`` with ``pack_order_file`` (the
  order file), built by megatron-core's ``BlendedMegatronDatasetBuilder`` in every rank, read by
  ``MegatronPretrainingSampler``: a CRC-32 of each sample's ``tokens``.

Usage: batching_worker.py OUT ORDER SHARD NUM_SAMPLES CONSUMED MICRO_BATCH GLOBAL_BATCH
"""

import json
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_cpu  # noqa: E402,F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.bridge.data.samplers import build_pretraining_data_loader  # noqa: E402
from megatron.training.datasets.data_samplers import MegatronPretrainingSampler  # noqa: E402

from megatron_sft_idx import MMapIndexedDataset  # noqa: E402
from megatron_sft_idx.batching import Order, OrderedDataset, Topology  # noqa: E402
from megatron_sft_idx.training.bridge import PackedSFTDataset  # noqa: E402


def pack_crcs(packs):
    return [zlib.crc32(p.input_ids.tobytes()) for p in packs]


def row_crcs(batch):
    return [zlib.crc32(row.numpy().tobytes()) for row in batch["tokens"]]


def main(out, order_path, shard, num_samples, consumed, mbs, gbs):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    order = Order.load(order_path)
    topology = Topology(world, mbs, gbs)
    result = {"rank": rank}

    packs = OrderedDataset.from_order(MMapIndexedDataset(shard), order, num_samples, topology=topology)
    sampler = MegatronPretrainingSampler(total_samples=len(packs), consumed_samples=consumed, micro_batch_size=mbs,
                                         data_parallel_rank=rank, data_parallel_size=world)
    loader = torch.utils.data.DataLoader(packs, batch_sampler=sampler, num_workers=2, collate_fn=pack_crcs)
    result["megatron"] = list(loader)

    bridge = PackedSFTDataset(shard, eos_id=0, pad_to_max_length=True)
    for kind in ("single", "batch"):
        ds = OrderedDataset.from_order(bridge, order, num_samples, topology=topology)
        loader = build_pretraining_data_loader(ds, consumed, kind, mbs, 2, False, collate_fn=ds.collate_fn,
                                               data_parallel_rank=rank, data_parallel_size=world,
                                               global_batch_size=gbs, seed=1234)
        batches = [row_crcs(b) for b in loader]
        if kind == "batch":  # one global batch's share at once: split it into micro-batches as Bridge's loop does
            batches = [rows[i:i + mbs] for rows in batches for i in range(0, len(rows), mbs)]
        result[f"bridge_{kind}"] = batches
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron_sft_idx.training import megatron as M

    cfg = M.SFTIndexedDatasetConfig(random_seed=order.seed, sequence_length=64, blend=M.parse_data_path(shard),
                                    split="100,0,0", path_to_cache=None, tokenizer=None, pack_order_file=order_path,
                                    data_parallel_size=world, micro_batch_size=mbs, global_batch_size=gbs)
    train = BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [num_samples, 0, 0], lambda: True, cfg).build()[0]
    sampler = MegatronPretrainingSampler(total_samples=len(train), consumed_samples=consumed, micro_batch_size=mbs,
                                         data_parallel_rank=rank, data_parallel_size=world)
    loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, num_workers=2, collate_fn=lambda samples: [
        zlib.crc32(s["tokens"].numpy().tobytes()) for s in samples])
    result["mlm_door"] = list(loader)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8]))
