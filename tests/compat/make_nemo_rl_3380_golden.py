#!/usr/bin/env python3
"""Regenerate tests/golden/nemo_rl_3380/: what NeMo-RL PR #3380's own code makes of our JSONL.

#3380 (``MegatronSFTPackedDataset``, open; its head ``a944f7c8`` read from a snapshot of the
repository) is no wheel, and CI has no network: its outputs are committed as data, never its
code. To regenerate, with NeMo-RL's repository fetched (e.g. by the session's fetch tool to
/work/.mirror/NVIDIA-NeMo+RL/repo) and the two pure-Python packages its dataset registry imports
beside it (``pip install --no-deps --target DIR absl-py soundfile``; nothing else is missing
from this project's environment: torch, transformers, datasets)::

    python3 tests/compat/make_nemo_rl_3380_golden.py --nemo-rl-repo /path/to/RL --side-packages DIR \\
        [--commit refs/pull/3380/head]

What it does:

1. builds the inputs (:func:`build_inputs`, which tests/compat/test_nemo_rl_3380.py calls too):
   the stand-in Qwen3-style tokenizer and conversations of tests/compat/test_megatron_lm_5017.py
   (chat, tool calling, reasoning, four longer than :data:`PACK_SIZE`, truncated), a sequence
   store, our shards of it at :data:`PACK_SIZE` and the JSONL ``repack-sft --for nemo-rl-3380``
   writes beside them; and :func:`overflow_rows`, rows #3380 must cut;
2. extracts the PR's ``nemo_rl`` package with ``git archive`` into a temporary directory,
   unmodified, no stub;
3. runs itself in a subprocess with that package and ``--side-packages`` first on PYTHONPATH and
   records, through its own ``MegatronSFTPackedDataset`` (its JSONL loading, its row checks,
   ``set_processor``) with ``megatron_sft_prompt_format: identity``, ``max_input_seq_length``
   :data:`PACK_SIZE` and ``megatron_sft_pad_token`` :data:`PAD_TOKEN`: every row's datum at
   context parallelism 1 and 2 (tensors, dtypes, non-tensor values, the key set), the
   overflow rows' datums, its split of each row (``split_megatron_sft_conversations``), and what
   it raises with its default identity pad token ``<unk>``, which this tokenizer lacks; and it
   runs its collate (``rl_collate_fn``) on every row ``NemoRLPackedDataset`` serves from our
   shard at each CP size, failing if it refuses one (recorded: how many it took);
4. writes ``golden.json`` and ``arrays.npz``. Running it twice at one commit writes the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GOLDEN = os.path.join(ROOT, "tests", "golden", "nemo_rl_3380")
PACK_SIZE = 512
PAD_TOKEN = "<|endoftext|>"   # the stand-in tokenizer's pad (id 0)
CP_SIZES = (1, 2)
#: The PR's files whose digests the golden records (its package is used whole, as archived).
PR_FILES = ("nemo_rl/data/megatron_sft_packed.py",
            "nemo_rl/data/datasets/response_datasets/megatron_sft_packed.py",
            "nemo_rl/data/collate_fn.py")
#: The rows of ours :func:`overflow_rows` joins.
OVERFLOW_ROWS = ((4, 29), (0, 29))
TENSOR_KEYS = ("input_ids", "target_ids", "token_mask", "position_ids", "packed_cu_seqlens")


def build_inputs(work: str) -> dict:
    """Tokenizer, store, our shards and their JSONL under ``work`` (the records of #5017's test)."""
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    from make_megatron_lm_5017_golden import records
    from support.chat_families import make_tokenizer
    from support.sft_fixtures import write_jsonl

    from megatron_sft_idx.preprocess import Config, RepackConfig, repack, run
    from megatron_sft_idx.preprocess.nemo_rl import write_nemo_rl_jsonl

    tokenizer = make_tokenizer(os.path.join(work, "tokenizer"), "qwen3")
    data = write_jsonl(os.path.join(work, "conversations.jsonl"), records())
    store = os.path.join(work, "store")
    run(Config(inputs=[data], output_prefix=os.path.join(work, "first", "chat"), tokenizer=tokenizer, store=store,
               pack_size=PACK_SIZE, progress=False))
    summary = repack(RepackConfig(store, os.path.join(work, "ours", "chat"), pack_size=PACK_SIZE, progress=False))
    [shard] = summary["outputs"]
    written = write_nemo_rl_jsonl(shard, tokenizer)
    return {"tokenizer": tokenizer, "store": store, "shard": shard, "jsonl": written["path"], "written": written}


def overflow_rows(jsonl: str) -> list:
    """Rows longer than :data:`PACK_SIZE`, each two of ours joined: row 4 (one sequence of 482
    tokens) then row 29 (five, the first of 56: it crosses the limit), and row 0 (one sequence
    of exactly 512) then row 29 (nothing fits after it)."""
    with open(jsonl, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [{"messages": rows[a]["messages"] + rows[b]["messages"]} for a, b in OVERFLOW_ROWS]


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def compute(out_dir: str, jsonl: str, tokenizer_dir: str, shard: str, doc: dict) -> None:
    """Phase 3, with the PR's package first on the path: its code on the JSONL."""
    import numpy as np
    from transformers import AutoTokenizer

    import nemo_rl
    from nemo_rl.data.collate_fn import rl_collate_fn
    from nemo_rl.data.datasets.response_datasets import MegatronSFTPackedDataset
    from nemo_rl.data.megatron_sft_packed import split_megatron_sft_conversations

    from megatron_sft_idx.errors import ShardError
    from megatron_sft_idx.training.nemo_rl import NemoRLPackedDataset

    if not os.path.realpath(nemo_rl.__file__).startswith(os.path.realpath(os.environ["NEMO_RL_3380_SRC"])):
        raise SystemExit(f"{nemo_rl.__file__} is not the PR's package")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    arrays, values = {}, {}

    def dataset(path, cp, pad_token=PAD_TOKEN):
        ds = MegatronSFTPackedDataset(data_path=path)
        config = {"megatron_sft_prompt_format": "identity", "megatron_sft_context_parallel_size": cp}
        if pad_token is not None:
            config["megatron_sft_pad_token"] = pad_token
        ds.set_task_spec(config)
        ds.set_processor()
        return ds

    def record(name, ds, cp):
        datums = [ds.processor(ds.dataset[i], ds.task_spec, tokenizer, PACK_SIZE, i) for i in range(len(ds.dataset))]
        for key in TENSOR_KEYS:
            arrays[f"{name}_{key}"] = np.concatenate([d[key].numpy() for d in datums])
            arrays[f"{name}_{key}_sizes"] = np.array([d[key].numel() for d in datums], np.int64)
            doc.setdefault("dtypes", {})[key] = str(datums[0][key].dtype).replace("torch.", "")
        values[name] = [{k: v for k, v in d.items() if k not in TENSOR_KEYS} for d in datums]
        doc.setdefault("keys", sorted(datums[0]))
        return ds

    for cp in CP_SIZES:
        ds = record(f"cp{cp}", dataset(jsonl, cp), cp)
    doc["sequences_per_row"] = [len(split_megatron_sft_conversations(ds.dataset[i]["packed_messages"]))
                                for i in range(len(ds.dataset))]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "overflow.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for row in overflow_rows(jsonl):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        record("overflow", dataset(path, 1), 1)
        try:
            ds = dataset(jsonl, 1, pad_token=None)
            ds.processor(ds.dataset[0], ds.task_spec, tokenizer, PACK_SIZE, 0)
            doc["default_pad_token"] = "accepted"
        except Exception as exc:   # what its identity default pad "<unk>" does with this tokenizer
            doc["default_pad_token"] = f"{type(exc).__name__}: {exc}"
    for cp in CP_SIZES:   # its collate on our dataset's rows (the packs it would not cut)
        ours = NemoRLPackedDataset(shard, context_parallel_size=cp)
        taken = 0
        for i in range(len(ours)):
            try:
                row = ours[i]
            except ShardError:
                continue
            rl_collate_fn([row], megatron_sft_context_parallel_size=cp)
            taken += 1
        doc.setdefault("collated_rows_of_ours", {})[str(cp)] = taken
    doc["values"] = values
    os.makedirs(out_dir, exist_ok=True)
    np.savez_compressed(os.path.join(out_dir, "arrays.npz"), **arrays)
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nemo-rl-repo", help="a clone (or bare mirror) of NVIDIA-NeMo/RL")
    parser.add_argument("--side-packages", help="a directory holding absl-py and soundfile (pip --target)")
    parser.add_argument("--commit", default="refs/pull/3380/head")
    parser.add_argument("--out", default=GOLDEN)
    parser.add_argument("--compute", metavar="DOC_JSON", help=argparse.SUPPRESS)
    parser.add_argument("--jsonl", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--shard", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compute:
        with open(args.compute) as f:
            compute(args.out, args.jsonl, args.tokenizer, args.shard, json.load(f))
        return 0
    if not args.nemo_rl_repo or not args.side_packages:
        parser.error("--nemo-rl-repo and --side-packages are required")
    sys.path.insert(0, os.path.dirname(HERE))
    from support.upstream_git import files_at, git_command, resolve

    git = git_command(args.nemo_rl_repo)
    commit = resolve(git, args.commit)
    sources = files_at(git, commit, PR_FILES)
    archive = subprocess.run(git + ["archive", commit, "nemo_rl"], check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory(prefix="rl3380_") as work:
        inputs = build_inputs(work)
        src = os.path.join(work, "src")
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(src, filter="data")
        doc = {"nemo_rl_repository": "https://github.com/NVIDIA-NeMo/RL", "nemo_rl_commit": commit,
               "nemo_rl_ref": args.commit, "pack_size": PACK_SIZE, "pad_token": PAD_TOKEN,
               "cp_sizes": list(CP_SIZES), "prompt_format": "identity",
               "files_sha256": {p: hashlib.sha256(s).hexdigest() for p, s in sorted(sources.items())},
               "input_sha256": file_sha256(inputs["jsonl"]),
               "generated_by": "tests/compat/make_nemo_rl_3380_golden.py"}
        doc_path = os.path.join(work, "doc.json")
        with open(doc_path, "w") as f:
            json.dump(doc, f)
        env = dict(os.environ, NEMO_RL_3380_SRC=src, PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join([src, os.path.abspath(args.side_packages), ROOT]))
        subprocess.run([sys.executable, os.path.abspath(__file__), "--compute", doc_path, "--out",
                        os.path.abspath(args.out), "--jsonl", inputs["jsonl"], "--tokenizer", inputs["tokenizer"],
                        "--shard", inputs["shard"]],
                       check=True, env=env, cwd=ROOT)
    print(f"wrote {args.out} from NeMo-RL {commit} ({args.commit})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
