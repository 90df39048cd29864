"""Label-balanced steps against a seeded shuffle, and what each trainer's loss rule does to them.

Two corpora, written as real shards (their loss masks are what is counted):

* **sft-mixture**: ``bench/corpus.py``'s packed SFT mixture (30,000 packs of 4,096 tokens by
  default: short chat turns, instructions, a long tail of code/math/reasoning; each sequence a
  prompt then a response, the split uniform in 10-70 %);
* **chat**: ``bench/chat_corpus.py``'s multi-turn conversations of real text (1-8 turns, loss on
  the assistant answers, a Llama-3-style template over a production tokenizer, see there),
  through ``preprocess-sft`` at 4,096 tokens, padded for CP 2 (``--pad-seq-to-mult 4``).

Per corpus and topology (DP, micro-batch, global batch) and order -- the adapters' seeded
shuffle, the cost-balanced order (membership unchanged), label-balanced steps (window 1:
membership unchanged; window 8: steps trade packs) and, for a fair comparison, the cost-only
order with the same window -- it reports the predicted straggler overhead (``max rank cost /
mean - 1``, llama3-8b FLOPs), the trained tokens' coefficient of variation over steps, their
spread ``(max - min) / mean`` over the ranks and over the micro-batches of each step, and what
two rules that normalise per rank or per micro-batch make of them (the audit's mean ``|w N -
1|``: ``transformers:per-device``, ``megatron-lm:per-micro-batch``); planning CPU seconds. Then
the full audit (``plan-batches --audit``) of the chat corpus at DP 8, micro-batch 4, CP 2.

    python -m bench.labels                 # both corpora (a few minutes)
    python -m bench.labels --quick         # small sizes, for a smoke run
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
from typing import Dict, List

from bench._common import format_table, write_json

TOPOLOGIES = ((8, 1, 128), (64, 1, 512), (8, 4, 256))
ORDERS = (("shuffle", dict(algorithm="shuffle")), ("balanced", {}), ("labels", dict(balance_labels=True)),
          ("balanced, window 8", dict(exchange_window=8)),
          ("labels, window 8", dict(balance_labels=True, exchange_window=8)))
RULES = ("transformers:per-device", "megatron-lm:per-micro-batch")


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def mixture_shard(directory: str, packs: int) -> str:
    """``bench/corpus.py``'s mixture as one shard (the corpus is reused when it exists)."""
    from bench.corpus import Corpus
    from megatron_sft_idx import IndexedDatasetBuilder, MMapIndexedDataset

    prefix = os.path.join(directory, "mixture")
    if not MMapIndexedDataset.exists(prefix):
        corpus = Corpus.generate(os.path.join(directory, "mixture_raw"), packs, 4096, 32000, 1234)
        with IndexedDatasetBuilder(prefix, pack_size=4096, vocab_size=32000) as b:
            for ids, loss, starts in corpus.iter_packs():
                b.add_packed(ids, loss, starts)
    return prefix


def chat_shard(directory: str, conversations: int) -> tuple:
    """The chat corpus through preprocess-sft (4,096-token packs, padded for CP 2); (prefix, tokenizer)."""
    from bench.chat_corpus import production_tokenizer, write_corpus
    from megatron_sft_idx.preprocess import Config, run

    tokenizer, description = production_tokenizer(os.path.join(directory, "tok"))
    data = write_corpus(os.path.join(directory, "chat.jsonl"), conversations)
    prefix = os.path.join(directory, "chat")
    run(Config(inputs=[data], output_prefix=prefix, tokenizer=tokenizer, pack_size=4096, pad_seq_to_mult=4,
               progress=False, overwrite=True))
    return prefix, description


