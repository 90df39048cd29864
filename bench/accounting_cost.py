"""What per-record accounting costs, before and after a change, measured in one run.

Accounting (docs/INPUTS.md, "Every field accounted for") is the mapping's account of every
record-level key (:func:`~megatron_sft_idx.preprocess.records.shapes.account_keys`) and the
read-back of every rendering for tool definitions and tool-call arguments the source does not
hold (:func:`~megatron_sft_idx.preprocess.records.accounting.check_rendered_tools`). Its cost is
the whole one-worker pipeline (read, map, render, tokenize, plan, write) with both, against the
same pipeline with both replaced by no-ops, in CPU-seconds (the encoder still queues each
record's read-back, a tuple appended, and makes the queue of no-ops: well under 0.1%).

Each tree runs in one process that imports once, warms up (numba's caches, the tokenizer), then
runs the pipeline ``--rounds`` times each way, alternating: the cost is the median of the paired
differences (with minus without) over the median without. Measured so, a process's start (about
1.7 CPU-seconds of imports and loading, paid once however large the corpus) is not in the
denominator, and two runs of a pair share the process's layout and hash seed. Two trees are
measured: this one (``after``) and ``--baseline-ref`` exported with ``git archive``
(``before``), their processes in alternation, so both ratios come from the same machine under the
same load. The read-back's own CPU time inside the pipeline (its thread's clock, around each
call) is reported beside, as the part of the cost that is the function itself.

Corpora (:func:`bench.preprocess_speed.make_corpus`): ``tools`` (:mod:`bench.tool_corpus`, every
record calling tools or reasoning, each with tools never seen before: the worst case),
``pool`` (the same shapes with every record's tools drawn from a catalogue, as public sets are),
``example`` (plain chat, where accounting should cost nothing).

    python -m bench.accounting_cost                           # tools and pool, 6000 conversations
    python -m bench.accounting_cost --corpora tools --baseline-ref main~3 --rounds 12
    python -m bench.accounting_cost --corpora example --count 20000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench._common import ROOT, chosen_corpora, format_table, run_child, write_json
from bench.preprocess_speed import export_baseline

BASELINE_REF = "main"
CORPORA = ("tools", "pool", "example")


def _keys_caller():
    """The module that calls ``account_keys``: the one ``map_record`` lives in
    (``records.shapes.registry``; ``records.shapes`` itself in a tree from before the shapes were
    a package, as the baseline may be)."""
    from megatron_sft_idx.preprocess.records import shapes

    return sys.modules[shapes.map_record.__module__]


def _no_accounting() -> None:
    """Replace the key account and the read-back with no-ops, where the pipeline calls them."""
    from megatron_sft_idx.preprocess.records import rendering

    rendering.check_rendered_tools = lambda *args, **kwargs: None
    _keys_caller().account_keys = lambda *args, **kwargs: None


def child_run(tree: str, path: str, tokenizer: str, out: str, rounds: int) -> dict:
    """The pipeline from ``tree`` ('' = this tree), one worker, ``rounds`` times with accounting
    and without, alternating, in this one process after a warm-up of each."""
    if tree:
        sys.path.insert(0, tree)
    import megatron_sft_idx.preprocess as entry
    from megatron_sft_idx.preprocess.records import rendering

    if tree and not entry.__file__.startswith(tree):
        raise RuntimeError(f"imported {entry.__file__}, not the baseline under {tree}")
    caller = _keys_caller()
    check, keys = rendering.check_rendered_tools, caller.account_keys
    inside = [0.0]

    def timed_check(*args, **kwargs):
        t = time.thread_time()
        try:
            return check(*args, **kwargs)
        finally:
            inside[0] += time.thread_time() - t

    def once(on: bool) -> dict:
        if on:
            rendering.check_rendered_tools, caller.account_keys = timed_check, keys
        else:
            _no_accounting()
        inside[0] = 0.0
        cpu0 = time.process_time()
        s = entry.run(entry.Config(inputs=[path], output_prefix=out, tokenizer=tokenizer, pack_size=4096,
                                   workers=1, progress=False, overwrite=True))
        return {"cpu_s": time.process_time() - cpu0, "check_s": inside[0], "tokens": s["tokens"],
                "conversations": s["conversations"]}

    once(True), once(False)   # warm-up: not counted
    runs = {"on": [], "off": []}
    for r in range(rounds):
        for on in (True, False) if r % 2 else (False, True):   # (each order as often)
            runs["on" if on else "off"].append(once(on))
    return runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=6000, help="conversations (default: 6000)")
    p.add_argument("--rounds", type=int, default=8, help="runs each way per tree (default: 8)")
    p.add_argument("--processes", type=int, default=2,
                   help="processes per tree, in alternation with the other tree's; rounds are split "
                        "among them (default: 2)")
    p.add_argument("--baseline-ref", default=BASELINE_REF, help=f"git ref of 'before' (default: {BASELINE_REF})")
    p.add_argument("--corpora", default="tools,pool", help=f"comma-separated, of {', '.join(CORPORA)} "
                                                           "(default: tools,pool)")
    return p


def _measure(corpus: str, args, base: str, tmp: str) -> dict:
    from bench.preprocess_speed import make_corpus

    path, tok, desc = make_corpus(corpus, os.path.join(tmp, f"{corpus}.jsonl"), args.count, tmp)
    systems = (("before", base), ("after", ""))
    runs = {name: {"on": [], "off": []} for name, _ in systems}
    per = max(1, args.rounds // args.processes)
    for k in range(args.processes):
        for name, tree in systems[::-1] if k % 2 else systems:
            r = run_child("bench.accounting_cost:child_run", tree=tree, path=path, tokenizer=tok,
                          out=os.path.join(tmp, f"{corpus}_{name}"), rounds=per)
            for way in ("on", "off"):
                runs[name][way].extend(r[way])
    out = {"corpus": desc, "systems": {}}
    for name, _ in systems:
        on, off = runs[name]["on"], runs[name]["off"]
        tokens = {r["tokens"] for r in on + off}
        if len(tokens) != 1:
            raise SystemExit(f"{corpus}/{name}: runs with and without accounting wrote different token counts {tokens}")
        cpu_off = statistics.median(r["cpu_s"] for r in off)
        diff = statistics.median(a["cpu_s"] - b["cpu_s"] for a, b in zip(on, off))
        check = statistics.median(r["check_s"] for r in on)
        out["systems"][name] = {"cpu_s_on": statistics.median(r["cpu_s"] for r in on), "cpu_s_off": cpu_off,
                                "paired_diff_s": diff, "cost": diff / cpu_off, "check_s": check,
                                "check_share": check / cpu_off, "tokens": tokens.pop(),
                                "conversations": on[0]["conversations"], "runs": {"on": on, "off": off}}
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    corpora = chosen_corpora(args.corpora, CORPORA)
    results = {"count": args.count, "rounds": args.rounds, "processes": args.processes,
               "baseline_ref": args.baseline_ref, "corpora": {}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        os.makedirs(base)
        export_baseline(args.baseline_ref, base)
        native = os.path.join(ROOT, "megatron_sft_idx", "_native")   # (built, not in git): the same in both
        if os.path.isdir(native):
            shutil.copytree(native, os.path.join(base, "megatron_sft_idx", "_native"), dirs_exist_ok=True)
        for corpus in corpora:
            r = results["corpora"][corpus] = _measure(corpus, args, base, tmp)
            for name, s in r["systems"].items():
                rows.append([corpus, name, args.baseline_ref if name == "before" else "this tree",
                             f"{s['cpu_s_off']:.3f}", f"{s['cpu_s_on']:.3f}", f"{100 * s['cost']:+.1f}%",
                             f"{s['check_s']:.3f} ({100 * s['check_share']:.1f}%)"])
    print(format_table(["corpus", "system", "tree", "CPU-s without", "CPU-s with", "cost (paired)",
                        "read-back itself"], rows))
    print("wrote", write_json("accounting_cost", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
