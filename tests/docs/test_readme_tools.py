"""The commands of docs/TOOLS.md run as written (after the demo), like test_demo does for the demo:
every ``bash`` block headed ``# after make demo``, by its installed command names."""

import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "# after make demo"


def doc_commands(path="docs/TOOLS.md"):
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if b.startswith(MARK + "\n")]
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()
            and not line.strip().startswith("#")]


def test_tool_commands_run_as_written(tmp_path):
    commands = doc_commands()
    names = {command.split()[0] for command in commands}
    assert {"check-idx", "inspect-idx", "convert-packed", "merge-shards", "write-sft-manifest",
            "plan-batches"} <= names, names
    assert not any(command.startswith(("python ", "tools/")) for command in commands)  # installed names
    for name in ("tools", "examples", "megatron_sft_idx"):  # a fresh checkout's layout, outputs in tmp
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for name in names - {"cp"}:  # the installed console scripts, as a user's shell finds them
        assert shutil.which(name, path=env["PATH"]), f"{name} is not installed beside {sys.executable}"
    demo = subprocess.run([sys.executable, "tools/demo.py", "--workers", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-2000:]
    outputs = []
    for command in commands:
        proc = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}"
        outputs.append(proc.stdout)
    text = "\n".join(outputs)
    assert "PASS  out/demo/training/example" in text and '"passed": true' in text
    assert "packs        36" in text and "<|im_start|>assistant" in text and "num_sequences" in text
    assert "merged 2 shards" in text and "copy_file_range" in text
    assert "wrote out/demo/example.json: 1 shard, 36 packs" in text and "wrote out/demo/train.order" in text
    for produced in ("out/example_hist.png", "out/example.parquet", "out/example.pack_metadata.json",
                     "out/tools/from_parquet.idx", "out/tools/from_pretrain.idx", "out/tools/merged.idx",
                     "out/demo/example.json", "out/demo/train.order"):
        assert (tmp_path / produced).exists(), produced
