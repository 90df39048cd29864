"""The package's structure in figures: the measurements issue 28 asked for, before and after a move.

    python -m bench.structure [--root DIR] [--json]

``--root`` is a checkout (default: this one); the package is read from its files, never imported.
Prints: modules and import arrows (imports inside functions included, as import-linter counts
them), runtime look-ups (``importlib.import_module`` / ``__import__`` with a constant name) and the
import circles they close, alias modules (modules that only re-export another module's names), the
modules outside ``storage/`` that ask ``is_remote(``, and ``preprocess/``'s modules and the arrows
among them. Circles are the strongly connected components of the module graph (static arrows plus
runtime look-ups) with more than one module.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from typing import Dict, List, Set, Tuple

PACKAGE = "megatron_sft_idx"


def _modules(root: str) -> Dict[str, str]:
    """Dotted module name -> file path, for every .py file of the package under ``root``."""
    out = {}
    base = os.path.join(root, PACKAGE)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "_native")]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].replace(os.sep, ".")
            out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, name)
    return out


def _resolve(module: str, is_package: bool, level: int, name: str) -> str:
    if level == 0:
        return name
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


def _target(modules: Dict[str, str], dotted: str) -> str:
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted


def graph(root: str) -> Tuple[Dict[str, str], Set[Tuple[str, str]], Set[Tuple[str, str]], Dict[str, ast.AST]]:
    """(modules, static arrows, runtime look-up arrows, parsed trees)."""
    modules = _modules(root)
    static, runtime, trees = set(), set(), {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        trees[module] = tree
        is_package = path.endswith("__init__.py")
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module or "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                    "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                name = node.args[0].value
                level = len(name) - len(name.lstrip("."))
                dotted = _resolve(module, is_package, level, name.lstrip(".")) if level else name
                target = _target(modules, dotted)
                if target.startswith(PACKAGE) and target != module:
                    runtime.add((module, target))
                continue
            for t in targets:
                target = _target(modules, t)
                if target.startswith(PACKAGE) and target != module:
                    static.add((module, target))
    return modules, static, runtime, trees


def _circles(nodes, edges) -> List[List[str]]:
    """Strongly connected components (Tarjan, iterative) of more than one node."""
    succ = {n: [] for n in nodes}
    for a, b in edges:
        succ[a].append(b)
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = counter[0]; counter[0] += 1; stack.append(start); on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]; counter[0] += 1; stack.append(nxt); on.add(nxt)
                work.append((nxt, iter(succ[nxt])))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return out


def _is_alias(tree: ast.Module) -> bool:
    """A module whose body is only a docstring, imports, ``__all__`` and a moved-names table/getattr."""
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if not body:
        return False
    doc = ast.get_docstring(tree) or ""
    kinds = all(isinstance(n, (ast.Import, ast.ImportFrom)) or (isinstance(n, ast.Assign) and any(
        getattr(t, "id", "") in ("__all__",) for t in n.targets)) for n in body)
    return kinds and any(isinstance(n, ast.ImportFrom) for n in body) or "alias" in doc.lower()[:200]


def _asks_is_remote(tree: ast.Module) -> int:
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call)
               and getattr(n.func, "attr", getattr(n.func, "id", None)) == "is_remote")


def measure(root: str) -> dict:
    modules, static, runtime, trees = graph(root)
    nodes = sorted(modules)
    pre = [m for m in nodes if m.startswith(f"{PACKAGE}.preprocess.") or m == f"{PACKAGE}.preprocess"]
    pre_set = set(pre)
    asking = {m: _asks_is_remote(trees[m]) for m in nodes if not m.startswith(f"{PACKAGE}.storage")}
    asking = {m: c for m, c in asking.items() if c}
    return {
        "modules": len(nodes),
        "arrows": len(static),
        "runtime_lookups": sorted(f"{a} -> {b}" for a, b in runtime),
        "circles_static": _circles(nodes, static),
        "circles_with_runtime_lookups": _circles(nodes, static | runtime),
        "alias_modules": sorted(m for m in nodes if m != PACKAGE and not m.endswith("__init__")
                                and not modules[m].endswith("__init__.py") and _is_alias(trees[m])),
        "modules_asking_is_remote_outside_storage": len(asking),
        "is_remote_calls_outside_storage": sum(asking.values()),
        "preprocess_modules": len(pre),
        "preprocess_arrows": sum(1 for a, b in static if a in pre_set and b in pre_set),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.structure", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    figures = measure(args.root)
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    for key, value in figures.items():
        if isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"    {item}")
        else:
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
