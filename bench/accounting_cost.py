"""What per-record accounting costs, before and after a change, measured in one run.

Accounting (docs/INPUTS.md, "Every field accounted for") is the mapping's account of every
record-level key (:func:`~megatron_sft_idx.preprocess.records.shapes.account_keys`) and the
read-back of every rendering for tool definitions and tool-call arguments the source does not
hold (:func:`~megatron_sft_idx.preprocess.records.accounting.check_rendered_tools`). Its cost is
the whole one-worker pipeline (tokenize, plan, write) with both, against the same tree with both
replaced by no-ops, in CPU-seconds. Two trees are measured the same way in alternation: this
one (``after``) and ``--baseline-ref`` exported with ``git archive`` (``before``), so the two
ratios come from the same machine under the same load. The corpus is :mod:`bench.tool_corpus`
(every record tool calling or reasoning: accounting's worst case), or with ``--corpus example``
the example generator's plain chat (where accounting should cost nothing).

    python -m bench.accounting_cost                          # 8000 conversations, 5 rounds
    python -m bench.accounting_cost --baseline-ref main --count 6000 --rounds 7
    python -m bench.accounting_cost --corpus example --count 20000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench._common import ROOT, format_table, run_child, write_json
from bench.preprocess_speed import _cpu_s, export_baseline

BASELINE_REF = "main"


def _no_accounting() -> None:
    """Replace the key account and the read-back with no-ops, where the pipeline calls them."""
    from megatron_sft_idx.preprocess.records import rendering, shapes

    rendering.check_rendered_tools = lambda *args, **kwargs: None
    shapes.account_keys = lambda *args, **kwargs: None


def child_run(tree: str, path: str, tokenizer: str, out: str, accounting: bool) -> dict:
    """The pipeline from ``tree`` ('' = this tree), one worker, with or without accounting."""
    if tree:
        sys.path.insert(0, tree)
    import megatron_sft_idx.preprocess as entry

    if tree and not entry.__file__.startswith(tree):
        raise RuntimeError(f"imported {entry.__file__}, not the baseline under {tree}")
    if not accounting:
        _no_accounting()
    cpu0, t = _cpu_s(), time.perf_counter()
    s = entry.run(entry.Config(inputs=[path], output_prefix=out, tokenizer=tokenizer, pack_size=4096,
                               workers=1, progress=False, overwrite=True))
    return {"cpu_s": _cpu_s() - cpu0, "wall_s": time.perf_counter() - t, "tokens": s["tokens"],
            "conversations": s["conversations"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=8000, help="conversations (default: 8000)")
    p.add_argument("--rounds", type=int, default=5, help="runs of each system, in alternation (default: 5)")
    p.add_argument("--baseline-ref", default=BASELINE_REF, help=f"git ref of 'before' (default: {BASELINE_REF})")
    p.add_argument("--corpus", choices=("tools", "example"), default="tools",
                   help="tools: bench.tool_corpus (the worst case); example: plain chat (default: tools)")
    return p


def main(argv=None) -> int:
    from bench.preprocess_speed import make_corpus

    args = build_parser().parse_args(argv)
    systems = (("before", "base"), ("after", ""))
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        os.makedirs(base)
        export_baseline(args.baseline_ref, base)
        native = os.path.join(ROOT, "megatron_sft_idx", "_native")   # (built, not in git): the same in both
        if os.path.isdir(native):
            shutil.copytree(native, os.path.join(base, "megatron_sft_idx", "_native"), dirs_exist_ok=True)
        path, tok, desc = make_corpus(args.corpus, os.path.join(tmp, f"{args.corpus}.jsonl"), args.count, tmp)
        runs = {f"{name}_{on}": [] for name, _ in systems for on in ("on", "off")}
        for round_ in range(args.rounds + 1):   # the first round warms numba's caches: not counted
            flip = round_ % 2 == 0   # (each order as often: no bias by position)
            for name, tree in systems[::-1] if flip else systems:
                for on in ("off", "on") if flip else ("on", "off"):
                    r = run_child("bench.accounting_cost:child_run", tree=base if tree else "", path=path,
                                  tokenizer=tok, out=os.path.join(tmp, f"{name}_{on}"), accounting=on == "on")
                    runs[f"{name}_{on}"].append(r)
        results = {"count": args.count, "rounds": args.rounds, "baseline_ref": args.baseline_ref,
                   "corpus": f"{args.corpus}: {desc}", "systems": {}}
        rows = []
        for name, _ in systems:
            on = statistics.median(r["cpu_s"] for r in runs[f"{name}_on"][1:])
            off = statistics.median(r["cpu_s"] for r in runs[f"{name}_off"][1:])
            tokens = {r["tokens"] for r in runs[f"{name}_on"] + runs[f"{name}_off"]}
            if len(tokens) != 1:
                raise SystemExit(f"{name}: runs with and without accounting wrote different token counts {tokens}")
            results["systems"][name] = {"cpu_s_on": on, "cpu_s_off": off, "cost": on / off - 1,
                                        "tokens": tokens.pop(), "runs": runs[f"{name}_on"] + runs[f"{name}_off"]}
            rows.append([name, args.baseline_ref if name == "before" else "this tree", off, on,
                         f"{100 * (on / off - 1):+.1f}%"])
    print(format_table(["system", "tree", "CPU-s, no accounting", "CPU-s, accounting", "cost"], rows))
    print("wrote", write_json("accounting_cost" if args.corpus == "tools" else f"accounting_cost_{args.corpus}", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
