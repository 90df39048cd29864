"""The README's megatron-core-only ``BlendedMegatronDatasetBuilder`` example runs as written,
on each installed stack, against a real shard at the path it names."""

import os
import re
import subprocess
import sys

import numpy as np

from megatron_sft_idx.builder import IndexedDatasetBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_example() -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("### Megatron-LM (`data_path`", 1)[1].split("\n### ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "BlendedMegatronDatasetBuilder(" in b]
    assert len(blocks) == 1, "the README's megatron-core-only example moved: update this test"
    return blocks[0]


def write_demo_like_shard(prefix: str, packs: int = 40) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, vocab_size=1000, pack_size=2048) as builder:
        for _ in range(packs):
            lengths = rng.integers(50, 600, size=3)
            tokens = rng.integers(1, 1000, size=int(lengths.sum()), dtype=np.uint16)
            mask = np.ones(tokens.size, dtype=np.uint8)
            mask[np.cumsum(lengths) - 1] = 0  # the format's rule: no loss on a sequence's last label
            builder.add_packed(tokens, mask, np.concatenate([[0], np.cumsum(lengths)[:-1]]))


def test_readme_blended_builder_example_runs_as_written(tmp_path):
    os.makedirs(tmp_path / "out" / "demo" / "training")
    write_demo_like_shard(str(tmp_path / "out" / "demo" / "training" / "example"))
    # the snippet itself is unchanged; only the CPU import shims (tests/compat/megatron_cpu.py) go first
    script = "import megatron_cpu\n" + readme_example()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), ROOT,
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == ("1000 {'tokens': (2048,), 'labels': (2048,), 'loss_mask': (2048,), "
                                            "'position_ids': (2048,), 'cu_seqlens': (2049,), 'max_seqlen': ()}")
    assert os.listdir(tmp_path / "out" / "demo" / "idx_cache")  # the sample index was cached where it says
