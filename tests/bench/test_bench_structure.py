"""bench/structure.py (the package's structure in figures) reads what the code says: an arrow
added to a copy of the package shows up as the circle it closes."""

import os
import shutil

import pytest

from bench.structure import PACKAGE, measure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _copy(tmp_path):
    shutil.copytree(os.path.join(ROOT, PACKAGE), tmp_path / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_native"))
    return tmp_path


def test_figures_of_this_checkout():
    figures = measure(ROOT)
    assert figures["modules"] > 100 and figures["arrows"] > figures["modules"]
    assert figures["circles_static"] == []


# slow: each of the two tests below reads a copy of the package twice (~4 CPU-s); the figures of
# this checkout, above, keep bench/structure.py in the fast tier.
@pytest.mark.slow
def test_a_runtime_lookup_that_closes_a_circle_is_counted(tmp_path):
    root = _copy(tmp_path)
    before = measure(str(root))
    with open(root / PACKAGE / "storage" / "blocks.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _late():\n    from importlib import import_module\n"
                "    return import_module('..reader', __package__)\n")
    after = measure(str(root))
    assert f"{PACKAGE}.storage.blocks -> {PACKAGE}.reader" in after["runtime_lookups"]
    assert after["circles_static"] == before["circles_static"]
    assert any({f"{PACKAGE}.reader", f"{PACKAGE}.storage.blocks"} <= set(c)
               for c in after["circles_with_runtime_lookups"])


@pytest.mark.slow
def test_is_remote_callers_outside_storage_are_counted(tmp_path):
    root = _copy(tmp_path)
    before = measure(str(root))
    with open(root / PACKAGE / "format.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _where(p):\n    from .storage.urls import is_remote\n    return is_remote(p)\n")
    after = measure(str(root))
    assert after["is_remote_calls_outside_storage"] == before["is_remote_calls_outside_storage"] + 1
