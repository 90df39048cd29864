"""Reading a shard must not pull heavy dependencies (numba's LLVM, torch, megatron) into a
DataLoader worker, nor compile anything."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "v1_0", "tiny")

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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", LOCAL_RUN.format(root=root)], capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONPATH=root))
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr


def _numba_extension(tmp_path):
    """A package that registers a ``numba_extensions`` entry point (as awkward does), whose
    init writes a marker file: it shows whether numba ran the installed extensions."""
    site = tmp_path / "site"
    (site / "marker_ext").mkdir(parents=True)
    (site / "marker_ext" / "__init__.py").write_text(
        "import os\n\ndef init():\n    open(os.environ['NUMBA_EXT_MARKER'], 'w').close()\n")
    dist = site / "marker_ext-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: marker-ext\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[numba_extensions]\ninit = marker_ext:init\n")
    return site


def test_a_tool_process_skips_numba_extensions_and_a_library_caller_keeps_them(tmp_path):
    """awkward's numba extension imports awkward and pyarrow (35-55 MiB) at numba's first compile:
    the tools' own processes skip every extension (their kernels use none); a program that
    imports the library keeps numba's behaviour, since its own code may need them."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    site = _numba_extension(tmp_path)
    argv = ["--input", os.path.join(root, "examples", "conversations.jsonl"), "--tokenizer",
            os.path.join(root, "examples", "tokenizer"), "--pack-size", "1024", "--quiet"]
    results = {}
    for how, command in {
        "tool": [sys.executable, os.path.join(root, "tools", "preprocess_sft.py"),
                 "--output-prefix", str(tmp_path / "tool" / "ds"), *argv],
        "library": [sys.executable, "-c", "import sys\nfrom megatron_sft_idx.preprocess.cli import main\n"
                    "sys.exit(main(sys.argv[1:]))", "--output-prefix", str(tmp_path / "lib" / "ds"), *argv],
    }.items():
        marker = tmp_path / f"{how}.loaded"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, str(site)]), NUMBA_EXT_MARKER=str(marker))
        out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr
        results[how] = marker.exists()
    assert results == {"tool": False, "library": True}
