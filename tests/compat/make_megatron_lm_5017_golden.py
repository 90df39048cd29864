#!/usr/bin/env python3
"""Regenerate tests/golden/megatron_lm_5017/: what Megatron-LM PR #5017's own code makes of our bin/idx.

#5017 (``SFTDataset``, open; its head ``97b2c55e`` read from a snapshot of the repository) is
no wheel, and CI has no network: its outputs are committed as data, never its code. To
regenerate, with Megatron-LM's repository fetched (e.g. by the session's fetch tool to
/work/.mirror/NVIDIA+Megatron-LM/repo) and the 0.6.2 stack installed (``make install-compat``)::

    python3 tests/compat/make_megatron_lm_5017_golden.py --megatron-lm-repo /path/to/Megatron-LM \\
        [--commit refs/pull/5017/head]

What it does:

1. builds the inputs (:func:`build_inputs`, which tests/compat/test_megatron_lm_5017.py calls
   too): a stand-in Qwen3-style tokenizer (``<|im_start|>``/``<|im_end|>``, ``<think>``,
   ``<tool_call>``, ``<tool_response>``: the delimiters #5017's default template config
   names), chat, tool-calling and reasoning conversations, a sequence store of them
   (``preprocess-sft --store``) and from it the conversation-level pair ``repack-sft --for
   megatron-lm-5017`` writes;
2. builds a "#5017" stack in a temporary directory: the installed ``.deps/megatron-bridge-0.6.2``
   (megatron-core 0.19.2) copied, and the PR's files written over it from ``--commit`` with
   ``git show`` (:data:`PR_FILES`: its dataset, its tokenizer layer, whose ``tokenize`` takes
   the ``add_special_tokens`` keyword the dataset passes and 0.19.2's lacks, and its
   ``megatron/core/utils.py``, which holds its batch preprocessing). The one stub is
   tests/compat/megatron_cpu.py's stand-in for the MoE module that imports Triton (a GPU
   compiler); nothing else is changed;
3. runs itself in a subprocess with that stack first on PYTHONPATH and records, with the
   default ``SFTDatasetConfig`` (assistant replies, reasoning and tool calls trained) at
   :data:`SEQ_LENGTH`: ``pack_samples``' bins (and its bins of :func:`synthetic_lengths`), the dataset's document / sample / shuffle
   indices, every ``__getitem__`` (``tokens``, ``labels``, ``loss_mask``, ``cu_seqlens``)
   and ``preprocess_sft_batch`` of each sample at context parallelism 1 and 2 (TP 1), and at CP 2
   with sequence parallelism over TP 2 (:data:`CP_TP_CELLS`: its per-conversation multiple becomes
   ``2*CP*TP``); its CP sharding (Transformer Engine) is not run;
4. writes ``golden.json`` (settings, the commit, each file's SHA-256, the digests of the
   bin/idx it read, non-tensor values) and ``arrays.npz``. Running it twice at one commit
   writes the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GOLDEN = os.path.join(ROOT, "tests", "golden", "megatron_lm_5017")
STACK = "megatron-bridge-0.6.2"
SEQ_LENGTH = 512
SEED = 1234
CP_SIZES = (1, 2)
#: Batch-step cells beyond ``CP_SIZES`` (which run with TP 1, no SP): (key, cp, tp, sp). #5017 multiplies its
#: per-conversation multiple ``2*CP`` by TP when SP is on (``preprocess_sft_batch``).
CP_TP_CELLS = (("cp2tp2sp", 2, 2, True),)
PAD_ID = 0   # the stand-in tokenizer's <|endoftext|>
#: The PR's files written over the installed stack (every other module stays 0.19.2's).
PR_FILES = (
    "megatron/core/datasets/sft_dataset.py",
    "megatron/core/utils.py",
    "megatron/core/tokenizers/text/text_tokenizer.py",
    "megatron/core/tokenizers/utils/build_tokenizer.py",
    "megatron/core/tokenizers/text/libraries/abstract_tokenizer.py",
    "megatron/core/tokenizers/text/libraries/bytelevel_tokenizer.py",
    "megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py",
    "megatron/core/tokenizers/text/libraries/null_tokenizer.py",
    "megatron/core/tokenizers/text/libraries/sentencepiece_tokenizer.py",
    "megatron/core/tokenizers/text/libraries/sft_tokenizer.py",
    "megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py",
)


def records() -> list:
    """The conversations, in input order: chat, tool calling (OpenAI layout: calls, results),
    reasoning (inline ``<think>`` and ``reasoning_content``, one and two turns), and long chats
    that exceed :data:`SEQ_LENGTH` (which #5017 drops)."""
    sys.path.insert(0, os.path.dirname(HERE))
    from support.sft_fixtures import openai, reasoning

    with open(os.path.join(ROOT, "examples", "conversations.jsonl"), encoding="utf-8") as f:
        chats = [json.loads(line) for line in f][:40]
    out = []
    for i in range(40):
        out.append(chats[i])
        if i % 3 == 0:
            out.append(openai(i, with_system=i % 2 == 0))
        if i % 3 == 1:
            out.append(reasoning(i, inline=i % 2 == 0, turns=1 + i % 2))
    for i in range(4):   # long: several chats' turns in one conversation
        messages = [m for c in chats[10 * i:10 * i + 5] for m in c["messages"] if m["role"] != "system"]
        out.append({"messages": messages})
    return out


def synthetic_lengths():
    """Lengths for ``pack_samples`` alone, chosen for ties and every class and phase: 3000 draws from
    few values at capacity :data:`SYNTHETIC_CAPACITY` (tests/packing reads its bins from the golden)."""
    import numpy as np

    rng = np.random.default_rng(5017)
    values = np.array([1, 7, 100, 101, 166, 167, 170, 250, 333, 334, 400, 500, 501, 640, 999, 1000])
    return rng.choice(values, size=3000).astype(np.int64)


SYNTHETIC_CAPACITY = 1000


def build_inputs(work: str) -> dict:
    """Tokenizer, JSONL, store, the #5017 pair and our shards of the store, under ``work``.

    Our shards are the store repacked with #5017's algorithm (``megatron_lm_mffd``) at
    :data:`SEQ_LENGTH`, overlong conversations dropped, as #5017 does.
    """
    sys.path.insert(0, os.path.dirname(HERE))
    from support.chat_families import make_tokenizer
    from support.sft_fixtures import write_jsonl

    from megatron_sft_idx.preprocess import Config, RepackConfig, repack, run
    from megatron_sft_idx.preprocess.conversations import write_conversations

    tokenizer = make_tokenizer(os.path.join(work, "tokenizer"), "qwen3")
    data = write_jsonl(os.path.join(work, "conversations.jsonl"), records())
    store = os.path.join(work, "store")
    run(Config(inputs=[data], output_prefix=os.path.join(work, "first", "chat"), tokenizer=tokenizer, store=store,
               pack_size=SEQ_LENGTH, overlong="drop", progress=False))
    prefix = os.path.join(work, "lm5017", "chat")
    written = write_conversations(store, prefix, seq_length=SEQ_LENGTH)
    summary = repack(RepackConfig(store, os.path.join(work, "ours", "chat"), pack_size=SEQ_LENGTH,
                                  overlong="drop", algorithm="megatron_lm_mffd", progress=False))
    return {"tokenizer": tokenizer, "store": store, "prefix": prefix, "written": written,
            "shards": summary["outputs"]}


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def compute(out_dir: str, prefix: str, tokenizer_dir: str, doc: dict) -> None:
    """Phase 3, inside the #5017 stack: its code on the pair at ``prefix``."""
    sys.path.insert(0, HERE)
    import megatron_cpu  # noqa: F401  (before any megatron import)
    import numpy as np
    import torch
    from megatron.core.datasets import sft_dataset as lm
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron.core.utils import preprocess_sft_batch

    if not os.path.realpath(lm.__file__).startswith(os.path.realpath(os.environ["MEGATRON_SFT_IDX_DEPS"])):
        raise SystemExit(f"{lm.__file__} is not the #5017 stack's module")
    tokenizer = MegatronTokenizer.from_pretrained(tokenizer_path=tokenizer_dir, metadata_path={"library": "huggingface"})
    low = IndexedDataset(prefix, multimodal=False, mmap=True)
    n = len(low.sequence_lengths)
    bins = lm.pack_samples(low.sequence_lengths, SEQ_LENGTH)
    synthetic = lm.pack_samples(synthetic_lengths().tolist(), SYNTHETIC_CAPACITY)
    cache = tempfile.mkdtemp(prefix="lm5017_cache_")
    config = lm.SFTDatasetConfig(random_seed=SEED, sequence_length=SEQ_LENGTH, blend=([prefix], None),
                                 split="100,0,0", tokenizer=tokenizer, reset_position_ids=True,
                                 reset_attention_mask=True, eod_mask_loss=False, path_to_cache=cache)
    ds = lm.SFTDataset(low, prefix, np.arange(n, dtype=np.int32), len(bins), Split.train, config)
    arrays = {"bins_flat": np.concatenate([np.asarray(b, np.int64) for b in bins]),
              "bins_sizes": np.array([len(b) for b in bins], np.int64),
              "document_index": np.asarray(ds.document_index), "sample_index": np.asarray(ds.sample_index),
              "shuffle_index": np.asarray(ds.shuffle_index),
              "synthetic_lengths": synthetic_lengths(),
              "synthetic_bins_flat": np.concatenate([np.asarray(b, np.int64) for b in synthetic]),
              "synthetic_bins_sizes": np.array([len(b) for b in synthetic], np.int64)}
    samples = [ds[i] for i in range(len(ds))]
    for key in ("tokens", "labels", "loss_mask", "cu_seqlens"):
        arrays[f"item_{key}"] = torch.cat([s[key] for s in samples]).numpy()
        arrays[f"item_{key}_sizes"] = np.array([s[key].numel() for s in samples], np.int64)
    cells = [(str(cp), f"cp{cp}", cp, 1, False) for cp in CP_SIZES]
    cells += [(k, k, cp, tp, sp) for k, cp, tp, sp in CP_TP_CELLS]
    for name, stem, cp, tp, sp in cells:
        outs = [preprocess_sft_batch({k: v.unsqueeze(0) for k, v in s.items()}, tp_rank=0, cp_size=cp, tp_size=tp,
                                     sp=sp, padding_token_id=PAD_ID, padding_label_id=lm.IGNORE_INDEX,
                                     max_seq_len=SEQ_LENGTH) for s in samples]
        for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
            values = [o[key] for o in outs]
            if values[0] is None:
                doc.setdefault("none_keys", {})[name] = sorted(set(doc.get("none_keys", {}).get(name, [])) | {key})
                continue
            arrays[f"{stem}_{key}"] = torch.cat([v.reshape(-1) for v in values]).numpy()
            arrays[f"{stem}_{key}_sizes"] = np.array([v.numel() for v in values], np.int64)
            doc.setdefault("dtypes", {})[f"{stem}_{key}"] = str(values[0].dtype).replace("torch.", "")
    for key in ("tokens", "labels", "loss_mask", "cu_seqlens"):
        doc.setdefault("dtypes", {})[f"item_{key}"] = str(samples[0][key].dtype).replace("torch.", "")
    doc.update(conversations=n, packed_samples=len(bins), len_dataset=len(ds),
               delimiters={"role_start": config.role_start_tokens, "end": config.end_tokens,
                           "think": [config.think_start_tokens, config.think_end_tokens],
                           "tool_call": [config.tool_call_start_tokens, config.tool_call_end_tokens],
                           "tool_response": [config.tool_response_start_tokens, config.tool_response_end_tokens]})
    os.makedirs(out_dir, exist_ok=True)
    np.savez_compressed(os.path.join(out_dir, "arrays.npz"), **arrays)
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    shutil.rmtree(cache, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm-repo", help="a clone (or bare mirror) of NVIDIA/Megatron-LM")
    parser.add_argument("--commit", default="refs/pull/5017/head")
    parser.add_argument("--out", default=GOLDEN)
    parser.add_argument("--compute", metavar="DOC_JSON", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compute:
        with open(args.compute) as f:
            compute(args.out, args.prefix, args.tokenizer, json.load(f))
        return 0
    if not args.megatron_lm_repo:
        parser.error("--megatron-lm-repo is required")
    sys.path.insert(0, os.path.dirname(HERE))
    from support.upstream_git import files_at, git_command, overlaid_stack, resolve

    git = git_command(args.megatron_lm_repo)
    commit = resolve(git, args.commit)
    sources = files_at(git, commit, PR_FILES)
    with tempfile.TemporaryDirectory(prefix="lm5017_") as work:
        inputs = build_inputs(work)
        stack = overlaid_stack(work, STACK, sources)
        deps = os.path.dirname(stack)
        doc = {"megatron_lm_repository": "https://github.com/NVIDIA/Megatron-LM", "megatron_lm_commit": commit,
               "megatron_lm_ref": args.commit, "base_stack": STACK, "seq_length": SEQ_LENGTH, "seed": SEED,
               "cp_sizes": list(CP_SIZES), "pad_id": PAD_ID,
               "cp_tp_cells": [{"key": k, "cp": cp, "tp": tp, "sp": sp} for k, cp, tp, sp in CP_TP_CELLS],
               "files_sha256": {p: hashlib.sha256(s).hexdigest() for p, s in sorted(sources.items())},
               "input_sha256": {ext: file_sha256(inputs["prefix"] + ext) for ext in (".bin", ".idx")},
               "generated_by": "tests/compat/make_megatron_lm_5017_golden.py"}
        doc_path = os.path.join(work, "doc.json")
        with open(doc_path, "w") as f:
            json.dump(doc, f)
        env = dict(os.environ, MEGATRON_SFT_IDX_STACK=STACK, MEGATRON_SFT_IDX_DEPS=deps,
                   PYTHONPATH=os.pathsep.join([stack, ROOT]), PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--compute", doc_path, "--out",
                        os.path.abspath(args.out), "--prefix", inputs["prefix"], "--tokenizer", inputs["tokenizer"]],
                       check=True, env=env, cwd=ROOT)
    print(f"wrote {args.out} from Megatron-LM {commit} ({args.commit})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
