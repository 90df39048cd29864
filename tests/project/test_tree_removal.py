"""One guard every recursive delete goes through (``megatron_sft_idx._atomic.remove_tree``): it
refuses a path that is not strictly inside the directory its caller owns, and no other module of
the package deletes a tree (an AST scan finds any ``shutil.rmtree`` however imported, and is
shown to find one)."""

import ast
import os

import pytest

from megatron_sft_idx._atomic import inside, remove_tree
from megatron_sft_idx.errors import ShardError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "megatron_sft_idx")
GUARD = os.path.join(PACKAGE, "_atomic.py")


def tree_removals(source: str):
    """``(line, text)`` of every call in ``source`` that removes a tree without the guard."""
    tree = ast.parse(source)
    names = {"rmtree"}   # from shutil import rmtree [as x]
    modules = {"shutil"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "shutil":
            names |= {a.asname or a.name for a in node.names if a.name == "rmtree"}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "shutil"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("rmtree", "removedirs") and isinstance(f.value, ast.Name) \
                and f.value.id in modules | {"os"}:
            found.append((node.lineno, f"{f.value.id}.{f.attr}"))
        elif isinstance(f, ast.Name) and f.id in names:
            found.append((node.lineno, f.id))
    return found


def test_no_module_removes_a_tree_outside_the_guard():
    offenders = []
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(directory, name)
            if name.endswith(".py") and path != GUARD:
                with open(path, encoding="utf-8") as f:
                    offenders += [f"{os.path.relpath(path, ROOT)}:{line}: {what}"
                                  for line, what in tree_removals(f.read())]
    assert not offenders, "delete trees through _atomic.remove_tree:\n" + "\n".join(offenders)


def test_the_scan_finds_every_spelling():
    assert tree_removals("import shutil\nshutil.rmtree(p)")
    assert tree_removals("import shutil as s\ns.rmtree(p, ignore_errors=True)")
    assert tree_removals("from shutil import rmtree as r\nr(p)")
    assert tree_removals("import os\nos.removedirs(p)")
    assert not tree_removals("from megatron_sft_idx._atomic import remove_tree\nremove_tree(p, q)")


def test_the_guard_removes_only_strictly_inside_its_directory(tmp_path):
    own = tmp_path / "run"
    (own / "a" / "b").mkdir(parents=True)
    (own / "a" / "b" / "f").write_bytes(b"x")
    neighbour = tmp_path / "other"
    neighbour.mkdir()
    (neighbour / "keep").write_bytes(b"k")
    for bad in (str(own), str(own / ".."), str(own / "a" / ".." / ".."), str(neighbour), str(tmp_path), "/"):
        with pytest.raises(ShardError, match="outside the one this run owns"):
            remove_tree(bad, str(own))
    # a link inside pointing outside: the link goes, its target stays
    (own / "link").symlink_to(neighbour, target_is_directory=True)
    remove_tree(str(own / "link"), str(own))
    assert not (own / "link").exists() and (neighbour / "keep").exists()
    # a path through a link out of the directory is not inside it
    (own / "out").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ShardError):
        remove_tree(str(own / "out" / "other"), str(own))
    assert (neighbour / "keep").exists()
    remove_tree(str(own / "a"), str(own))
    assert not (own / "a").exists() and own.exists()
    remove_tree(str(own / "gone"), str(own))   # nothing there: nothing to do
    assert inside(str(own / "x" / "y"), str(own)) and not inside(str(own / "."), str(own))
