"""``tools/check_idx.py`` through ``main(argv)`` (and once as a subprocess): exit codes and output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_sft_idx.gate.cli import build_parser, main
from support.shardgen import random_packs, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "check_idx.py")


def make(directory, name="s", seed=0, zero_loss_pack=False):
    prefix = os.path.join(str(directory), name)
    packs = random_packs(np.random.default_rng(seed), 10, vocab=500)
    for ids, loss, starts in packs:  # one trained position per pack: no all-zero pack warnings
        loss[:] = 0
        ends = np.append(starts[1:], len(ids))
        first_long = np.nonzero(ends - starts > 1)[0]
        if first_long.size:
            loss[starts[first_long[0]]] = 1
    if zero_loss_pack:
        packs[3][1][:] = 0
    write_shard(prefix, packs, vocab_size=500)
    return prefix


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_pass_prints_verdicts(tmp_path, capsys):
    prefix = make(tmp_path)
    code, out, _ = run(capsys, prefix)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"PASS  {prefix}  (sft, 10 packs")
    assert lines[-1].startswith("overall: PASS: 1 of 1 shard passed, 0 errors, 0 warnings")


def test_fail_prints_one_line_per_finding(tmp_path, capsys):
    good, bad = make(tmp_path, "good"), make(tmp_path, "bad", seed=1)
    os.truncate(bad + ".seq.bin", 5)
    code, out, _ = run(capsys, str(tmp_path))
    assert code == 1
    assert any(line.lstrip().startswith("error   SEQ_BIN_SIZE_MISMATCH") and "bad.seq.bin" in line
               for line in out.splitlines())
    assert f"FAIL  {bad}" in out and f"PASS  {good}" in out
    assert out.strip().splitlines()[-1].startswith("overall: FAIL: 1 of 2")


def test_json_output(tmp_path, capsys):
    prefix = make(tmp_path)
    with open(prefix + ".bin", "r+b") as f:
        f.write(b"\xff\xff")
    code, out, _ = run(capsys, prefix, "--json", "--vocab-size", "500")
    data = json.loads(out)
    assert code == 1 and data["exit_code"] == 1 and data["passed"] is False
    codes = {f["code"] for f in data["shards"][0]["findings"]}
    assert {"TOKEN_OUT_OF_VOCAB", "CHECKSUM_MISMATCH"} <= codes
    assert data["options"]["vocab_size"] == 500 and data["level"] == "standard"


def test_quiet_and_verbose(tmp_path, capsys):
    prefix = make(tmp_path)
    code, out, _ = run(capsys, prefix, "--quiet")
    assert code == 0 and out.strip().splitlines() == [out.strip()] and out.startswith("overall: PASS")
    code, out, _ = run(capsys, prefix, "--verbose", "--fast")
    assert code == 0 and "CHECKSUMS_SKIPPED" in out and "checks run:" in out
    assert "checksums skipped" in out


@pytest.mark.parametrize("argv", [["--link"], ["--replace"], ["--workers", "0"], ["--fast", "--deep"],
                                  ["--no-such-flag"], ["--vocab-size", "0"], ["--json", "--quiet"]])
def test_usage_errors_exit_2(tmp_path, capsys, argv):
    prefix = make(tmp_path)
    code, _, err = run(capsys, prefix, *argv)
    assert code == 2 and err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--promote" in capsys.readouterr().out
    assert build_parser().prog == "check-idx"


def test_no_match_exits_2(tmp_path, capsys):
    code, out, err = run(capsys, str(tmp_path / "nothing_here"))
    assert code == 2 and "no shard file matches" in err and out == ""


def test_unreadable_file_exits_2(tmp_path, capsys):
    prefix = make(tmp_path)
    os.remove(prefix + ".idx")
    os.mkdir(prefix + ".idx")  # exists but cannot be read (chmod does not stop root)
    code, out, _ = run(capsys, prefix)
    assert code == 2 and "FILE_UNREADABLE" in out


def test_strict_and_allow_pretrain(tmp_path, capsys):
    prefix = make(tmp_path, zero_loss_pack=True)
    assert run(capsys, prefix)[0] == 0
    code, out, _ = run(capsys, prefix, "--strict")
    assert code == 1 and "ZERO_LOSS_PACK" in out
    for suffix in (".loss.bin", ".seq.idx", ".seq.bin"):
        os.remove(prefix + suffix)
    assert run(capsys, prefix)[0] == 1
    assert run(capsys, prefix, "--allow-pretrain")[0] == 0


def test_promote_from_the_command_line(tmp_path, capsys):
    good = make(tmp_path / "staging", "good")
    bad = make(tmp_path / "staging", "bad", seed=1)
    os.truncate(bad + ".bin", 7)
    dest = tmp_path / "train"
    code, out, _ = run(capsys, str(tmp_path / "staging"), "--promote", str(dest))
    assert code == 1  # one shard failed
    assert sorted(os.listdir(dest)) == sorted(f"good{s}" for s in (".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin"))
    assert f"-> .idx      {dest / 'good.idx'}" in out
    assert os.path.exists(bad + ".bin") and not os.path.exists(good + ".idx")
    code, out, _ = run(capsys, str(dest / "good"), "--promote", str(tmp_path / "train2"), "--link", "--json")
    assert code == 0 and json.loads(out)["shards"][0]["promoted"][".bin"] == str(tmp_path / "train2" / "good.bin")


@pytest.mark.subprocess
def test_tool_script_runs_as_a_subprocess(tmp_path):
    prefix = make(tmp_path)
    proc = subprocess.run([sys.executable, TOOL, prefix, "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["passed"] is True
    proc = subprocess.run([sys.executable, TOOL, str(tmp_path / "missing")], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2 and "no shard file matches" in proc.stderr
