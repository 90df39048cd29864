#!/usr/bin/env python3
"""Packed shards as a Megatron-Bridge dataset, built and batched as Bridge's training does it.

After ``make demo`` (or with ``--train`` naming your shards)::

    python examples/bridge_sft.py
    python examples/bridge_sft.py --train s3://bucket/sft/chat_train.json --seq-length 4096

In a Bridge recipe the provider is all you write; Bridge makes the context and the loader::

    cfg.dataset = PackedSFTDatasetProvider(train_path=..., seq_length=cfg.model.seq_length, ...)
    finetune(cfg, forward_step)

Here, outside Bridge's training, this script does Bridge's part: it makes the
``DatasetBuildContext`` (the sample counts Bridge derives from ``train_iters`` x the global
batch size and the eval settings, and the tokenizer; None here, so the EOS id is given) and
the loader, with Bridge's own ``build_pretraining_data_loader`` when Megatron-Bridge imports
in this Python, else a torch ``DataLoader`` with the same ``collate_fn`` (the batches are the
same). docs/TRAINING.md has the install and the recipe.
"""

import argparse

import torch

from megatron_sft_idx.training import bridge_provider
from megatron_sft_idx.training.bridge_provider import PackedSFTDatasetProvider, build_context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", default="out/demo/training/example", help="shards for training")
    parser.add_argument("--valid", default=None, help="shards for validation (default: none)")
    parser.add_argument("--seq-length", type=int, default=2048, help="Bridge's packed sequence size")
    parser.add_argument("--samples", type=int, default=64, help="training samples Bridge would ask for")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--eos-id", type=int, default=2, help="the tokenizer's EOS id (the demo's is 2)")
    args = parser.parse_args()

    provider = PackedSFTDatasetProvider(
        train_path=args.train, valid_path=args.valid, seq_length=args.seq_length, eos_id=args.eos_id,
        pad_to_max_length=True,   # one static shape per batch
        pad_cu_seqlens=True,      # and static boundaries: what CUDA graphs need
        num_workers=0)
    context = build_context(train_samples=args.samples, valid_samples=args.global_batch_size if args.valid else 0)
    train, valid, test = provider.build_datasets(context)

    if bridge_provider.BRIDGE_IMPORT_ERROR is None:
        from megatron.bridge.data.samplers import build_pretraining_data_loader

        print(f"Megatron-Bridge {bridge_provider.BRIDGE_VERSION}: the provider is a Bridge DatasetProvider")
        loader = build_pretraining_data_loader(
            train, consumed_samples=0, dataloader_type=provider.dataloader_type, micro_batch_size=1,
            num_workers=provider.num_workers, data_sharding=provider.data_sharding, collate_fn=train.collate_fn,
            pin_memory=False, persistent_workers=False, data_parallel_rank=0, data_parallel_size=1,
            drop_last=provider.drop_last, global_batch_size=args.global_batch_size, seed=provider.seed)
    else:
        print(f"without Megatron-Bridge ({bridge_provider.BRIDGE_IMPORT_ERROR}): a torch DataLoader")
        loader = torch.utils.data.DataLoader(train, batch_size=1, collate_fn=train.collate_fn)

    print(f"samples: train {len(train)}, valid {len(valid) if valid else 0}, test {len(test) if test else 0}")
    batch = next(iter(loader))
    for key, value in batch.items():
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
        print(f"  {key:<16} {shape}")
    print(f"first batch: packs {len(batch['token_count'])}, tokens {sum(batch['token_count'])}, "
          f"trained {int(batch['loss_mask'].sum())}")


if __name__ == "__main__":
    main()
