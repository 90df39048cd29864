"""The main job against the last release, in the same run: CPU-seconds and wall, 1 and 2 workers.

The guard of issue 45: every change that touches the main job (``preprocess-sft``: read, map,
render, tokenize, store, plan, write) quotes this bench's ratios. The release (``--release-ref``,
default :data:`RELEASE_REF`) is exported with ``git archive``
(:func:`bench.preprocess_speed.export_baseline`, with this tree's built native library copied in,
as :mod:`bench.accounting_cost` does) and imported in its own processes; this tree runs in others.

Each (tree, corpus) child process imports once, warms up on 300 conversations (numba's caches,
the tokenizer's files in the page cache), then runs the whole pipeline once per setting --
workers (``--workers``, default 1 and 2) x partition size (``--partitions``: ``default`` is each
tree's own default, ``auto`` since 21535ea, 64 MiB before; ``64M`` is the same explicit size for
both) -- in an order that rotates with the round. The two trees' processes alternate, the first
tree alternating too, for ``--rounds`` rounds; each figure is the median over the rounds. On the
2-core machine shared with other jobs wall time is noisy and CPU time much less so: CPU is the
run's user + system time, its process and its (reaped) workers, inside the warm process (a
process's start, ~1 CPU-s of imports, is paid once by either tree and left out). Each run's
summary ``seconds`` (by stage) and ``units`` are kept in the JSON: the profile by stage.

Corpora (:func:`bench.preprocess_speed.make_corpus`): ``realistic`` (plain multi-turn chat,
:mod:`bench.chat_corpus`, a 128k+ production tokenizer), ``tools`` (:mod:`bench.tool_corpus`, tool
calling and reasoning, the same tokenizer with a hermes template), ``example`` (the bundled
generator and 1k BPE). Both trees must write the same tokens, or the bench stops.

    python -m bench.release_compare                                   # realistic,tools; 20k; 3 rounds
    python -m bench.release_compare --corpora realistic --workers 1 --partitions default,64M --rounds 5
    python -m bench.release_compare --release-ref a740824 --count 5000
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

from bench._common import ROOT, chosen_corpora, format_table, ratio, run_child, write_json
from bench.preprocess_speed import export_baseline, make_corpus

#: the last release of the main job (issue 45); one place to change when the next one is cut
RELEASE_REF = "a740824"
CORPORA = ("realistic", "tools", "example")
WARM_UP = 300


def parse_partitions(text: str) -> Optional[int]:
    """``default`` -> None (the tree's own default: ``auto`` today, 64 MiB in the release), else a
    size such as ``64M`` in bytes."""
    if text == "default":
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    number = text[:-1] if text[-1:].upper() in units else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise SystemExit(f"--partitions: {text!r} is not default or a size such as 64M") from None
    if value <= 0:
        raise SystemExit(f"--partitions: {text!r} is not a positive size")
    return value


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def child_runs(tree: str, path: str, warm: str, tokenizer: str, out: str, settings: List[list],
               pack_size: int = 4096) -> dict:
    """The pipeline from ``tree`` ('' = this tree) once per ``[workers, partitions]`` setting, after a
    warm-up on ``warm``; per run: CPU-s (process + reaped workers), wall-s, tokens, the summary's
    ``seconds`` by stage and ``units``."""
    if tree:
        sys.path.insert(0, tree)
    import megatron_sft_idx.preprocess as entry

    if tree and not entry.__file__.startswith(tree):
        raise RuntimeError(f"imported {entry.__file__}, not the release under {tree}")

    def once(source: str, workers: int, partitions: str) -> dict:
        size = parse_partitions(partitions)
        extra = {} if size is None else {"partition_bytes": size}
        cpu0, t0 = _cpu_s(), time.perf_counter()
        s = entry.run(entry.Config(inputs=[source], output_prefix=out, tokenizer=tokenizer, pack_size=pack_size,
                                   workers=workers, progress=False, overwrite=True, **extra))
        wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
        return {"workers": workers, "partitions": partitions, "cpu_s": cpu, "wall_s": wall, "tokens": s["tokens"],
                "conversations": s["conversations"], "seconds": dict(s.get("seconds") or {}),
                "units": dict(s.get("units") or {})}

    once(warm, 1, "default")
    return {"runs": [once(path, int(w), str(p)) for w, p in settings]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=20000, help="conversations per corpus (default: 20000)")
    p.add_argument("--corpora", default="realistic,tools", help=f"comma-separated, of {', '.join(CORPORA)} "
                                                                "(default: realistic,tools)")
    p.add_argument("--workers", default="1,2", help="worker counts (default: 1,2)")
    p.add_argument("--partitions", default="default",
                   help="partition sizes: default (each tree's own) or a size such as 64M; "
                        "comma-separated (default: default)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians over them (default: 3)")
    p.add_argument("--release-ref", default=RELEASE_REF, help=f"git ref of the release (default: {RELEASE_REF})")
    p.add_argument("--pack-size", type=int, default=4096, help="pack size (default: 4096)")
    return p


def _settings(args) -> List[list]:
    workers = [int(w) for w in args.workers.split(",") if w]
    partitions = [p for p in args.partitions.split(",") if p]
    for p in partitions:
        parse_partitions(p)
    return [[w, p] for w in workers for p in partitions]


def _median_stage(runs: List[dict], key: str) -> Dict[str, float]:
    names = sorted({name for r in runs for name in r[key]})
    return {name: statistics.median(r[key].get(name, 0) for r in runs) for name in names}


def _measure(kind: str, args, release: str, tmp: str) -> dict:
    path, tok, desc = make_corpus(kind, os.path.join(tmp, f"{kind}.jsonl"), args.count, tmp)
    warm = os.path.join(tmp, f"{kind}_warm.jsonl")
    with open(path, "rb") as src, open(warm, "wb") as dst:
        dst.writelines(line for line, _ in zip(src, range(WARM_UP)))
    settings = _settings(args)
    trees = (("release", release), ("tree", ""))
    runs: Dict[str, List[dict]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        order = settings[r % len(settings):] + settings[:r % len(settings)]
        for name, tree in trees[::-1] if r % 2 else trees:
            got = run_child("bench.release_compare:child_runs", tree=tree, path=path, warm=warm, tokenizer=tok,
                            out=os.path.join(tmp, f"{kind}_{name}", "out"), settings=order,
                            pack_size=args.pack_size)
            runs[name].extend(got["runs"])
    tokens = {r["tokens"] for rs in runs.values() for r in rs}
    if len(tokens) != 1:
        raise SystemExit(f"{kind}: the release and this tree wrote different token counts {sorted(tokens)}")
    out = {"corpus": desc, "tokens": tokens.pop(), "settings": []}
    for workers, partitions in settings:
        row = {"workers": workers, "partitions": partitions}
        for name, _ in trees:
            mine = [r for r in runs[name] if r["workers"] == workers and r["partitions"] == partitions]
            row[name] = {"cpu_s": statistics.median(r["cpu_s"] for r in mine),
                         "wall_s": statistics.median(r["wall_s"] for r in mine),
                         "seconds": _median_stage(mine, "seconds"), "units": mine[0]["units"], "runs": mine}
        row["cpu_ratio"] = ratio(row["tree"]["cpu_s"], row["release"]["cpu_s"])
        row["wall_ratio"] = ratio(row["tree"]["wall_s"], row["release"]["wall_s"])
        out["settings"].append(row)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    corpora = chosen_corpora(args.corpora, CORPORA)
    _settings(args)
    results = {"count": args.count, "rounds": args.rounds, "release_ref": args.release_ref, "corpora": {}}
    rows, stages = [], []
    with tempfile.TemporaryDirectory() as tmp:
        release = os.path.join(tmp, "release")
        os.makedirs(release)
        export_baseline(args.release_ref, release)
        native = os.path.join(ROOT, "megatron_sft_idx", "_native")   # (built, not in git): the same in both
        if os.path.isdir(native):
            shutil.copytree(native, os.path.join(release, "megatron_sft_idx", "_native"), dirs_exist_ok=True)
        for kind in corpora:
            r = results["corpora"][kind] = _measure(kind, args, release, tmp)
            for s in r["settings"]:
                a, b = s["release"], s["tree"]
                rows.append([kind, s["workers"], s["partitions"], a["cpu_s"], b["cpu_s"], f"{s['cpu_ratio']:.3f}",
                             a["wall_s"], b["wall_s"], f"{s['wall_ratio']:.3f}",
                             f"{r['tokens'] / b['cpu_s'] / 1e6:.2f}M"])
                for name in ("release", "tree"):
                    sec = s[name]["seconds"]
                    stages.append([kind, s["workers"], s["partitions"], name, s[name]["units"].get("tokenize", "-")]
                                  + [f"{sec.get(k, 0):.3f}" for k in ("inputs", "index", "tokenize", "plan",
                                                                       "materialize", "publish")])
    print(f"release {args.release_ref} against this tree, {args.count} conversations, medians of {args.rounds} "
          f"alternating rounds")
    print(format_table(["corpus", "workers", "partitions", "release CPU-s", "tree CPU-s", "CPU x",
                        "release wall-s", "tree wall-s", "wall x", "tree tok/CPU-s"], rows))
    print(format_table(["corpus", "workers", "partitions", "tree", "tokenize units", "inputs", "index", "tokenize",
                        "plan", "materialize", "publish"], stages))
    print("wrote", write_json("release_compare", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
