"""Every option of preprocess-sft and repack-sft that names a local file or directory only is
refused with a URL at parse time, in one line naming the flag, before any work (issue 44 item 9):
through the console scripts, and through the library's configurations."""

import os
import subprocess
import sys

import pytest

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess import Config
from megatron_sft_idx.preprocess.config import RepackConfig
from support.stages import CHAT, TOKENIZER

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
URL = "s3://bucket/reports/x.jsonl"

PREPROCESS = ["--input", *CHAT, "--tokenizer", TOKENIZER, "--pack-size", "512"]
CASES = [("preprocess-sft", flag) for flag in ("--skip-report", "--chat-template", "--summary-json",
                                                 "--staging-dir", "--mix-plot")]
CASES += [("repack-sft", flag) for flag in ("--summary-json", "--staging-dir", "--plan-only", "--mix-plot")]


def _argv(command, flag, out):
    if command == "preprocess-sft":
        base = PREPROCESS + ["--output-prefix", out, "--store", out + "_store"]
    else:
        base = ["--store", out + "_store", "--pack-size", "512"] + ([] if flag == "--plan-only" else
                                                                     ["--output-prefix", out])
    return base + [flag, URL]


@pytest.mark.subprocess
@pytest.mark.parametrize("command, flag", CASES, ids=[f"{c} {f}" for c, f in CASES])
def test_a_url_for_a_local_only_option_is_refused_before_any_work(tmp_path, command, flag):
    out = str(tmp_path / "run" / "ds")
    os.makedirs(os.path.dirname(out))
    entry = command.replace("-", "_")
    proc = subprocess.run([sys.executable, "-c", f"import sys; from megatron_sft_idx._console import {entry}; "
                           f"sys.argv[0] = '{command}'; sys.exit({entry}())", *_argv(command, flag, out)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
                              "PYTHONPATH")]))))
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{command}: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr   # (argparse's usage lines above it)
    assert errors[0].startswith(f"{command}: error: {flag} {URL}: ") and "local path" in errors[0]
    assert os.listdir(tmp_path / "run") == []   # nothing tokenized, no work directory, no store


@pytest.mark.parametrize("kwargs, flag", [(dict(skip_report=URL), "--skip-report"),
                                          (dict(chat_template="msc://p/t.jinja"), "--chat-template"),
                                          (dict(staging_dir="s3://b/stage"), "--staging-dir")])
def test_the_library_refuses_them_when_the_configuration_is_made(tmp_path, kwargs, flag):
    with pytest.raises(ShardError, match=f"{flag} takes a local path, not a URL"):
        Config(CHAT, str(tmp_path / "ds"), tokenizer=TOKENIZER, **kwargs)
    if "staging_dir" in kwargs:
        with pytest.raises(ShardError, match=flag):
            RepackConfig(str(tmp_path / "store"), str(tmp_path / "ds"), **kwargs)
