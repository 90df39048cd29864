"""The suite writes only below its session root (tests/conftest.py), which it removes at the end.

The home directory, the temporary directory and Ray's session directories of every test process
(xdist workers included) and of every subprocess they start point inside it.
"""

import os
import subprocess
import sys
import tempfile


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(root)]) == os.path.realpath(root)


def test_home_temp_and_ray_point_inside_the_session_root(tmp_path):
    root = os.environ["MEGATRON_SFT_IDX_TEST_ROOT"]
    assert _inside(str(tmp_path), root)
    for key in ("HOME", "TMPDIR", "RAY_TMPDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR"):
        assert _inside(os.environ[key], root), (key, os.environ[key], root)
    assert _inside(tempfile.gettempdir(), root)
    assert _inside(os.path.expanduser("~"), root)


def test_a_subprocess_inherits_the_session_root():
    code = "import os, tempfile; print(tempfile.gettempdir()); print(os.path.expanduser('~'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    root = os.environ["MEGATRON_SFT_IDX_TEST_ROOT"]
    assert all(_inside(p, root) for p in out), (out, root)
