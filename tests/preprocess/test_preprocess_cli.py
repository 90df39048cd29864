"""The preprocess_sft CLI end to end: bundled example, gate, determinism, exit codes, interruption."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_sft_idx.format import ALL_SUFFIXES
from megatron_sft_idx.preprocess.cli import build_parser, main
from megatron_sft_idx.reader import MMapIndexedDataset

from support.faults import run_leftovers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TOKENIZER = os.path.join(EXAMPLES, "tokenizer")
CONVERSATIONS = os.path.join(EXAMPLES, "conversations.jsonl")
SHAREGPT = os.path.join(EXAMPLES, "conversations_sharegpt.jsonl")


def base_args(prefix, *extra):
    return ["--input", CONVERSATIONS, SHAREGPT, "--tokenizer", TOKENIZER, "--output-prefix", str(prefix),
            "--pack-size", "1024", "--quiet", *extra]


def test_bundled_example_end_to_end_passes_gate(tmp_path, capsys):
    summary_path = tmp_path / "summary.json"
    rc = main(base_args(tmp_path / "sft" / "example", "--verify-masks", "50", "--summary-json", str(summary_path),
                        "--split", "98,1,1"))
    assert rc == 0
    s = json.loads(summary_path.read_text())
    assert s["conversations"] == 460 and s["skipped"] == {} and s["verify_masks"]["checked"] == 50
    assert 0.3 < s["trainable_share"] < 0.9 and s["packing_efficiency"] > 0.9
    assert set(s["splits"]) == {"train", "valid", "test"}
    total = 0
    for prefix in s["outputs"]:
        ds = MMapIndexedDataset(prefix, check_packs=True)
        meta = ds.metadata
        assert meta.pack_size == 1024 and meta.vocab_size == 1024 and meta.token_dtype == "uint16"
        assert meta.tokenizer["name"] == "megatron_sft_idx-example-bpe-1k"
        assert meta.packing == {"algorithm": "first_fit_decreasing", "seed": 1234, "pack_size": 1024,
                                "overlong": "truncate"}
        for i in range(len(ds)):
            p = ds[i]
            assert p.packed_len <= 1024 and p.loss_mask[p.seq_boundaries[1:] - 1].sum() == 0
        total += meta.stats.sequence_count
    assert total == 460
    try:
        from megatron_sft_idx.gate import check
    except ImportError:
        pytest.skip("gate not available")
    report = check(s["outputs"], level="standard")
    assert report.passed, report.format_text()


def test_check_flag_runs_gate_and_prints_summary(tmp_path, capsys):
    pytest.importorskip("megatron_sft_idx.gate")
    args = [a for a in base_args(tmp_path / "g", "--check") if a != "--quiet"]  # summary table
    rc = main(args)
    out = capsys.readouterr().out
    assert rc == 0 and "gate passed on 1 shard\n" in out and "packing efficiency" in out and "(s)" not in out


def test_same_bytes_with_one_and_two_workers(tmp_path):
    outs = []
    for w in (1, 2):
        prefix = tmp_path / f"w{w}" / "ds"
        assert main(base_args(prefix, "--workers", str(w), "--batch-size", "8", "--cp", "2",
                              "--max-packs-per-shard", "7")) == 0
        outs.append(prefix)
    names = sorted(n for n in os.listdir(outs[0].parent) if not n.startswith("."))  # (not the runs' records)
    assert names == sorted(n for n in os.listdir(outs[1].parent) if not n.startswith(".")) and len(names) >= 10
    for name in names:
        a = (outs[0].parent / name).read_bytes()
        assert a == (outs[1].parent / name).read_bytes(), name


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main(["--input", CONVERSATIONS, "--output-prefix", str(tmp_path / "x")]) == 2
    assert "--tokenizer is required" in capsys.readouterr().err
    assert main(base_args(tmp_path / "x", "--split", "a,b")) == 2
    assert "argument --split: expected comma-separated weights" in capsys.readouterr().err


def test_bad_input_exits_1_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                   '{"messages": [\n')
    rc = main(["--input", str(bad), "--tokenizer", TOKENIZER, "--output-prefix", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and f"{bad}:2: malformed JSON" in err[0] and "Traceback" not in err[0]
    rc = main(["--input", str(bad), "--tokenizer", TOKENIZER, "--output-prefix", str(tmp_path / "o"), "--quiet",
               "--skip-bad", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["skipped"] == {"malformed_json": 1}
    rc = main(["--input", str(bad), "--tokenizer", TOKENIZER, "--output-prefix", str(tmp_path / "o"), "--quiet",
               "--skip-bad"])
    assert rc == 1 and "already exists" in capsys.readouterr().err


def test_help_explains_every_flag():
    text = build_parser().format_help()
    for flag in ("--input", "--output-prefix", "--tokenizer", "--workers", "--pack-size", "--seed", "--loss-on",
                 "--overlong", "--pad-seq-to-mult", "--cp", "--tp", "--sp", "--pad-id", "--split",
                 "--max-packs-per-shard", "--max-shard-bytes", "--skip-bad", "--overwrite", "--check",
                 "--verify-masks", "--summary-json", "--packing-algorithm", "--prompt-key"):
        assert flag in text
    assert text.count("default") >= 20


def _final_files(directory, name):
    return [n for n in os.listdir(directory) if n.startswith(name) and n.endswith(ALL_SUFFIXES)]


@pytest.mark.subprocess
def test_killed_run_leaves_no_shard_and_next_run_clears_temporaries(tmp_path):
    big = tmp_path / "big.jsonl"
    lines = open(CONVERSATIONS, encoding="utf-8").read()
    big.write_text(lines * 40)  # 16000 conversations: long enough to be killed mid-run
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_sft.py"), "--input", str(big),
           "--tokenizer", TOKENIZER, "--output-prefix", str(out / "ds"), "--pack-size", "1024", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120  # a hang guard, not a performance threshold
        work = None
        while time.monotonic() < deadline and proc.poll() is None:
            parts = out / ".ds.preprocess" / "store" / "parts"
            if parts.exists() and os.listdir(parts):  # tokenizing: the store is being written
                work = out / ".ds.preprocess"
                break
            time.sleep(0.02)
        assert work is not None, "the run finished before it could be interrupted"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _final_files(out, "ds") == []
    assert work.exists()  # its temporaries are still there ...
    small = tmp_path / "small.jsonl"
    small.write_text("".join(open(CONVERSATIONS, encoding="utf-8").readlines()[:30]))
    assert main(["--input", str(small), "--tokenizer", TOKENIZER, "--output-prefix", str(out / "ds"),
                 "--pack-size", "1024", "--quiet"]) == 0
    assert run_leftovers(out) == []  # ... until the next run clears them (it keeps only its record)
    assert sorted(_final_files(out, "ds")) == sorted("ds" + s for s in ALL_SUFFIXES)
    assert MMapIndexedDataset(out / "ds").metadata.stats.sequence_count == 30


@pytest.mark.subprocess
def test_console_entry_runs_as_a_script(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_sft.py"), "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "--verify-masks" in r.stdout
