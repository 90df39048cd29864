"""Imports sit at the top of a module (docs/CONTRIBUTING.md "Imports"): an import inside a
function is either of a heavy or optional package named in :data:`HEAVY` (imported only where
it is needed, often after ``require_extra`` names the extra it comes with), or says on its line
why it waits, ``# (start-up: ...)`` -- a command's ``--help``, a local run or a DataLoader worker
must not pay for what only another path needs. The checker reads every module's syntax tree;
it is shown refusing a plain import fed to it as source."""

import ast
import os
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "megatron_sft_idx")

#: Packages a function may import without saying why: heavy (seconds, or hundreds of MiB) or
#: optional (an extra of pyproject.toml, or another project's runtime), each for one path only.
HEAVY = {
    "torch", "megatron", "transformers", "trl", "datasets", "huggingface_hub",   # training, hub, templates
    "tokenizers", "gigatoken", "jinja2",                                           # tokenizing
    "ray",                                                                         # --engine ray
    "boto3", "botocore", "multistorageclient",                                     # object storage
    "pyarrow", "duckdb", "polars", "matplotlib",                                   # Arrow, SQL, plots
    "zstandard", "zlib_ng", "psutil", "tqdm",                                      # optional extras
    "numba",                                                                       # its LLVM
}
TAG = "(start-up:"


def function_level_imports(source: str, name: str = "<source>"):
    """``(line, statement text)`` of every import inside a function of ``source`` that is
    neither of a :data:`HEAVY` package nor justified by a ``(start-up: ...)`` comment.

    A comment justifies its statement when it is on one of the statement's lines or on the
    comment lines right above it; a run of consecutive imports is justified by one of them (a
    comment may continue over the next import's line)."""
    lines = source.splitlines()
    tree = ast.parse(source, name)
    found = []

    def tagged(node) -> bool:
        if any(TAG in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)):
            return True
        i = node.lineno - 1
        while i >= 1 and lines[i - 1].strip().startswith("#"):
            if TAG in lines[i - 1]:
                return True
            i -= 1
        return False

    def heavy(node) -> bool:
        if isinstance(node, ast.ImportFrom):
            return node.level == 0 and node.module.split(".")[0] in HEAVY
        return all(a.name.split(".")[0] in HEAVY for a in node.names)

    def visit(node, in_function: bool) -> None:
        for _, value in ast.iter_fields(node):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                run = []   # consecutive imports of one block
                for child in value:
                    if isinstance(child, (ast.Import, ast.ImportFrom)):
                        run.append(child)
                        continue
                    check(run, in_function)
                    run = []
                    visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
                check(run, in_function)
            elif isinstance(value, list):
                for v in value:
                    if isinstance(v, ast.AST):   # (except handlers, match cases: their own blocks)
                        visit(v, in_function)
            elif isinstance(value, ast.AST):
                visit(value, in_function)

    def check(run, in_function: bool) -> None:
        if not in_function or not run:
            return
        justified = any(tagged(n) for n in run)
        for n in run:
            if not heavy(n) and not justified:
                found.append((n.lineno, lines[n.lineno - 1].strip()))

    visit(tree, False)
    return found


def _modules():
    for directory, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(directory, name)


def test_every_function_level_import_is_heavy_or_says_why():
    offenders = []
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            source = f.read()
        rel = os.path.relpath(path, ROOT)
        offenders += [f"{rel}:{line}: {text}" for line, text in function_level_imports(source, rel)]
    assert not offenders, ("imports inside functions that are neither of a heavy package (HEAVY) nor say "
                           "'# (start-up: why)'; move them to the module's top:\n" + "\n".join(offenders))


def test_the_checker_refuses_a_plain_import_and_accepts_the_rule():
    source = textwrap.dedent('''
        import os

        def plain():
            from .reader import MMapIndexedDataset
            return MMapIndexedDataset

        def stdlib():
            if os.name:
                import json
            return json

        def heavy():
            import pyarrow.parquet as pq
            from torch.utils.data import DataLoader
            return pq, DataLoader

        def said():
            from .storage.remote import RemoteShardFiles   # (start-up: local reads never load it)
            return RemoteShardFiles

        def said_above_a_run():
            # (start-up: only this path
            # needs these)
            from .native import checker_path
            from .storage.urls import local_only
            return checker_path, local_only

        class Reader:
            def method(self):
                try:
                    from .gate import check
                except ImportError:
                    return None
                return check

        from .format import IDX_SUFFIX   # module level: not this rule's business
        ''')
    found = function_level_imports(source)
    assert [text for _, text in found] == ["from .reader import MMapIndexedDataset", "import json",
                                           "from .gate import check"]


def test_a_plain_import_added_to_a_real_module_is_refused():
    """What the package test would say of ``reader.py`` with one plain function-level import
    appended (its own start-up imports stay accepted)."""
    path = os.path.join(PACKAGE, "reader.py")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    assert function_level_imports(source) == []
    added = source + "\n\ndef _added():\n    from .multi import MultiShardDataset\n    return MultiShardDataset\n"
    line = added.splitlines().index("    from .multi import MultiShardDataset") + 1
    assert function_level_imports(added) == [(line, "from .multi import MultiShardDataset")]
