"""The repository's own rule for commits (docs/CONTRIBUTING.md "Commits"): a subject of at most
72 characters, details in the body. Checked on every commit since the rule was written."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The last commit before the rule: the subjects after it are held to it.
RULE_SINCE = "97966a2"
MAX_SUBJECT = 72


def _git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=60)


def test_commit_subjects_are_short():
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout (an sdist or a copy): no history to check")
    if _git("cat-file", "-e", RULE_SINCE + "^{commit}").returncode != 0:
        pytest.skip(f"a shallow clone without {RULE_SINCE}: no history to check")
    log = _git("log", "--format=%h%x00%s", f"{RULE_SINCE}..HEAD")
    assert log.returncode == 0, log.stderr
    long = [line.replace("\0", " ") for line in log.stdout.splitlines()
            if len(line.split("\0", 1)[1]) > MAX_SUBJECT]
    assert not long, f"commit subjects over {MAX_SUBJECT} characters (details go in the body): {long}"
