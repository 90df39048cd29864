"""The local engine's helpers of tests/preprocess/test_stages.py, shared with the Ray engine's and
the set readers' tests: a default preprocess-sft run on the bundled examples, and a directory's
files as bytes (outputs of differently-run pipelines are compared byte for byte)."""

import os
import shutil

from megatron_sft_idx.preprocess import Config, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TOKENIZER = os.path.join(EXAMPLES, "tokenizer")
CHAT = [os.path.join(EXAMPLES, "conversations.jsonl"), os.path.join(EXAMPLES, "conversations_sharegpt.jsonl")]


def files_of(directory):
    """{name: bytes} of every regular file directly in ``directory`` (hidden work dirs excluded)."""
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if os.path.isfile(os.path.join(directory, n))}


def preprocess(out_dir, **kw):
    kw.setdefault("tokenizer", TOKENIZER)
    kw.setdefault("pack_size", 1024)
    return run(Config(inputs=kw.pop("inputs", CHAT), output_prefix=os.path.join(out_dir, "ds"), progress=False, **kw))


def copy_runs(runs, tmp_path):
    """Each run directory of ``runs`` copied under ``tmp_path`` (a test may move or damage its copy)."""
    copies = []
    for src in runs:
        copy = str(tmp_path / os.path.basename(src))
        shutil.copytree(src, copy)
        copies.append(copy)
    return copies


def visible(directory):
    """The names in ``directory`` but the run's hidden record (``.ds.preprocess``), which stays."""
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))
