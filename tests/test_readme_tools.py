"""The README's shard-tools commands run as written (after the demo), like test_demo does for the demo."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Shard tools", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()
            and not line.strip().startswith("#")]


def test_readme_tool_commands_run_as_written(tmp_path):
    commands = readme_commands()
    assert len(commands) >= 8 and any("merge_shards.py" in c for c in commands)
    for name in ("tools", "examples", "megatron_sft_idx"):  # a fresh checkout's layout, outputs in tmp
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    demo = subprocess.run([sys.executable, "tools/demo.py", "--workers", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-2000:]
    outputs = []
    for command in commands:
        proc = subprocess.run(command.replace("python ", f"{sys.executable} ", 1), shell=True, cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}"
        outputs.append(proc.stdout)
    text = "\n".join(outputs)
    assert "packs        36" in text and "<|im_start|>assistant" in text and "num_sequences" in text
    assert "merged 2 shards" in text and "copy_file_range" in text
    for produced in ("out/example_hist.png", "out/example.parquet", "out/example.pack_metadata.json",
                     "out/tools/from_parquet.idx", "out/tools/from_pretrain.idx", "out/tools/merged.idx"):
        assert (tmp_path / produced).exists(), produced
