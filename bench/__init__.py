"""Benchmarks of megatron_sft_idx side by side with the formats users have today.

Entry points (each ``python -m bench.<name> --help``; JSON goes to ``bench/results/``):

- ``bench.compare``      one corpus, every format: write, open, random and sequential reads.
- ``bench.scale``        open time, RSS after open and random reads from 10k to 1M+ packs (PNG).
- ``bench.offsets``      lengths -> byte pointers: numba kernel vs upstream's Python loop.
- ``bench.builder_rss``  writer peak RSS / Python heap for 100k vs 1M packs and the RFC test.

Every measurement that touches memory runs in a fresh subprocess (``bench._common``),
and every table reports ratios against the peers measured in the same run, because
absolute numbers on a shared machine are noisy.
"""
