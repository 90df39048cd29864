"""The real install path: sdist -> wheel -> a throwaway venv, with and without a C++ compiler.

With a compiler the wheel carries the native library and ``sft_idx_check`` next to the package,
and both work from any directory with no environment variable. Without one (``CXX=/bin/false``,
and a compiler that is not there at all) the install still succeeds, records why, and the Python
reader and gate do the work: the fallback is checked to really happen, not assumed.

Cost: one C++ build (~10-20 s on 2 cores) plus two venvs that borrow this interpreter's
site-packages (``--system-site-packages``, ``pip --no-deps --no-index``): nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

pytestmark = [pytest.mark.packaging, pytest.mark.subprocess, pytest.mark.timeout(1800)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "golden", "v1_0", "tiny")
NATIVE = ("megatron_sft_idx/_native/libsft_idx.so", "megatron_sft_idx/_native/sft_idx_check")
NOT_BUILT = "megatron_sft_idx/_native/NOT_BUILT"
# What a checkout may hold that is not source: never copied into the tree the sdist is made from.
_NOT_SOURCE = shutil.ignore_patterns(".git", "build", "dist", "out", "*.egg-info", "__pycache__", "_native",
                                     ".hypothesis", ".pytest_cache", "results", "*.pyc")


def clean_env(**extra):
    """The environment minus PYTHONPATH (which points at this checkout), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRON_SFT_IDX_NATIVE",
                                                            "MEGATRON_SFT_IDX_NATIVE_LIB")}
    env.update(extra)
    return env


def run(cmd, cwd, env=None, check=True, timeout=600):
    proc = subprocess.run(cmd, cwd=str(cwd), env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def build_sdist(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    # What an editable install leaves in a checkout: it must not reach the sdist.
    (source / "megatron_sft_idx" / "_native").mkdir()
    (source / "megatron_sft_idx" / "_native" / "libsft_idx.so").write_bytes(b"a stale build")
    out = tmp_path / "sdist"
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    name = run([sys.executable, "-c", code], source).stdout.strip().splitlines()[-1]
    return out / name


def build_wheel(sdist, tmp_path, **env):
    out = tmp_path / "wheel"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
         "-w", str(out), str(sdist)], tmp_path, env=clean_env(**env))
    (wheel,) = out.glob("*.whl")
    return wheel


def make_venv(wheel, tmp_path):
    """A venv on this environment's packages (numpy, numba, ...) with only the wheel installed into it.

    ``--system-site-packages`` alone exposes the *base* interpreter's packages: run from inside a
    virtualenv, the new venv would not see the virtualenv's numba. So this environment's own
    site-packages directories are added by a ``.pth`` file, after the venv's own (where the wheel
    goes, and wins). A ``.pth`` line adds a directory without running the ``.pth`` files inside
    it, so this checkout's editable install stays out of the venv.
    """
    import site

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    own = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).stdout.strip()
    ours = [p for p in site.getsitepackages() if os.path.isdir(p)]
    with open(os.path.join(own, "_outer_environment.pth"), "w") as f:
        f.write("".join(p + "\n" for p in ours))
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation", "--ignore-installed",
         "--no-cache-dir", "-q", str(wheel)], tmp_path)
    return venv


def venv_python(venv, code, cwd, **env):
    return run([str(venv / "bin" / "python"), "-c", code], cwd, env=clean_env(**env), check=False)


PROBE = """
import json, megatron_sft_idx, megatron_sft_idx.native as native
out = {"package": megatron_sft_idx.__file__, "available": native.available()}
try:
    out["library"] = native.library_path()
    shard = native.NativeShard(%(golden)r)
    out["packs"] = len(shard)
    out["passed"] = native.validate(%(golden)r).passed
except native.NativeLibraryError as exc:
    out["error"] = str(exc)
from megatron_sft_idx import MMapIndexedDataset
out["python_reader_packs"] = len(MMapIndexedDataset(%(golden)r))
print(json.dumps(out))
""" % {"golden": GOLDEN}