def measure(prefix: str, topology, epochs: int) -> List[dict]:
    """One row per order: straggler, trained-token evenness, two rules' deviation, CPU seconds."""
    from megatron_sft_idx import MMapIndexedDataset
    from megatron_sft_idx.batching import CostModel, Topology, plan_order, shard_pack_costs
    from megatron_sft_idx.batching.audit import audit_order
    from megatron_sft_idx.batching.report import straggler_report, trained_summary
    from megatron_sft_idx.batching.trained import STORED, trained_counts

    ds = MMapIndexedDataset(prefix)
    model = CostModel.from_preset("llama3-8b")
    costs, counts = shard_pack_costs(ds, model), trained_counts(ds)
    topo = Topology(*topology)
    rows = []
    for name, kw in ORDERS:
        cpu = _cpu_s()
        order = plan_order(costs, topo, model, seed=1234, epochs=epochs, trained=counts, **kw)
        cpu = _cpu_s() - cpu
        strag = straggler_report(order.permutations.reshape(-1), costs, topo).summary
        even = trained_summary(order.step_trained(STORED))
        audit = {r.rule.name: r.summary() for r in audit_order(order, counts)}
        rows.append({"order": name, "plan_cpu_s": cpu, "straggler": strag, "trained": even,
                     "rules": {k: audit[k] for k in RULES}})
    return rows


def table(rows: List[dict]) -> str:
    head = ["order", "straggler mean %", "p99 %", "step CV %", "rank spread mean %", "max %",
            "micro-batch spread %", "per-device rule %", "per-micro-batch rule %", "plan CPU s"]
    return format_table(head, [[r["order"], 100 * r["straggler"]["mean"], 100 * r["straggler"]["p99"],
                                100 * r["trained"]["step_cv"], 100 * r["trained"]["rank_spread_mean"],
                                100 * r["trained"]["rank_spread_max"], 100 * r["trained"]["microbatch_spread_mean"],
                                100 * r["rules"][RULES[0]]["mean_dev"], 100 * r["rules"][RULES[1]]["mean_dev"],
                                r["plan_cpu_s"]] for r in rows])


def full_audit(prefix: str, epochs: int) -> str:
    """The text ``plan-batches --audit`` prints at DP 8, micro-batch 4, global batch 256, CP 2."""
    import contextlib
    import io

    from megatron_sft_idx.tools.plan_batches_cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([prefix, "--balance-for", "8,4,256", "--cp", "2", "--audit", "--balance-epochs", str(epochs)])
    if code:
        raise RuntimeError(f"plan-batches --audit exited {code}")
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--packs", type=int, default=30000, help="packs of the sft-mixture corpus (default 30000)")
    p.add_argument("--conversations", type=int, default=40000, help="chat conversations (default 40000)")
    p.add_argument("--epochs", type=int, default=3, help="epochs planned (default 3)")
    p.add_argument("--work", help="keep the corpora here (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="small sizes, one topology (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.packs, args.conversations, args.epochs = 1200, 3000, 1
    work = args.work or tempfile.mkdtemp(prefix="bench-labels-")
    os.makedirs(work, exist_ok=True)
    corpora = {"sft-mixture": mixture_shard(work, args.packs)}
    corpora["chat"], tokenizer = chat_shard(work, args.conversations)
    topologies = TOPOLOGIES[:1] + TOPOLOGIES[2:] if args.quick else TOPOLOGIES
    results: Dict[str, dict] = {"tokenizer": tokenizer, "epochs": args.epochs, "corpora": {}}
    for corpus, prefix in corpora.items():
        from megatron_sft_idx import MMapIndexedDataset

        results["corpora"][corpus] = {"packs": len(MMapIndexedDataset(prefix)), "topologies": []}
        for topo in topologies:
            rows = measure(prefix, topo, args.epochs)
            results["corpora"][corpus]["topologies"].append({"topology": list(topo), "orders": rows})
            print(f"\n{corpus}: {results['corpora'][corpus]['packs']:,} packs, DP {topo[0]}, micro-batch {topo[1]}, "
                  f"global batch {topo[2]}, {args.epochs} epoch(s)")
            print(table(rows))
    audit = full_audit(corpora["chat"], args.epochs)
    results["audit_chat_dp8_mbs4_cp2"] = audit
    print("\nplan-batches --audit, chat corpus, DP 8, micro-batch 4, global batch 256, CP 2:\n" + audit)
    print(f"results: {write_json('labels', results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
