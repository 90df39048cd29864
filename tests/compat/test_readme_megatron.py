"""docs/TRAINING.md's megatron-core-only ``BlendedMegatronDatasetBuilder`` examples run as written,
on each installed stack, against a real shard at the path they name: one prefix, and a blend of
two entries (a prefix and a manifest) outside torchrun."""

import os
import re
import subprocess
import sys

import numpy as np

from megatron_sft_idx.builder import IndexedDatasetBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "TRAINING.md")


def megatron_section() -> str:
    text = open(DOC, encoding="utf-8").read()
    return text.split("\n## Megatron-LM (`data_path`", 1)[1].split("\n## ", 1)[0]


def doc_examples():
    """(the one-prefix example, the blend's shell commands, the blend example)."""
    section = megatron_section()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "BlendedMegatronDatasetBuilder(" in b]
    single = [b for b in blocks if "init_process_group" not in b]
    blend = [b for b in blocks if "init_process_group" in b]
    assert len(single) == 1 and len(blend) == 1, "docs/TRAINING.md's megatron-core examples moved: update this test"
    before_blend = section.split(blend[0], 1)[0]
    shell = re.findall(r"```bash\n(.*?)```", before_blend, re.S)[-1]
    return single[0], [line for line in shell.splitlines() if line.strip() and not line.startswith("#")], blend[0]


def write_demo_like_shard(prefix: str, packs: int = 40) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, vocab_size=1000, pack_size=2048) as builder:
        for _ in range(packs):
            lengths = rng.integers(50, 600, size=3)
            tokens = rng.integers(1, 1000, size=int(lengths.sum()), dtype=np.uint16)
            mask = np.ones(tokens.size, dtype=np.uint8)
            mask[np.cumsum(lengths) - 1] = 0  # the format's rule: no loss on a sequence's last label
            builder.add_packed(tokens, mask, np.concatenate([[0], np.cumsum(lengths)[:-1]]))


def run(cwd, argv, shell=False):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), ROOT,
                                                       os.environ.get("PYTHONPATH", "")]))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the console scripts
    proc = subprocess.run(argv, shell=shell, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def demo_dir(tmp_path):
    os.makedirs(tmp_path / "out" / "demo" / "training")
    write_demo_like_shard(str(tmp_path / "out" / "demo" / "training" / "example"))
    return tmp_path


def test_doc_blended_builder_example_runs_as_written(tmp_path):
    cwd = demo_dir(tmp_path)
    # the snippet itself is unchanged; only the CPU import shims (tests/compat/megatron_cpu.py) go first
    proc = run(cwd, [sys.executable, "-c", "import megatron_cpu\n" + doc_examples()[0]])
    assert proc.stdout.splitlines()[-1] == ("1000 {'tokens': (2048,), 'labels': (2048,), 'loss_mask': (2048,), "
                                            "'position_ids': (2048,), 'cu_seqlens': (2049,), 'max_seqlen': ()}")
    assert os.listdir(tmp_path / "out" / "demo" / "idx_cache")  # the sample index was cached where it says


def test_doc_blend_of_two_entries_runs_outside_torchrun(tmp_path):
    cwd = demo_dir(tmp_path)
    _, shell, blend = doc_examples()
    assert "parse_data_path(\"0.7 " in blend and len(shell) == 1 and shell[0].startswith("write-sft-manifest ")
    run(cwd, shell[0], shell=True)
    for attempt in ("built", "cached"):  # the second run reads the blend's index from the cache
        proc = run(cwd, [sys.executable, "-c", "import megatron_cpu\n" + blend])
        assert proc.stdout.splitlines()[-1] == ("BlendedDataset 1000 ['cu_seqlens', 'dataset_id', 'labels', "
                                                "'loss_mask', 'max_seqlen', 'position_ids', 'tokens']"), attempt
    cached = os.listdir(tmp_path / "out" / "demo" / "idx_cache")
    assert any("BlendedDataset-train-dataset_index.npy" in name for name in cached), cached
