#!/usr/bin/env python3
"""Packed shards trained with Hugging Face TRL (padding-free), or any transformers Trainer.

After ``make demo`` (or with ``--train`` naming your shards, local or ``s3://``)::

    python examples/trl_sft.py
    python examples/trl_sft.py --train s3://bucket/sft/chat_train.json --trainer transformers

It trains a tiny model built from a config (a 2-layer Llama, nothing downloaded) for a few
steps on the CPU. With TRL, the shards' packs are TRL's own packed rows and TRL's collator
flattens them (``padding_free=True``, no dataset preparation); with a transformers
``Trainer``, :class:`~megatron_sft_idx.training.hf.PaddingFreeCollator` does the same.
``--balanced-order auto`` serves the order planned beside the data (docs/BATCHING.md).
docs/TRAINING.md has the details.

Memory: the model's float32 logits are ``batch size x tokens per row x vocabulary x 4`` bytes,
and the loss holds about as much again for their gradient. Packs of 4,096 tokens, two per batch
and a 151,936-token vocabulary (Qwen's) make 5.0 GB of logits alone, so ``--max-length`` (default 1024)
keeps the first N tokens of each pack (whole sequences, then the start of the one it cuts):
1.2 GB of logits for that vocabulary; ``--max-length 0`` trains whole packs. With the bundled
1k-vocabulary tokenizer it does not matter. The cut is for trying the wiring on a CPU; a real
run packs to the length it trains (``preprocess-sft --pack-size``).
"""

import argparse
import os

HERE = os.path.dirname(os.path.abspath(__file__))


class Cut:
    """The rows of a ``PaddingFreeDataset`` cut to their first ``n`` tokens (``seq_lengths``
    shortened to match: the sequences that end within them, then the part of the one cut)."""

    def __init__(self, dataset, n: int) -> None:
        self.dataset, self.n = dataset, n

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i) -> dict:
        row = dict(self.dataset[i])
        total, lengths = 0, []
        for length in row["seq_lengths"]:
            if total >= self.n:
                break
            lengths.append(min(length, self.n - total))
            total += lengths[-1]
        row["seq_lengths"] = lengths
        for key in ("input_ids", "labels", "position_ids", "source_ids"):
            if key in row:
                row[key] = row[key][:self.n]
        return row

    def as_iterable_dataset(self):
        import datasets   # (the [hf] extra: only for TRL's trainer)

        def rows():
            for i in range(len(self)):
                yield self[i]

        return datasets.IterableDataset.from_generator(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", default="out/demo/training/example", help="shards for training")
    parser.add_argument("--tokenizer", default=os.path.join(HERE, "tokenizer"), help="tokenizer directory")
    parser.add_argument("--trainer", choices=("trl", "transformers"), default="trl")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=2, help="packs per device batch")
    parser.add_argument("--balanced-order", default=None, help="an order file, or 'auto'")
    parser.add_argument("--seed", type=int, default=1234, help="the run's data seed")
    parser.add_argument("--out", default="out/trl_sft", help="output directory of the trainer")
    parser.add_argument("--max-length", type=int, default=1024, metavar="N",
                        help="tokens of each pack trained (its first N; default 1024; 0 = whole packs): logits "
                             "take batch x N x vocabulary x 4 bytes")
    args = parser.parse_args(argv)
    if args.max_length < 0:
        parser.error("--max-length must be >= 0")
    if args.max_length and args.balanced_order:
        parser.error("--balanced-order counts each step's trained tokens over whole packs: use --max-length 0")

    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from megatron_sft_idx.training.hf import PaddingFreeCollator, PaddingFreeDataset, check_training_args

    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    # Without an order: Bridge's seeded samples mapping (a permutation per epoch) as the row order.
    samples = None if args.balanced_order else args.steps * args.batch_size
    dataset = PaddingFreeDataset(args.train, balanced_order=args.balanced_order, seed=args.seed,
                                 max_num_samples=samples)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    rows = Cut(dataset, args.max_length) if args.max_length else dataset
    common = dict(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                  learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                  seed=args.seed, train_sampling_strategy="sequential" if dataset.ordered else "random")
    if args.trainer == "trl":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(padding_free=True, max_length=None, dataset_kwargs={"skip_prepare_dataset": True},
                           **common)
        check_training_args(dataset, config)
        trainer = SFTTrainer(model=model, args=config, train_dataset=rows.as_iterable_dataset(),
                             processing_class=tokenizer)
    else:
        from transformers import Trainer, TrainingArguments

        config = TrainingArguments(**common)
        check_training_args(dataset, config)
        trainer = Trainer(model=model, args=config, train_dataset=rows,
                          data_collator=PaddingFreeCollator(tokenizer.pad_token_id))
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"trained {result.global_step} steps on {len(dataset)} packs"
          + (f" (their first {args.max_length} tokens)" if args.max_length else "") + "; loss per step: "
          + ", ".join(f"{x:.3f}" for x in losses))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
