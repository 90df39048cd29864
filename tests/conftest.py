import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

# --------------------------------------------------------------------------- a hermetic session
#
# The suite writes only below one directory that it removes at the end: the temporary directory
# (tmp_path, tempfile, torchrun's and torch's scratch), the home directory (Ray's auth token,
# matplotlib's font cache, anything else a library keeps under ~) and Ray's session directories.
# Set in the controlling process before xdist starts its workers, so they and every subprocess
# a test starts inherit it. MEGATRON_SFT_IDX_TEST_ROOT names the directory (tests/project/test_hermetic.py).
_ROOT_ENV = "MEGATRON_SFT_IDX_TEST_ROOT"


def _hermetic_environment(root: str) -> dict:
    home = os.path.join(root, "home")
    return {"TMPDIR": os.path.join(root, "tmp"), "HOME": home, "XDG_CACHE_HOME": os.path.join(home, ".cache"),
            "XDG_CONFIG_HOME": os.path.join(home, ".config"), "MPLCONFIGDIR": os.path.join(home, ".config", "mpl"),
            "RAY_TMPDIR": os.path.join(root, "ray"), _ROOT_ENV: root}


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    import tempfile

    if hasattr(config, "workerinput") or os.environ.get(_ROOT_ENV):
        return  # an xdist worker, or a pytest run inside a test: the environment is inherited
    root = tempfile.mkdtemp(prefix="msi-tests-")
    env = _hermetic_environment(root)
    for key, value in env.items():
        if key != _ROOT_ENV:
            os.makedirs(value, exist_ok=True)
    os.environ.update(env)
    tempfile.tempdir = env["TMPDIR"]  # gettempdir() may have been cached before this hook ran
    config._msi_test_root = root


def pytest_unconfigure(config):
    import shutil

    root = getattr(config, "_msi_test_root", None)
    if root and os.environ.get("MEGATRON_SFT_IDX_KEEP_TEST_ROOT") != "1":
        shutil.rmtree(root, ignore_errors=True)


#: Fixtures that start or use the S3 server on loopback: a test asking for one is marked ``remote``.
_REMOTE_FIXTURES = {"loop", "s3", "bucket", "hostile_server", "hostile"}


