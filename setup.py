"""The optional native build; the package metadata is in pyproject.toml.

``pip install`` runs ``csrc/build.sh`` (the one build recipe; honours CXX and CXXFLAGS) and ships
``libsft_idx.so`` and ``sft_idx_check`` in ``megatron_sft_idx/_native/``, where
``megatron_sft_idx.native`` finds them. Like msgpack's C extension the build is optional: with
no compiler, no zlib headers, no bash, or ``MEGATRON_SFT_IDX_NATIVE=0``, the install succeeds
without it and ``_native/NOT_BUILT`` records why (the Python reader and gate need nothing native).
"""

import os
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_SCRIPT = os.path.join(HERE, "csrc", "build.sh")
NATIVE_DIR = os.path.join("megatron_sft_idx", "_native")   # must match megatron_sft_idx/native.py
OUTPUTS = ("libsft_idx.so", "sft_idx_check")
NOT_BUILT = "NOT_BUILT"


def _why_not(returncode, stderr):
    """One line: why csrc/build.sh produced nothing."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if returncode == 2 and lines:  # build.sh: the compiler is not there
        return lines[-1].replace("build.sh: ", "")
    errors = [line for line in lines if "error" in line.lower()]
    detail = errors[0] if errors else f"exit status {returncode}"
    return f"the C++ build with CXX={os.environ.get('CXX', 'g++')} failed: {detail}"


class BuildNative(build_ext):
    """Builds the native reader/validator instead of Python extension modules (there are none)."""

    def _target_dir(self):
        # Editable installs (PEP 660) set inplace: the library goes into the source tree.
        return os.path.join(HERE if self.inplace else self.build_lib, NATIVE_DIR)

    def run(self):
        out = self._target_dir()
        os.makedirs(out, exist_ok=True)
        for name in OUTPUTS + (NOT_BUILT,):  # never leave a stale build next to a failed one
            if os.path.exists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
        reason = self._build(out)
        if reason is None:
            return
        with open(os.path.join(out, NOT_BUILT), "w", encoding="utf-8") as f:
            f.write(reason + "\n")
        print(f"megatron_sft_idx: the native reader/validator was not built ({reason}); "
              f"installing without it: the Python reader and gate do not need it", file=sys.stderr)

    def _build(self, out):
        """None when both outputs were built, else the reason they were not."""
        if os.environ.get("MEGATRON_SFT_IDX_NATIVE", "1").strip() == "0":
            return "skipped: MEGATRON_SFT_IDX_NATIVE=0 at install time"
        if not os.path.isfile(BUILD_SCRIPT):
            return "csrc/ is not in this source tree"
        try:
            proc = subprocess.run([shutil.which("bash") or "/bin/bash", BUILD_SCRIPT, out], capture_output=True,
                                  text=True)
        except OSError as exc:  # no bash
            return f"cannot run csrc/build.sh: {exc}"
        sys.stderr.write(proc.stderr)
        if proc.returncode != 0:
            return _why_not(proc.returncode, proc.stderr)
        return None

    def get_outputs(self):
        out = self._target_dir()
        return [os.path.join(out, name) for name in OUTPUTS + (NOT_BUILT,) if os.path.exists(os.path.join(out, name))]

    def get_output_mapping(self):
        return {}


class NativeDistribution(Distribution):
    def has_ext_modules(self):
        return True  # so that build runs build_ext and the wheel is platform-specific


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        # The native code does not link libpython: one wheel per platform serves every Python 3.
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(distclass=NativeDistribution, cmdclass={"build_ext": BuildNative, "bdist_wheel": PlatformWheel})
