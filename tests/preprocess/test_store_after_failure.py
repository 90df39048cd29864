"""A ``--store`` a failed run left behind does not block the corrected rerun (issue 30, item 4),
with the real command: a run that fails (a template that raises on every conversation) leaves an
unfinished store; the same command with the fix and ``--resume`` starts that store again, and
with ``--overwrite`` replaces it; without either the error says which flag does what. A
*complete* store made with other settings is still refused under ``--resume`` (another run may
repack it), naming ``--overwrite``; ``--overwrite`` replaces it."""

import os
import subprocess
import sys

import pytest

from megatron_sft_idx.preprocess.store import SequenceStore

pytestmark = [pytest.mark.subprocess]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
EXAMPLE = os.path.join(ROOT, "examples", "conversations.jsonl")
ENV = dict(os.environ, PYTHONPATH=ROOT)
BAD_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ no_such_function() }}\n{% endfor %}"


@pytest.fixture
def failed(tmp_path):
    """A run that failed while tokenizing into ``--store``: ``(tmp_path, store)``."""
    with open(EXAMPLE, encoding="utf-8") as f:
        (tmp_path / "in.jsonl").write_text("".join(f.readlines()[:60]))
    (tmp_path / "bad.jinja").write_text(BAD_TEMPLATE)
    proc = cli(tmp_path, "a", "--chat-template", str(tmp_path / "bad.jinja"))
    assert proc.returncode == 1 and "the chat template rejected the conversation" in proc.stderr, proc.stderr
    store = str(tmp_path / "store")
    assert os.path.isfile(os.path.join(store, "store.json"))
    assert SequenceStore(store, require_complete=False).missing   # what a failed run leaves: unfinished
    return tmp_path, store


def cli(tmp_path, out, *extra):
    argv = [sys.executable, os.path.join(ROOT, "tools", "preprocess_sft.py")]
    return subprocess.run(argv + ["--input", str(tmp_path / "in.jsonl"), "--tokenizer", TOKENIZER,
                                  "--output-prefix", str(tmp_path / out / "ds"), "--store", str(tmp_path / "store"),
                                  "--pack-size", "512", "--quiet", *extra],
                          env=ENV, capture_output=True, text=True, timeout=600)


def reference(tmp_path):
    """The fixed command's output from an empty store."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_sft.py"),
                           "--input", str(tmp_path / "in.jsonl"), "--tokenizer", TOKENIZER, "--output-prefix",
                           str(tmp_path / "ref" / "ds"), "--store", str(tmp_path / "ref_store"), "--pack-size", "512",
                           "--quiet"], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return shard_bytes(tmp_path / "ref")


def shard_bytes(directory):
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if not n.startswith(".") and os.path.isfile(os.path.join(directory, n))}


def test_without_a_flag_the_error_names_both(failed):
    tmp_path, store = failed
    proc = cli(tmp_path, "b")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1 and "Traceback" not in proc.stderr
    assert f"{store}: the --store directory is not empty" in err[0]
    assert "--resume to continue it" in err[0] and "--overwrite to replace it" in err[0]


@pytest.mark.parametrize("flags", [["--resume"], ["--overwrite"], ["--resume", "--overwrite"]])
def test_the_fixed_rerun_succeeds_on_the_failed_store(failed, flags):
    tmp_path, store = failed
    proc = cli(tmp_path, "b", *flags)
    assert proc.returncode == 0, proc.stderr
    assert SequenceStore(store).missing == []   # complete now, made with the fixed settings
    assert shard_bytes(tmp_path / "b") == reference(tmp_path)


def test_a_complete_store_of_other_settings_is_refused_under_resume_and_replaced_under_overwrite(failed):
    tmp_path, store = failed
    assert cli(tmp_path, "b", "--resume").returncode == 0                # the store is complete now
    proc = cli(tmp_path, "c", "--resume", "--loss-on", "all")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1, proc.stderr
    assert "the sequence store is complete and was made with other tokenizer and encoding settings" in err[0]
    assert "--overwrite to replace the store" in err[0]
    proc = cli(tmp_path, "c", "--overwrite", "--loss-on", "all")
    assert proc.returncode == 0, proc.stderr
    assert SequenceStore(store).identity["encode"]["loss_on"] == "all"
