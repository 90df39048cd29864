"""Input files as tests need them: a dataset saved by the real ``datasets.save_to_disk``, and a
shard's bytes to compare two runs by."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shard_bytes(prefix):
    return [open(prefix + s, "rb").read() for s in (".bin", ".loss.bin", ".seq.bin", ".idx")]


BRIDGE_STACK = os.path.join(ROOT, ".deps", "megatron-bridge-0.6.2")


def save_to_disk(records, directory):
    """A dataset saved by the real ``datasets`` (the Bridge stack's, in its own interpreter)."""
    if not os.path.isdir(os.path.join(BRIDGE_STACK, "datasets")):
        pytest.fail(f"{BRIDGE_STACK} has no datasets package: run `make install-compat`")
    code = ("import datasets, json, sys; d = datasets.Dataset.from_list(json.load(open(sys.argv[1]))); "
            "d.save_to_disk(sys.argv[2], num_shards=3)")
    src = directory + ".json"
    with open(src, "w") as f:
        json.dump(records, f)
    env = dict(os.environ, PYTHONPATH=BRIDGE_STACK, HF_DATASETS_OFFLINE="1")
    try:
        subprocess.run([sys.executable, "-c", code, src, directory], check=True, env=env, capture_output=True,
                       timeout=300)
    finally:
        os.remove(src)   # (only the saved dataset is left beside its siblings)
    return directory