def probe(venv, cwd, **env):
    proc = venv_python(venv, PROBE, cwd, **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_sdist_wheel_and_install_with_a_compiler(tmp_path):
    sdist = build_sdist(tmp_path)
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"csrc/build.sh", "csrc/sft_idx_c.h", "csrc/sft_idx_check.cpp", "csrc/CMakeLists.txt", "setup.py",
            "pyproject.toml", "docs/FORMAT.md"} <= names
    assert not [n for n in names if "megatron_sft_idx/_native" in n or n.endswith((".so", ".o"))], \
        "a build in the checkout leaked into the sdist"

    wheel = build_wheel(sdist, tmp_path)  # from the sdist: proves the sdist alone is enough to build
    assert "-py3-none-" in wheel.name, wheel.name  # one wheel per platform: the .so does not link libpython
    with zipfile.ZipFile(wheel) as z:
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
    for name in NATIVE:
        assert name in modes, f"{name} missing from {wheel.name}: {sorted(modes)}"
        assert modes[name] & 0o111, f"{name} is not executable in the wheel"
    assert NOT_BUILT not in modes

    venv = make_venv(wheel, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    found = probe(venv, elsewhere)
    assert found["package"].startswith(str(venv)), found  # the installed copy, not this checkout
    assert found["available"] and found["library"].startswith(str(venv)), found
    assert (found["packs"], found["passed"], found["python_reader_packs"]) == (3, True, 3), found

    checker = venv / "bin" / "sft_idx_check"
    proc = run([str(checker), GOLDEN, "--json"], elsewhere)
    assert json.loads(proc.stdout)["passed"] is True
    bad = run([str(checker), str(elsewhere / "nothing")], elsewhere, check=False)
    assert bad.returncode == 2
    for script in ("check-idx", "preprocess-sft", "write-sft-manifest"):
        assert run([str(venv / "bin" / script), "--help"], elsewhere).stdout.startswith("usage:"), script

    disabled = probe(venv, elsewhere, MEGATRON_SFT_IDX_NATIVE="0")
    assert not disabled["available"] and "MEGATRON_SFT_IDX_NATIVE=0" in disabled["error"], disabled
    off = run([str(checker), GOLDEN], elsewhere, env=clean_env(MEGATRON_SFT_IDX_NATIVE="0"), check=False)
    assert off.returncode == 2 and len(off.stderr.strip().splitlines()) == 1, off.stderr


def test_install_without_a_compiler_falls_back_to_python(tmp_path):
    sdist = build_sdist(tmp_path)
    reasons = {"no-such-c++-compiler": "C++ compiler 'no-such-c++-compiler' not found",   # no compiler at all
               "/bin/false": "the C++ build with CXX=/bin/false failed"}  # one that fails (no zlib.h, ...)
    for cxx, reason in reasons.items():
        out = tmp_path / cxx.strip("/").replace("/", "_")
        out.mkdir()
        wheel = build_wheel(sdist, out, CXX=cxx)
        with zipfile.ZipFile(wheel) as z:
            assert not set(z.namelist()) & set(NATIVE), f"CXX={cxx}, yet a native build is in the wheel"
            assert z.read(NOT_BUILT).decode().startswith(reason)

    venv = make_venv(wheel, tmp_path)  # the last one: CXX=/bin/false
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    found = probe(venv, elsewhere)
    assert found["package"].startswith(str(venv)), found
    assert not found["available"] and reason in found["error"], found
    assert found["python_reader_packs"] == 3  # the Python reader does the work
    gate = run([str(venv / "bin" / "check-idx"), GOLDEN, "--json"], elsewhere)
    assert json.loads(gate.stdout)["passed"] is True
    checker = run([str(venv / "bin" / "sft_idx_check"), GOLDEN], elsewhere, check=False)
    assert checker.returncode == 2 and "Traceback" not in checker.stderr
    (line,) = checker.stderr.strip().splitlines()
    assert reason in line and "check-idx" in line, line
