import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# --------------------------------------------------------------------------- S3 on loopback

#: Block size of remote reads under the ``s3`` fixture (small, so packs straddle blocks).
S3_BLOCK_SIZE = 4096


@pytest.fixture(scope="module")
def loop():
    """moto's S3 server on 127.0.0.1 behind a counting, fault-injecting proxy (bench/s3loop.py)."""
    from bench.s3loop import S3Loop

    with S3Loop() as server:
        yield server


@pytest.fixture
def s3(loop, monkeypatch, tmp_path):
    """AWS env pointing at the proxy, an empty index cache, small blocks, quick retries."""
    from bench.s3loop import reset_clients

    for key, value in loop.env().items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MEGATRON_SFT_IDX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MEGATRON_SFT_IDX_BLOCK_SIZE", str(S3_BLOCK_SIZE))
    monkeypatch.setenv("MEGATRON_SFT_IDX_RETRIES", "4")
    reset_clients()
    loop.clear()
    yield loop
    loop.clear()
    reset_clients()


@pytest.fixture
def bucket(s3):
    """A fresh, empty bucket on the ``s3`` server."""
    import uuid

    return s3.make_bucket(f"b-{uuid.uuid4().hex[:12]}")


# --------------------------------------------------------------------------- disks


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs at tmp_path/fs, or None where this sandbox cannot mount one (tests/faults.py)."""
    from faults import tmpfs

    with tmpfs(tmp_path / "fs") as path:
        yield path


@pytest.fixture(scope="session")
def native_lib(tmp_path_factory):
    """Path of the native library (csrc/), built once per test session (per xdist worker).

    g++ is part of this project's toolchain: a missing compiler fails the tests that need it.
    """
    import shutil
    import subprocess

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.fail("g++ is not installed: the native reader (csrc/) cannot be built. Install g++ "
                    "(apt-get install -y g++ zlib1g-dev); it is part of this project's toolchain.")
    out = tmp_path_factory.mktemp("native-session")
    proc = subprocess.run(["bash", os.path.join(ROOT, "csrc", "build.sh"), str(out)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.fail(f"csrc/build.sh failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return str(out / "libsft_idx.so")


# tests/compat/ imports the real megatron-core / Megatron-Bridge of one installed stack each;
# tests/test_compat_stacks.py runs it once per stack in a subprocess with that stack on the path.
if not os.environ.get("MEGATRON_SFT_IDX_STACK"):
    collect_ignore = ["compat"]


# --------------------------------------------------------------------------- chat template families


@pytest.fixture(scope="session")
def families(tmp_path_factory):
    """{family: tokenizer directory}: stand-in tokenizers with each family's special tokens and a
    template reproducing its documented format (tests/chat_families.py)."""
    from chat_families import FAMILIES, make_tokenizer

    base = tmp_path_factory.mktemp("families")
    return {name: make_tokenizer(str(base / name), name) for name in FAMILIES}