#: The longest single tests (a whole compat suite in a child interpreter each, 1.5-3 min): run first,
#: so that under ``-n 2`` the other worker works through the rest meanwhile instead of one of them
#: being the suite's last minutes alone.
_LONGEST_FIRST = ("tests/training/test_compat_stacks.py", "tests/training/test_compat_transformers.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _REMOTE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.remote)
    items.sort(key=lambda item: not item.nodeid.startswith(_LONGEST_FIRST))   # (stable: the rest keep their order)


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


# --------------------------------------------------------------------------- a hostile S3 server

#: Budgets of remote calls under the ``hostile`` fixture: small, so a stalled request fails fast.
HOSTILE_REQUEST_TIMEOUT, HOSTILE_OPERATION_TIMEOUT, HOSTILE_MAX_LIST_PAGES = 2.0, 4.0, 20


@pytest.fixture(scope="module")
def hostile_server():
    """moto behind the fault-injecting proxy in a process of its own (bench/s3loop.py LoopProcess):
    it can stall, trickle, ignore Range / If-Match, lie in its headers and list forever, and the
    test process's memory is only the client's."""
    from bench.s3loop import LoopProcess

    with LoopProcess(env={"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(256 << 20)}) as server:
        yield server


@pytest.fixture
def hostile(hostile_server, monkeypatch, tmp_path):
    """AWS env pointing at the hostile server, an empty index cache, 64 KiB blocks and short
    budgets (HOSTILE_* above); faults cleared before and after."""
    from bench.s3loop import reset_clients

    for key, value in hostile_server.env().items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(key, raising=False)
    settings = {"CACHE": str(tmp_path / "cache"), "BLOCK_SIZE": "65536", "RETRIES": "4",
                "REQUEST_TIMEOUT": str(HOSTILE_REQUEST_TIMEOUT), "OPERATION_TIMEOUT": str(HOSTILE_OPERATION_TIMEOUT),
                "MAX_LIST_PAGES": str(HOSTILE_MAX_LIST_PAGES)}
    for key, value in settings.items():
        monkeypatch.setenv("MEGATRON_SFT_IDX_" + key, value)
    reset_clients()
    hostile_server.clear()
    yield hostile_server
    hostile_server.clear()
    reset_clients()


# --------------------------------------------------------------------------- disks


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs at tmp_path/fs, or None where this sandbox cannot mount one (tests/support/faults.py)."""
    from support.faults import tmpfs

    with tmpfs(tmp_path / "fs") as path:
        yield path


@pytest.fixture(scope="session")
def native_build(tmp_path_factory):
    """``(library path, checker path)`` of the native code (csrc/), built with ``csrc/build.sh``
    once per test run: the xdist workers share one build in the session's root directory (the
    first to ask builds it under a lock, ~9 CPU-seconds; the others wait for it and reuse it).

    g++ is part of this project's toolchain: a missing compiler fails the tests that need it.
    """
    import fcntl
    import shutil
    import subprocess

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.fail("g++ is not installed: the native reader (csrc/) cannot be built. Install g++ "
                    "(apt-get install -y g++ zlib1g-dev); it is part of this project's toolchain.")
    root = os.environ.get(_ROOT_ENV) or str(tmp_path_factory.getbasetemp())
    out = os.path.join(root, "native-build")
    lib, cli = os.path.join(out, "libsft_idx.so"), os.path.join(out, "sft_idx_check")
    with open(os.path.join(root, "native-build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (os.path.exists(lib) and os.path.exists(cli)):
            proc = subprocess.run(["bash", os.path.join(ROOT, "csrc", "build.sh"), out], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                pytest.fail(f"csrc/build.sh failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return lib, cli


@pytest.fixture(scope="session")
def native_lib(native_build):
    """Path of the native library (csrc/), built once per test run (:func:`native_build`)."""
    return native_build[0]


# tests/compat/ imports the real megatron-core / Megatron-Bridge of one installed stack each;
# tests/training/test_compat_stacks.py runs it once per stack in a subprocess with that stack on the path.
if not os.environ.get("MEGATRON_SFT_IDX_STACK"):
    collect_ignore = ["compat"]


# --------------------------------------------------------------------------- chat template families


@pytest.fixture(scope="session")
def families(tmp_path_factory):
    """{family: tokenizer directory}: stand-in tokenizers with each family's special tokens and a
    template reproducing its documented format (tests/support/chat_families.py)."""
    from support.chat_families import FAMILIES, make_tokenizer

    base = tmp_path_factory.mktemp("families")
    return {name: make_tokenizer(str(base / name), name) for name in FAMILIES}


@pytest.fixture(scope="session")
def qwen3_store(tmp_path_factory, families):
    """A sequence store of 30 small records (plain OpenAI chats and reasoning of 1-3 turns) on the
    Qwen3 stand-in, in several partitions (``partition_bytes`` 2,048), pack size 256: what the
    repack conversions (``--for megatron-lm-5017``, ``--for nemo-rl-3380``) read."""
    from megatron_sft_idx.preprocess import Config, run
    from support.sft_fixtures import openai, reasoning, write_jsonl

    tmp = tmp_path_factory.mktemp("qwen3_store")
    path = write_jsonl(tmp / "r.jsonl", [openai(i) if i % 2 else reasoning(i, turns=1 + i % 3) for i in range(30)])
    directory = str(tmp / "store")
    run(Config(inputs=[path], output_prefix=str(tmp / "o" / "c"), tokenizer=families["qwen3"], store=directory,
               pack_size=256, partition_bytes=2048, progress=False))
    return directory
