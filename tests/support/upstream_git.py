"""An upstream repository snapshot as the golden generators read it (tests/compat/make_*_golden.py):
a bare mirror (the session's fetch tool writes ``.../repo`` with ``HEAD`` at its top) or a
checkout, a ref resolved to its commit, the files a PR adds at that commit, and a copy of an
installed side stack with those files written over it."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Dict, Iterable, List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_command(repo: str) -> List[str]:
    """``git`` pointed at ``repo``: ``--git-dir`` for a bare mirror, ``-C`` for a checkout."""
    return ["git", f"--git-dir={repo}"] if os.path.isfile(os.path.join(repo, "HEAD")) else ["git", "-C", repo]


def resolve(git: List[str], ref: str) -> str:
    """The commit ``ref`` names (a branch, a tag, ``refs/pull/N/head``)."""
    return subprocess.run(git + ["rev-parse", f"{ref}^{{commit}}"], check=True, capture_output=True,
                          text=True).stdout.strip()


def files_at(git: List[str], commit: str, paths: Iterable[str]) -> Dict[str, bytes]:
    """``{path: bytes}`` of each path at ``commit``."""
    return {p: subprocess.run(git + ["show", f"{commit}:{p}"], check=True, capture_output=True).stdout
            for p in paths}


def overlaid_stack(work: str, stack: str, sources: Dict[str, bytes]) -> str:
    """``.deps/<stack>`` copied to ``<work>/deps/<stack>`` with ``sources`` written over it; its path
    (its parent is the ``MEGATRON_SFT_IDX_DEPS`` directory of the copy)."""
    path = os.path.join(work, "deps", stack)
    shutil.copytree(os.path.join(ROOT, ".deps", stack), path, symlinks=True)
    for name, source in sources.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(source)
    return path
