"""The README is a front door with the detail one link away, and stays so:

* it is at most 15 KiB and holds the sections a newcomer looks for;
* its path from conversations to training and its Python API run as written;
* every relative link of README.md and docs/*.md reaches a file, and a heading where it names one;
* every command is in the README's table, and every flag of every command is on its docs page.
"""

import os
import re
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
# Where each command's flags are documented (besides its --help).
FLAG_PAGES = {
    "preprocess-sft": ["PREPROCESSING.md", "INPUTS.md", "STORE.md", "STORAGE.md"],
    "repack-sft": ["PREPROCESSING.md", "INPUTS.md", "STORE.md", "STORAGE.md"],
    "check-idx": ["TOOLS.md", "GATE.md"],
    "inspect-idx": ["TOOLS.md"],
    "convert-packed": ["TOOLS.md"],
    "merge-shards": ["TOOLS.md"],
    "write-sft-manifest": ["TOOLS.md"],
    "plan-batches": ["TOOLS.md", "BATCHING.md"],
    "sft_idx_check": ["TOOLS.md"],
}


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def section(text, heading):
    return text.split("\n" + heading + "\n", 1)[1].split("\n## ", 1)[0]


def test_readme_is_a_front_door():
    text = read(README)
    assert len(text.encode("utf-8")) <= 15 * 1024, "the README is a front door: move detail to docs/"
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings == ["Quick start", "Install", "From conversations to training", "Python API", "Commands",
                        "Benchmarks", "Compatibility", "Documentation"], headings
    quick = section(text, "## Quick start")
    assert "make demo" in quick and "make test" in quick  # the two quick-start commands, as CI runs them


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def markdown_files():
    return [README] + sorted(os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md"))


def test_every_relative_link_resolves():
    anchors = {}
    for path in markdown_files():
        text = re.sub(r"```.*?```", "", read(path), flags=re.S)
        anchors[os.path.realpath(path)] = {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    checked, broken = 0, []
    for path in markdown_files():
        text = re.sub(r"```.*?```", "", read(path), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            file, _, anchor = target.partition("#")
            resolved = os.path.realpath(os.path.join(os.path.dirname(path), file)) if file else os.path.realpath(path)
            checked += 1
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(path, ROOT)}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in anchors.get(resolved, set()):
                broken.append(f"{os.path.relpath(path, ROOT)}: {target} (no such heading)")
    assert checked > 60 and not broken, broken


def commands():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return sorted(tomllib.load(f)["project"]["scripts"])


def long_flags(command):
    if command == "sft_idx_check":  # the native executable's usage text is its source's
        usage = read(os.path.join(ROOT, "csrc", "sft_idx_check.cpp"))
        start = usage.index('"usage: sft_idx_check')
        usage = usage[start:usage.index("Exit status", start)]
    else:
        env = dict(os.environ, COLUMNS="10000")  # no wrapped flags
        exe = os.path.join(os.path.dirname(sys.executable), command)
        proc = subprocess.run([exe, "--help"], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        usage = proc.stdout
    return sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", usage)) - {"--help"})


def test_every_command_is_in_the_readme_table():
    table = section(read(README), "## Commands")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w-]+)` \|[^|]+\|(.+)\|$", table, re.M)}
    assert sorted(rows) == commands() == sorted(FLAG_PAGES)
    for command, docs in rows.items():
        assert "](docs/" in docs, f"{command}: no docs link"


@pytest.mark.subprocess
@pytest.mark.parametrize("command", sorted(FLAG_PAGES))
def test_every_flag_is_documented_on_its_page(command):
    pages = "\n".join(read(os.path.join(DOCS, page)) for page in FLAG_PAGES[command])
    flags = long_flags(command)
    assert len(flags) >= 3, flags
    missing = [flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", pages)]
    assert not missing, f"{command}: {missing} are in --help but not in docs/{', docs/'.join(FLAG_PAGES[command])}"


def readme_code(heading, language):
    blocks = re.findall(rf"```{language}\n(.*?)```", section(read(README), heading), re.S)
    assert len(blocks) == 1, f"the README's {heading} {language} block moved: update this test"
    return blocks[0]


@pytest.mark.subprocess
def test_readme_path_and_python_api_run_as_written(tmp_path):
    script = readme_code("## From conversations to training", "bash")
    install, rest = script.split("\n", 1)
    assert install.startswith("pip install ")  # the environment running this test has it installed
    for name in ("tools", "examples", "megatron_sft_idx"):  # a fresh checkout's layout, outputs in tmp
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", rest], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "overall: PASS: 3 of 3 shards passed" in proc.stdout
    for split in ("train", "valid", "test"):
        assert (tmp_path / "out" / "sft" / f"chat_{split}.idx").exists()
    proc = subprocess.run([sys.executable, "-c", readme_code("## Python API", "python")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = proc.stdout.splitlines()[-2:]
    assert first.startswith("32 [") and second.startswith("34 ") and second.endswith(" True"), proc.stdout
    assert (tmp_path / "out" / "mine.idx").exists()
