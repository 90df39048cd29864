"""Reading a shard must not pull heavy dependencies (numba's LLVM, torch, megatron) into a
DataLoader worker, nor compile anything."""

import os
import subprocess
import sys

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "v1_0", "tiny")

PROBE = f"""
import sys
from megatron_sft_idx import MMapIndexedDataset, open_packed
ds = MMapIndexedDataset({GOLDEN!r})
pack = ds[0]
pack.seq_boundaries
open_packed({GOLDEN!r})[1]
import megatron_sft_idx.storage  # URL support is there, its clients are not imported
MMapIndexedDataset.exists({GOLDEN!r})
heavy = sorted(m for m in ("numba", "llvmlite", "torch", "megatron", "pyarrow", "transformers",
                           "boto3", "botocore", "multistorageclient") if m in sys.modules)
print(",".join(heavy) or "none")
"""


def test_reading_a_pack_imports_nothing_heavy():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "none", out.stdout + out.stderr


LOCAL_RUN = """
import os, sys, tempfile
from megatron_sft_idx.preprocess.cli import main
root = {root!r}
out = tempfile.mkdtemp()
rc = main(["--input", os.path.join(root, "examples", "conversations_sharegpt.jsonl"), "--tokenizer",
           os.path.join(root, "examples", "tokenizer"), "--output-prefix", os.path.join(out, "ds"),
           "--pack-size", "1024", "--workers", "2", "--quiet"])
print(rc, "ray" in sys.modules)
"""


def test_the_local_engine_never_imports_ray():
    """Ray is the optional [ray] extra: a local run, workers included, must not import it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", LOCAL_RUN.format(root=root)], capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONPATH=root))
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr
