"""The import contract (``[tool.importlinter]`` in pyproject.toml, docs/CONTRIBUTING.md "The
floors") is kept, and it can fail: a throw-away copy of the package with one arrow added is
refused by the contract that arrow breaks."""

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("importlinter", reason="import-linter is in the [test] extra")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "megatron_sft_idx")
CONTRACTS = {"floors", "acyclic", "storage-knows-no-dataset", "engines", "engine-choice", "clis-on-top",
             "no-torch-in-core", "ray-in-its-engine", "object-store-clients", "records-know-no-run"}


def lint_imports(cwd: str) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package importable from ``cwd``, with the contracts of its pyproject.toml."""
    env = dict(os.environ, PYTHONPATH=cwd)
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_import_contract_is_kept():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        declared = {c["id"] for c in tomllib.load(f)["tool"]["importlinter"]["contracts"]}
    assert declared == CONTRACTS
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in proc.stdout, proc.stdout


def test_records_contract_lists_every_module_of_the_run():
    """The records wing's contract is exhaustive: every module of ``preprocess/`` outside
    ``records/`` (the run) is one it may not import, so a new run module cannot be forgotten."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = {c["id"]: c for c in tomllib.load(f)["tool"]["importlinter"]["contracts"]}
    forbidden = set(contracts["records-know-no-run"]["forbidden_modules"])
    here = os.path.join(PACKAGE, "preprocess")
    run = {f"megatron_sft_idx.preprocess.{os.path.splitext(name)[0]}" for name in os.listdir(here)
           if name != "records" and name != "__init__.py" and name != "__pycache__"
           and (name.endswith(".py") or os.path.isdir(os.path.join(here, name)))}
    assert run, here
    assert run == forbidden, f"run modules not forbidden: {sorted(run - forbidden)}; gone: {sorted(forbidden - run)}"


# (module of the copy, the line appended to it, the contracts it must break)
BACK_ARROWS = [
    ("storage/blocks.py", "from ..reader import MMapIndexedDataset", {"floors", "storage-knows-no-dataset", "acyclic"}),
    ("format.py", "from . import metadata", {"floors", "acyclic"}),
    ("preprocess/plan.py", "from .driver import run", {"acyclic"}),
    ("preprocess/engines/base.py", "from .ray import RayEngine", {"engines", "acyclic"}),
    ("preprocess/driver.py", "from .engines.local import LocalEngine", {"engine-choice"}),
    ("gate/content.py", "from .cli import main", {"clis-on-top", "acyclic"}),
    ("reader.py", "import torch", {"no-torch-in-core"}),
    ("preprocess/tokenize.py", "import ray", {"ray-in-its-engine"}),
    ("storage/blocks.py", "import boto3", {"object-store-clients"}),
    ("preprocess/records/shapes.py", "from ..workdir import WorkDir", {"records-know-no-run"}),
    ("storage/new_module.py", "X = 1", set()),  # a new module of a listed package is placed by its package
    ("new_module.py", "X = 1", {"floors"}),  # a new top-level module must be given a floor
]


@pytest.mark.parametrize("module,line,broken", BACK_ARROWS, ids=[f"{m}:{ln}" for m, ln, _ in BACK_ARROWS])
def test_an_added_arrow_is_refused_by_its_contract(tmp_path, module, line, broken):
    shutil.copytree(PACKAGE, tmp_path / "megatron_sft_idx",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_native"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    with open(tmp_path / "megatron_sft_idx" / module, "a", encoding="utf-8") as f:
        f.write(f"\n{line}  # added by tests/project/test_architecture.py\n")
    proc = lint_imports(str(tmp_path))
    out = proc.stdout + proc.stderr
    assert str(tmp_path) in _analysed_package(tmp_path), "the copy, not the checkout, must be checked"
    assert proc.returncode == (1 if broken else 0), out
    assert f"Contracts: {len(CONTRACTS) - len(broken)} kept, {len(broken)} broken." in out, out
    names = _contract_names()
    for contract in CONTRACTS:
        verdict = "BROKEN" if contract in broken else "KEPT"
        assert any(ln.startswith(names[contract] + " ") and verdict in ln for ln in out.splitlines()), \
            f"{contract} should be {verdict}:\n{out}"


def _contract_names() -> dict:
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return {c["id"]: c["name"] for c in tomllib.load(f)["tool"]["importlinter"]["contracts"]}


def _analysed_package(cwd) -> str:
    """Where the interpreter lint-imports runs in finds megatron_sft_idx from ``cwd``."""
    code = "import importlib.util; print(importlib.util.find_spec('megatron_sft_idx').origin)"
    return subprocess.run([sys.executable, "-c", code], cwd=str(cwd), env=dict(os.environ, PYTHONPATH=str(cwd)),
                          capture_output=True, text=True, check=True).stdout
