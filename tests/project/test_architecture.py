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
CONTRACTS = {"floors", "acyclic", "storage-knows-no-dataset", "storage-private", "engines", "engine-choice",
             "clis-on-top", "no-torch-in-core", "ray-in-its-engine", "object-store-clients", "records-know-no-run",
             "no-old-names", "cli-arguments"}


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
    ("preprocess/driver.py", "from .arguments import usage_problem", {"cli-arguments"}),
    ("reader.py", "import torch", {"no-torch-in-core"}),
    ("preprocess/tokenize.py", "import ray", {"ray-in-its-engine"}),
    ("storage/blocks.py", "import boto3", {"object-store-clients"}),
    ("preprocess/records/shapes/registry.py", "from ...workdir import WorkDir", {"records-know-no-run"}),
    ("gate/remote.py", "from ..storage._stores import store_for", {"storage-private"}),
    ("reader.py", "from .storage import _retry", {"storage-private"}),
    ("storage/remote.py", "from ._retry import with_retries", set()),   # inside storage: its own business
    ("training/collate.py", "from .multi import MultiShardDataset", {"no-old-names"}),
    ("storage/new_module.py", "X = 1", set()),  # a new module of a listed package is placed by its package
    ("new_module.py", "X = 1", {"floors"}),  # a new top-level module must be given a floor
]


@pytest.mark.subprocess
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


def test_the_old_names_contract_lists_the_moved_modules_of_the_table():
    """``no-old-names`` forbids exactly the moved modules that still answer (``_moved.MOVED_MODULES``,
    warn-once); those exist as files, and a removed one does not."""
    import tomllib

    from megatron_sft_idx._moved import MOVED_MODULES

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = {c["id"]: c for c in tomllib.load(f)["tool"]["importlinter"]["contracts"]}
    working = {name for name, moved in MOVED_MODULES.items() if moved.works}
    assert set(contracts["no-old-names"]["forbidden_modules"]) == working
    for name, moved in MOVED_MODULES.items():
        path = os.path.join(ROOT, *name.split(".")) + ".py"
        assert os.path.isfile(path) == moved.works, path


# The lazy package faces look names up by their module's name (PEP 562); nothing else does.
IMPORTERS_BY_NAME = {"_lazy.py", "_console.py"}


def _runtime_imports(path: str) -> list:
    """``(line, what)`` of each ``import_module`` / ``__import__`` in the module at ``path``,
    called or imported, by any spelling (``importlib.import_module``, ``builtins.__import__``)."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("importlib", "builtins"):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if a.name in ("import_module", "__import__")]
        elif isinstance(node, ast.Name) and node.id in ("import_module", "__import__"):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and node.attr in ("import_module", "__import__"):
            found.append((node.lineno, f"...{node.attr}"))
    return found


def test_no_module_imports_by_name_outside_the_lazy_faces():
    """A runtime look-up by module name is an arrow the import contract cannot see (it is how
    storage once reached back up to the publisher and the reader): only ``_lazy`` (the package
    faces) and ``_console`` (the console scripts' targets) may make one."""
    found = {}
    for directory, _, names in os.walk(PACKAGE):
        for name in names:
            path = os.path.join(directory, name)
            if name.endswith(".py") and os.path.relpath(path, PACKAGE) not in IMPORTERS_BY_NAME:
                if _runtime_imports(path):
                    found[os.path.relpath(path, ROOT)] = _runtime_imports(path)
    assert not found, f"imports by name outside {sorted(IMPORTERS_BY_NAME)}: {found}"
    for allowed in IMPORTERS_BY_NAME:  # the rule has teeth: the two allowed modules do it
        assert _runtime_imports(os.path.join(PACKAGE, allowed)), allowed


def test_the_checker_of_imports_by_name_sees_every_spelling(tmp_path):
    spellings = ["import importlib\nimportlib.import_module('x')", "from importlib import import_module",
                 "__import__('x')", "import builtins\nbuiltins.__import__('x')", "mod = __import__"]
    for i, text in enumerate(spellings):
        path = tmp_path / f"m{i}.py"
        path.write_text(text + "\n")
        assert _runtime_imports(str(path)), text
    (tmp_path / "clean.py").write_text("import importlib.util\nfrom . import reader\n")
    assert not _runtime_imports(str(tmp_path / "clean.py"))


# What outside the package may still say an old name, and why.
OLD_NAME_ALLOWED = {("bench/preprocess_speed.py", "megatron_sft_idx.preprocess.pipeline")}  # the baseline's own


def _old_names_used(path: str, text: str) -> set:
    import ast

    from megatron_sft_idx._moved import MOVED_MODULES, MOVED_NAMES

    used = set()
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, ast.Import):
            used |= {a.name for a in node.names if a.name in MOVED_MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module in MOVED_MODULES:
                used.add(node.module)
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in MOVED_NAMES or (full in MOVED_MODULES and MOVED_MODULES[full].works):
                    used.add(full)
    return used


def test_tests_bench_tools_and_docs_use_only_the_new_names():
    """The project's own code outside the package (tests, benchmarks, scripts, examples, the
    Python blocks of the docs) imports no moved module or name (``megatron_sft_idx._moved``)."""
    import re

    found = {}
    for top in ("tests", "bench", "tools", "examples"):
        for directory, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    rel = os.path.relpath(path, ROOT)
                    with open(path, encoding="utf-8") as f:
                        used = {u for u in _old_names_used(path, f.read()) if (rel, u) not in OLD_NAME_ALLOWED}
                    if used:
                        found[rel] = sorted(used)
    docs = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", n)
                                                for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")]
    for path in docs:
        with open(path, encoding="utf-8") as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
        lines = [ln.strip() for b in blocks for ln in b.splitlines()  # blocks elide with "...": their imports
                 if re.match(r"\s*(from|import) megatron_sft_idx", ln) and not ln.rstrip().endswith(("(", "\\"))]
        used = _old_names_used(path, "\n".join(lines))
        if used:
            found[os.path.relpath(path, ROOT)] = sorted(used)
    assert not found, f"old names in use: {found}"
    assert _old_names_used("x.py", "from megatron_sft_idx.storage import publish\n"
                                   "import megatron_sft_idx.training.multi") == {
        "megatron_sft_idx.storage.publish", "megatron_sft_idx.training.multi"}


def test_every_relative_import_names_a_module_that_exists():
    """A module that moved leaves no import of its old path behind, also inside functions (which
    only fail when called, and which the contract skips when the module is missing)."""
    import ast

    missing = []
    for directory, _, names in os.walk(PACKAGE):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            package = os.path.relpath(directory, ROOT).split(os.sep)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level:
                    parts = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
                    base = os.path.join(ROOT, *parts)
                    if not (os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))):
                        missing.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {'.'.join(parts)}")
    assert not missing, missing
