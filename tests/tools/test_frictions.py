"""The small frictions of issue 22 item 5, each on real files and real commands: merge refusals in
words, inspect-idx finding the demo's tokenizer and saying truthfully where it looked, the
help texts, and the Ray start-up counted in the summary time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron_sft_idx._console import run as run_tool
from megatron_sft_idx.tools import pack_view
from support.stages import CHAT, TOKENIZER, preprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The same conversations preprocessed twice, tool calls trained and masked (one shard each)."""
    root = tmp_path_factory.mktemp("policies")
    preprocess(str(root / "train"), inputs=CHAT[:1], pack_size=2048)
    preprocess(str(root / "mask"), inputs=CHAT[:1], pack_size=2048, tool_call_loss="mask")
    return {k: str(root / k / "ds") for k in ("train", "mask")}


def tool(name, argv, capsys):
    try:
        status = run_tool(name, argv)
    except SystemExit as exc:
        status = exc.code
    out = capsys.readouterr()
    return status, out.out, out.err


def test_merge_refuses_different_loss_policies_naming_the_flag(shards, tmp_path, capsys):
    status, _, err = tool("merge-shards", [str(tmp_path / "m"), shards["mask"], shards["train"]], capsys)
    assert status == 1 and not os.path.exists(tmp_path / "m.idx")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (f"{shards['train']}: cannot be merged with {shards['mask']}: loss policy differs: --tool-call-loss "
            f"mask in {shards['mask']}, train here") in err
    assert "sha256" not in err  # words, not hashes
    # the same policy merges (a copy of the shard under another name)
    from megatron_sft_idx.format import ALL_SUFFIXES

    for suffix in ALL_SUFFIXES:
        shutil.copyfile(shards["train"] + suffix, str(tmp_path / "copy") + suffix)
    status, _, err = tool("merge-shards", [str(tmp_path / "ok"), shards["train"], str(tmp_path / "copy"), "-q"],
                          capsys)
    assert status == 0, err


def testtokenizer_differences_name_the_vocabularies():
    from megatron_sft_idx.sets import tokenizer_difference

    a = {"name": "a", "files_sha256": "1" * 64, "vocab_size": 1024}
    b = {"name": "b", "files_sha256": "2" * 64, "vocab_size": 32000}
    words = tokenizer_difference(a, b).words
    assert words == ("tokenized with different tokenizers: 'a' (files sha256 111111111111, vocab 1,024) and "
                     "'b' (files sha256 222222222222, vocab 32,000)")
    same_files = dict(b, files_sha256="1" * 64, chat_template_sha256="3" * 64)
    assert tokenizer_difference(dict(a, chat_template_sha256="4" * 64), same_files).words.startswith(
        "chat template differs: the same tokenizer ('a') with different chat templates")


def test_inspect_finds_the_demo_tokenizer_on_its_own(shards, capsys, monkeypatch):
    """The metadata records the tokenizer's name and files hash, no path: the checkout's
    examples/tokenizer is found by its hash and the pack is shown as text."""
    monkeypatch.delenv(pack_view.TOKENIZER_PATH_ENV, raising=False)
    status, out, err = tool("inspect-idx", [shards["train"], "--pack", "0"], capsys)
    assert status == 0, err
    assert "<|im_start|>" in out and "not found" not in out


def test_inspect_says_where_it_searched(shards, tmp_path, capsys, monkeypatch):
    """With the example tokenizer out of reach (the shard on another machine: where its run found
    the tokenizer is not there), the note lists exactly the places searched."""
    gone = str(tmp_path / "elsewhere" / "tokenizer")
    assert pack_view.run_recorded(shards["train"]) == [os.path.abspath(TOKENIZER)]   # the run's record says so
    monkeypatch.setattr(pack_view, "run_recorded", lambda prefix: [gone])
    monkeypatch.setattr(pack_view, "EXAMPLE_TOKENIZER", str(tmp_path / "no-checkout"))
    monkeypatch.setenv(pack_view.TOKENIZER_PATH_ENV, str(tmp_path / "tokenizers"))
    status, out, _ = tool("inspect-idx", [shards["train"], "--pack", "0"], capsys)
    assert status == 0
    assert ("tokenizer megatron_sft_idx-example-bpe-1k not found on this machine (searched "
            f"the path its run recorded, {gone} (not there), "
            "$MEGATRON_SFT_IDX_TOKENIZER_PATH, the Hugging Face cache under the name "
            "megatron_sft_idx-example-bpe-1k; put its directory in $MEGATRON_SFT_IDX_TOKENIZER_PATH or pass "
            "--tokenizer PATH)") in out
    # ... and a copy placed where it said it looks is found there
    shutil.copytree(TOKENIZER, tmp_path / "tokenizers" / "copy")
    status, out, _ = tool("inspect-idx", [shards["train"], "--pack", "0"], capsys)
    assert status == 0 and "<|im_start|>" in out and "not found" not in out


def test_write_sft_manifest_help_starts_with_what_it_does(capsys):
    status, out, _ = tool("write-sft-manifest", ["--help"], capsys)
    assert status == 0
    description = out.split("\n\n")[1]
    assert description.startswith("Write a manifest (OUT.json) listing shards, so that they open as one dataset")
    assert "write_manifest" not in out


@pytest.mark.slow
@pytest.mark.subprocess
def test_ray_summary_time_includes_the_cluster_start(tmp_path):
    """A run that starts its own one-node cluster reports the start-up seconds on their own and
    counts them in the total (a real Ray cluster, in a subprocess that owns it)."""
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    summary_json = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_sft.py"), "--input", CHAT[0],
                           "--tokenizer", TOKENIZER, "--output-prefix", str(tmp_path / "o" / "ds"), "--pack-size",
                           "2048", "--engine", "ray", "--workers", "1", "--summary-json", str(summary_json)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(summary_json.read_text())
    assert summary["engine"]["kind"] == "ray" and summary["engine"]["started_here"]
    seconds = summary["seconds"]
    assert seconds["ray_start"] > 0
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("time"))
    total = float(re.match(r"time\s+([0-9.]+) s", line).group(1))
    assert "ray_start" in line and abs(total - sum(seconds.values())) < 0.02, (line, seconds)
