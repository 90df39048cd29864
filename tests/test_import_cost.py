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
