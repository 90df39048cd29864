"""The README's main job (`make demo` runs tools/demo.py) must keep working end to end."""

import os
import subprocess
import sys

import pytest

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.gate import check

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_preprocesses_gates_promotes_and_reads_back(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "demo.py"), "--out", str(out),
                           "--workers", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "verify-masks        50 conversations OK" in proc.stdout
    assert "overall: PASS" in proc.stdout
    assert "[[" in proc.stdout  # trained spans were shown
    promoted = out / "training" / "example"
    assert not list((out / "staging").glob("example.*"))  # moved, not copied
    ds = MMapIndexedDataset(promoted)
    assert len(ds) > 0 and ds.metadata.stats.sequence_count == 460
    assert ds.metadata.tokenizer and ds.metadata.packing["algorithm"] == "first_fit_decreasing"
    assert check(str(promoted), level="deep").passed
