"""The peak memory a run reports is its own (issue 44 item 7): started from a process that holds
a large buffer (a notebook, a launcher), ``preprocess-sft``'s summary (the main process and the
materialize receipts, in-process with one worker) and its run record must not report the
parent's size, as ``ru_maxrss`` does on Linux (it keeps the peak of the image
``exec`` replaced)."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
BIG_MIB = 1536

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM is Linux's")]

#: A parent that touches BIG_MIB of memory, then runs argv[1:] (fork + exec) and relays its output.
PARENT = f"""
import subprocess, sys
big = bytearray({BIG_MIB} << 20)
for i in range(0, len(big), 4096):
    big[i] = 1
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stdout.write(done.stdout)
sys.stderr.write(done.stderr)
sys.exit(done.returncode)
"""


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


def _from_big_parent(argv):
    return subprocess.run([sys.executable, "-c", PARENT, *argv], capture_output=True, text=True, env=_env(),
                          timeout=600)


def test_a_child_of_a_large_process_reports_its_own_peak():
    probe = ("import json, resource; from megatron_sft_idx._progress import own_peak_rss_mib; "
             "print(json.dumps([own_peak_rss_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))")
    done = _from_big_parent([sys.executable, "-c", probe])
    assert done.returncode == 0, done.stderr
    own, maxrss = json.loads(done.stdout)
    assert maxrss >= BIG_MIB   # the premise: ru_maxrss carries the parent's size across exec here
    assert 0 < own < BIG_MIB / 4


def test_preprocess_summary_and_receipts_report_the_runs_own_peak(tmp_path):
    out = tmp_path / "ds"
    done = _from_big_parent([sys.executable, "-c", "import sys; from megatron_sft_idx._console import "
                             "preprocess_sft; sys.argv[0] = 'preprocess-sft'; sys.exit(preprocess_sft())",
                             "--input", os.path.join(EXAMPLES, "conversations.jsonl"),
                             "--tokenizer", os.path.join(EXAMPLES, "tokenizer"), "--output-prefix", str(out),
                             "--pack-size", "1024", "--workers", "1", "--max-packs-per-shard", "8"])
    assert done.returncode == 0, done.stderr[-3000:]
    line = re.search(r"peak RSS +main ([\d,]+) MiB, workers ([\d,]+) MiB", done.stdout)
    assert line, done.stdout[-2000:]
    main, workers = (int(x.replace(",", "")) for x in line.groups())
    assert 0 < main < BIG_MIB / 2 and workers < BIG_MIB / 2
    record = _load(str(tmp_path / ".ds.preprocess" / "receipts" / "done" / "000000.json"))
    assert record["summary"]["peak_rss_mib"] == {"main": pytest.approx(main, abs=1),
                                                 "workers_max": pytest.approx(workers, abs=1)}


def _load(path):
    with open(path) as f:
        return json.load(f)
