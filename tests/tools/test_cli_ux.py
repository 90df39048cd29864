"""What a user of the tools sees: progress off a terminal, -q/-v, warnings about silent decisions,
--chat-template, sizes, help texts and summaries. Real runs on the bundled example."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron_sft_idx._units import parse_size, plural
from megatron_sft_idx.format import ALL_SUFFIXES
from megatron_sft_idx.preprocess.cli import build_parser, main

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TOKENIZER = os.path.join(EXAMPLES, "tokenizer")
CONVERSATIONS = os.path.join(EXAMPLES, "conversations.jsonl")
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def args_for(prefix, *extra, pack_size=2048):
    return ["--input", CONVERSATIONS, "--tokenizer", TOKENIZER, "--output-prefix", str(prefix),
            "--pack-size", str(pack_size), *extra]


def tool(script, *argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", script), *argv], env=ENV,
                          capture_output=True, text=True, timeout=600)


def digests(prefix) -> dict:
    out = {}
    for suffix in ALL_SUFFIXES:
        with open(str(prefix) + suffix, "rb") as f:
            out[suffix] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_progress_lines_off_a_terminal_and_quiet_is_silent(tmp_path):
    proc = tool("preprocess_sft.py", *args_for(tmp_path / "a" / "ds", "--log-interval", "0.01", "--check"))
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if re.match(r"preprocess-sft: (tokenize|check|write): ", ln)]
    assert lines, proc.stderr
    assert all(re.search(r"elapsed \d+:\d\d, RSS [\d,]+ MiB$", ln) for ln in lines), lines
    assert any("/" in ln and "%" in ln for ln in lines)
    assert "\r" not in proc.stderr  # no bar's carriage returns in a log file
    quiet = tool("preprocess_sft.py", *args_for(tmp_path / "q" / "ds", "-q", "--log-interval", "0.01"))
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == "", quiet.stderr


def test_verbose_logs_phase_timings(tmp_path, capsys):
    assert main(args_for(tmp_path / "v" / "ds", "-v", "--log-interval", "600")) == 0
    err = capsys.readouterr().err
    for phase in ("tokenize", "plan", "write", "publish"):
        assert re.search(rf"^preprocess-sft: {phase}: .* in \d+\.\d\d s$", err, re.M), err


def test_truncation_warning_fires_above_threshold_only(tmp_path, capsys):
    assert main(args_for(tmp_path / "ok" / "ds")) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(args_for(tmp_path / "short" / "ds", pack_size=128)) == 0
    out, err = capsys.readouterr()
    warning = [ln for ln in err.splitlines() if ln.startswith("preprocess-sft: warning: ")]
    assert warning and re.search(r"[\d,]+ of 400 conversations \(\d+\.\d%\) were truncated", warning[0]), err
    assert "--pack-size" in warning[0] and "--warn-above" in warning[0]
    assert "cut inside an assistant reply" in out  # the summary says what happened to the cut replies
    assert main(args_for(tmp_path / "high" / "ds", "--warn-above", "100", pack_size=128)) == 0
    assert "warning" not in capsys.readouterr().err


def test_truncated_turn_loss_drop_masks_cut_replies(tmp_path):
    keep, drop = (tmp_path / "keep.json", tmp_path / "drop.json")
    assert main(args_for(tmp_path / "k" / "ds", "-q", "--summary-json", str(keep), pack_size=128)) == 0
    assert main(args_for(tmp_path / "d" / "ds", "-q", "--summary-json", str(drop), "--truncated-turn-loss", "drop",
                         pack_size=128)) == 0
    k, d = json.loads(keep.read_text()), json.loads(drop.read_text())
    assert k["truncated_turn_loss"] == "keep" and d["truncated_turn_loss"] == "drop"
    assert k["truncated_turns_cut"] > 0 and d["truncated_turns_cut"] == k["truncated_turns_cut"]
    assert d["trainable_tokens"] < k["trainable_tokens"]
    # a conversation whose only trained turn is cut trains nothing once masked: dropped and counted
    untrainable = "overlong_untrainable_after_truncation"
    assert d["skipped"].get(untrainable, 0) > k["skipped"].get(untrainable, 0)
    assert d["conversations"] + d["skipped"][untrainable] == k["conversations"] + k["skipped"].get(untrainable, 0)
    # the shard says how it was made (absent: keep, so default shards keep their bytes)
    from megatron_sft_idx.reader import MMapIndexedDataset

    kept, dropped = (MMapIndexedDataset(str(tmp_path / x / "ds")).metadata.extra for x in ("k", "d"))
    assert "truncated_turn_loss" not in kept and dropped["truncated_turn_loss"] == "drop"


def test_verify_masks_says_why_fewer_were_checked(tmp_path, capsys):
    assert main(args_for(tmp_path / "m" / "ds", "--verify-masks", "400", pack_size=128)) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("verify-masks")][0]
    assert re.search(r"[\d,]+ of 400 requested conversations OK \(.*truncated", line), line


def test_overlong_error_with_skip_bad_is_refused(tmp_path, capsys):
    assert main(args_for(tmp_path / "e" / "ds", "--overlong", "error", "--skip-bad")) == 2
    err = capsys.readouterr().err
    assert "--overlong drop --skip-bad" in err and len(err.strip().splitlines()[-1]) < 300


def test_chat_template_file_gives_the_tokenizers_bytes(tmp_path):
    with open(os.path.join(TOKENIZER, "tokenizer_config.json"), encoding="utf-8") as f:
        template = json.load(f)["chat_template"]
    path = tmp_path / "template.jinja"
    path.write_text(template, encoding="utf-8")
    assert main(args_for(tmp_path / "own" / "ds", "-q")) == 0
    assert main(args_for(tmp_path / "file" / "ds", "-q", "--chat-template", str(path))) == 0
    assert digests(tmp_path / "own" / "ds") == digests(tmp_path / "file" / "ds")


def test_named_template_and_a_bare_tokenizer_json(tmp_path, capsys):
    named = tmp_path / "named"
    shutil.copytree(TOKENIZER, named)
    config = json.loads((named / "tokenizer_config.json").read_text())
    own = config["chat_template"]
    config["chat_template"] = [{"name": "default", "template": own}, {"name": "plain", "template": own}]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    base = ["--input", CONVERSATIONS, "--pack-size", "2048", "-q"]
    assert main(base + ["--tokenizer", str(named), "--output-prefix", str(tmp_path / "n" / "ds"),
                        "--chat-template", "plain"]) == 0
    assert main(base + ["--tokenizer", str(named), "--output-prefix", str(tmp_path / "x" / "ds"),
                        "--chat-template", "nosuch"]) == 1
    err = capsys.readouterr().err
    assert "default, plain" in err and "Traceback" not in err
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(TOKENIZER, "tokenizer.json"), bare / "tokenizer.json")
    assert main(base + ["--tokenizer", str(bare / "tokenizer.json"), "--output-prefix", str(tmp_path / "b" / "ds")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chat-template" in err[0] and "--pad-id" in err[0], err


@pytest.mark.parametrize("text, value", [
    ("65536", 65536), ("512K", 512 << 10), ("512k", 512 << 10), ("64M", 64 << 20), ("1G", 1 << 30),
    ("1GiB", 1 << 30), ("1.5G", 3 << 29), ("2GB", 2_000_000_000), ("10KB", 10_000), ("1T", 1 << 40), ("7B", 7),
])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "1Q", "G", "-1", "1iB", "one", "1 G B"])
def test_bad_sizes_name_the_flag(text, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--input", "x", "--output-prefix", "y", "--max-shard-bytes", text])
    err = capsys.readouterr().err
    assert "argument --max-shard-bytes: expected a size like" in err and "size_arg" not in err


def test_max_shard_bytes_takes_a_size(tmp_path, capsys):
    assert main(args_for(tmp_path / "s" / "ds", "--max-shard-bytes", "64K", pack_size=512)) == 0
    out = capsys.readouterr().out
    shards = int(re.search(r"in ([\d,]+) shards", out).group(1))
    assert shards > 1 and os.path.exists(str(tmp_path / "s" / "ds") + "_000001.idx")


def test_summary_has_no_python_reprs(tmp_path, capsys):
    assert main(args_for(tmp_path / "r" / "ds", "--split", "90,5,5", "--overlong", "drop", "--warn-above", "100",
                         pack_size=256)) == 0
    out = capsys.readouterr().out
    assert not re.search(r"[{}\[\]]|\(s\)|'", out), out
    assert "skipped " in out and "overlong, dropped" in out


SCRIPTS = {"preprocess_sft.py": "preprocess-sft", "repack_sft.py": "repack-sft", "check_idx.py": "check-idx",
           "merge_shards.py": "merge-shards", "convert_packed.py": "convert-packed", "inspect_idx.py": "inspect-idx",
           "write_manifest.py": "write-sft-manifest"}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_is_plain_text_with_installed_names(script):
    proc = tool(script, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {SCRIPTS[script]} ")
    assert "`" not in proc.stdout and ":func:" not in proc.stdout and "::" not in proc.stdout
    assert "_sft" not in proc.stdout.replace("megatron_sft_idx", "")
    if script != "inspect_idx.py":  # its output is the result: -v only
        assert "-q, --quiet" in proc.stdout
    assert "-v, --verbose" in proc.stdout


def test_plural():
    assert plural(1, "shard") == "1 shard" and plural(2, "shard") == "2 shards" and plural(0, "pack") == "0 packs"
