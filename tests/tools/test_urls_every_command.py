"""Every console script with an ``s3://`` URL in each path argument, against the S3 server
(issue 22 item 4): it works (and the result is checked), or it exits non-zero with one
``<command>: error: ...`` line naming the URL and no traceback. docs/TOOLS.md "URLs" is the
table of these cases; ``test_the_table_in_tools_md_lists_every_case`` keeps the two in step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from megatron_sft_idx import open_packed, publishing
from megatron_sft_idx._console import TOOLS
from megatron_sft_idx.batching import Order
from megatron_sft_idx._console import run as run_tool
from megatron_sft_idx.storage import destination_for
from support.stages import CHAT, TOKENIZER, preprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """A preprocess run kept with its sequence store (several shards)."""
    out = tmp_path_factory.mktemp("local")
    preprocess(str(out / "o"), pack_size=512, max_packs_per_shard=120, store=str(out / "store"))
    return str(out)


@pytest.fixture
def remote(local_run, bucket):
    """The run's shards and manifest uploaded to s3://BUCKET/run/."""
    out = os.path.join(local_run, "o")
    prefixes = sorted(os.path.join(out, n[:-4]) for n in os.listdir(out)
                      if n.endswith(".idx") and not n.endswith(".seq.idx"))
    publishing.publish(prefixes, f"s3://{bucket}/run/", manifest="ds.json")
    dest = destination_for(f"s3://{bucket}/run/")   # an input and a tokenizer in the bucket too
    dest.put(CHAT[0], f"s3://{bucket}/run/in.jsonl")
    for name in os.listdir(TOKENIZER):
        dest.put(os.path.join(TOKENIZER, name), f"s3://{bucket}/run/tok/{name}")
    store = os.path.join(local_run, "store")   # and the run's sequence store, to s3://BUCKET/run/store/
    for directory, _, names in os.walk(store):
        for name in names:
            rel = os.path.relpath(os.path.join(directory, name), store).replace(os.sep, "/")
            if name != "lock":
                dest.put(os.path.join(directory, name), f"s3://{bucket}/run/store/{rel}")
    return {"url": f"s3://{bucket}/run", "local": local_run, "shards": [os.path.basename(p) for p in prefixes],
            "packs": len(open_packed(os.path.join(out, "ds.json"))), "work": local_run}


def invoke(name, argv, capsys):
    try:
        status = run_tool(name, argv)
    except SystemExit as exc:  # argparse's own usage errors
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def refused(status, err, name, url):
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{name}: error:")]
    assert status not in (0, None) and len(lines) == 1 and url in lines[0], err
    assert "Traceback" not in err, err
    return lines[0]


def shard0(r):
    return f"{r['url']}/{r['shards'][0]}"


# (command, case, argv(r, tmp) -> list, "works" or "refused")
CASES = [
    ("preprocess-sft", "--output-prefix URL",
     lambda r, t: ["--input", CHAT[0], "--tokenizer", TOKENIZER, "--output-prefix", f"{r['url']}/pp/ds",
                   "--pack-size", "512", "-q"], "works"),
    ("preprocess-sft", "--input URL",
     lambda r, t: ["--input", f"{r['url']}/in.jsonl", "--tokenizer", TOKENIZER, "--output-prefix",
                   f"{r['url']}/pp/ds"], "works"),
    ("preprocess-sft", "--store URL",
     lambda r, t: ["--input", CHAT[0], "--tokenizer", TOKENIZER, "--output-prefix", t + "/o", "--store",
                   f"{r['url']}/newstore", "--pack-size", "512", "-q"], "works"),
    ("preprocess-sft", "--staging-dir URL",
     lambda r, t: ["--input", CHAT[0], "--tokenizer", TOKENIZER, "--output-prefix", f"{r['url']}/pp/ds",
                   "--staging-dir", f"{r['url']}/stage"], "refused"),
    ("preprocess-sft", "--tokenizer URL",
     lambda r, t: ["--input", CHAT[0], "--tokenizer", f"{r['url']}/tok", "--output-prefix", f"{r['url']}/pp/ds"],
     "works"),
    ("preprocess-sft", "--summary-json URL",
     lambda r, t: ["--input", CHAT[0], "--tokenizer", TOKENIZER, "--output-prefix", t + "/o", "--summary-json",
                   f"{r['url']}/s.json"], "refused"),
    ("preprocess-sft", "--skip-report URL",
     lambda r, t: ["--input", CHAT[0], "--tokenizer", TOKENIZER, "--output-prefix", t + "/o", "--skip-report",
                   f"{r['url']}/skips.jsonl"], "refused"),
    ("preprocess-sft", "--chat-template URL",
     lambda r, t: ["--input", CHAT[0], "--tokenizer", TOKENIZER, "--output-prefix", t + "/o", "--chat-template",
                   f"{r['url']}/tok/chat_template.jinja"], "refused"),
    ("repack-sft", "--output-prefix URL",
     lambda r, t: ["--store", r["local"] + "/store", "--output-prefix", f"{r['url']}/rp/ds", "--pack-size", "1024",
                   "-q"], "works"),
    ("repack-sft", "--store URL",
     lambda r, t: ["--store", f"{r['url']}/store", "--output-prefix", t + "/o", "--pack-size", "1024", "-q"], "works"),
    ("repack-sft", "--plan-only URL",
     lambda r, t: ["--store", r["local"] + "/store", "--plan-only", f"{r['url']}/plan"], "refused"),
    ("repack-sft", "--output-prefix URL (--for megatron-lm-5017)",
     lambda r, t: ["--store", r["local"] + "/store", "--for", "megatron-lm-5017", "--output-prefix",
                   f"{r['url']}/lm/chat"], "refused"),
    ("repack-sft", "--output-prefix URL (--for nemo-rl-3380)",
     lambda r, t: ["--store", r["local"] + "/store", "--for", "nemo-rl-3380", "--output-prefix",
                   f"{r['url']}/rl/chat"], "refused"),
    ("check-idx", "PREFIX URL (shard, directory, manifest)",
     lambda r, t: [shard0(r), r["url"] + "/", r["url"] + "/ds.json", "-q"], "works"),
    ("check-idx", "--promote URL",
     lambda r, t: [_local_shard(t), "--promote", f"{r['url']}/promoted/", "-q"], "works"),
    ("write-sft-manifest", "OUT URL, SHARD URL",
     lambda r, t: [f"{r['url']}/again.json", r["url"] + "/ds.json", "-q"], "works"),
    ("merge-shards", "IN URL",
     lambda r, t: [t + "/merged", r["url"] + "/ds.json", "-q"], "works"),
    ("merge-shards", "OUT URL",
     lambda r, t: [f"{r['url']}/merged", os.path.join(r["local"], "o", "ds.json"), "-q"], "works"),
    ("merge-shards", "--staging-dir URL",
     lambda r, t: [t + "/merged", shard0(r), "--staging-dir", f"{r['url']}/stage"], "refused"),
    ("convert-packed", "OUTPUT URL",
     lambda r, t: [os.path.join(r["local"], "o", "ds.json"), f"{r['url']}/conv.parquet", "-q"], "works"),
    ("convert-packed", "INPUT URL",
     lambda r, t: [shard0(r), t + "/conv.parquet"], "refused"),
    ("convert-packed", "--staging-dir URL",
     lambda r, t: [os.path.join(r["local"], "o", "ds.json"), f"{r['url']}/conv2", "--staging-dir",
                   f"{r['url']}/stage"], "refused"),
    ("inspect-idx", "PREFIX URL (summary)", lambda r, t: [r["url"] + "/ds.json"], "works"),
    ("inspect-idx", "PREFIX URL (--pack)", lambda r, t: [shard0(r), "--pack", "0", "--no-text"], "works"),
    ("inspect-idx", "PREFIX URL (--sql)",
     lambda r, t: [r["url"] + "/ds.json", "--sql", "SELECT shard, count(*) AS n FROM packs GROUP BY 1"], "works"),
    ("inspect-idx", "--plot URL", lambda r, t: [shard0(r), "--plot", f"{r['url']}/p.png"], "refused"),
    ("inspect-idx", "--tokenizer URL", lambda r, t: [shard0(r), "--pack", "0", "--tokenizer", f"{r['url']}/tok"],
     "works"),
    ("plan-batches", "SHARD URL",
     lambda r, t: [r["url"] + "/ds.json", "--dp", "2", "--global-batch-size", "8", "--out", t + "/o.order"], "works"),
    ("plan-batches", "--out URL",
     lambda r, t: [r["url"] + "/ds.json", "--dp", "2", "--global-batch-size", "8", "--out", f"{r['url']}/o.order"],
     "works"),
    ("plan-batches", "--store URL",
     lambda r, t: ["--dynamic", "--store", f"{r['url']}/store", "--max-tokens-per-microbatch", "4096", "--dp", "2",
                   "--global-batch-size", "8"], "works"),
    ("plan-batches", "--plot URL",
     lambda r, t: [r["url"] + "/ds.json", "--dp", "2", "--global-batch-size", "8", "--plot", f"{r['url']}/p.png"],
     "refused"),
]


def _local_shard(tmp):
    from support.shardgen import random_packs, write_shard

    prefix = os.path.join(tmp, "loose", "one")
    write_shard(prefix, random_packs(np.random.default_rng(0), 5), vocab_size=1000)
    return prefix


def _url_of(argv, case, r):
    """The URL the case is about: its option's value, else the first URL in argv."""
    flag = case.split()[0]
    if flag.startswith("--"):
        return argv[argv.index(flag) + 1]
    return next(a for a in argv if a.startswith(("s3://", "msc://")))


@pytest.mark.parametrize("name, case, argv, outcome", CASES, ids=[f"{c[0]} {c[1]}" for c in CASES])
def test_command_with_a_url(remote, tmp_path, capsys, name, case, argv, outcome):
    args = argv(remote, str(tmp_path))
    status, out, err = invoke(name, args, capsys)
    if outcome == "refused":
        line = refused(status, err, name, _url_of(args, case, remote))
        assert "local" in line, line  # says why: a local path is needed here
        return
    assert status == 0 and "Traceback" not in err, err[-3000:]
    url = remote["url"]
    local_out = any(n.endswith(".idx") for n in os.listdir(tmp_path))   # (--store URL: a local output)
    checks = {
        "preprocess-sft": lambda: local_out if case == "--store URL" else len(open_packed(f"{url}/pp/")) > 0,
        "repack-sft": lambda: local_out if case == "--store URL" else len(open_packed(f"{url}/rp/")) > 0,
        "plan-batches": lambda: (Order.load(f"{url}/o.order").epochs == 1 if "--out URL" in case
                                 else "sequences" in out if case == "--store URL"
                                 else os.path.getsize(tmp_path / "o.order") > 0),
        "check-idx": lambda: True,
        "write-sft-manifest": lambda: len(open_packed(f"{url}/again.json")) == remote["packs"],
        "merge-shards": lambda: len(open_packed(f"{url}/merged" if "OUT" in case else str(tmp_path / "merged")))
        == remote["packs"],
        "convert-packed": lambda: True,
        "inspect-idx": lambda: url in out,
    }
    assert checks[name](), (out, err)
    if (name, case) == ("inspect-idx", "--tokenizer URL"):   # detokenized as with the local directory
        local = invoke(name, args[:-1] + [TOKENIZER], capsys)
        assert (status, out, err) == local and "<|im_start|>" in out, (out, local[1])


MSC_CASES = [c for c in CASES if (c[0], c[1]) in {
    ("check-idx", "PREFIX URL (shard, directory, manifest)"), ("check-idx", "--promote URL"),
    ("write-sft-manifest", "OUT URL, SHARD URL"), ("merge-shards", "IN URL"), ("merge-shards", "OUT URL"),
    ("inspect-idx", "PREFIX URL (summary)"), ("inspect-idx", "PREFIX URL (--sql)"), ("plan-batches", "SHARD URL"),
    ("plan-batches", "--out URL"), ("preprocess-sft", "--input URL"), ("preprocess-sft", "--tokenizer URL")}]


@pytest.mark.parametrize("name, case, argv, outcome", MSC_CASES, ids=[f"{c[0]} {c[1]}" for c in MSC_CASES])
def test_command_with_an_msc_url(remote, s3, bucket, tmp_path, monkeypatch, capsys, name, case, argv, outcome):
    """The same cases through an MSC profile on the same bucket (msc://loop/... is s3://BUCKET/...)."""
    monkeypatch.setenv("MSC_CONFIG", s3.msc_config(str(tmp_path / "msc.json"), "loop", bucket))
    test_command_with_a_url(dict(remote, url="msc://loop/run"), tmp_path, capsys, name, case, argv, outcome)


@pytest.mark.subprocess
def test_sft_idx_check_refuses_a_url_in_one_line(remote, native_lib):
    """The native checker maps local files: a URL is refused before it runs (a subprocess: it
    execs the checker in its own place)."""
    url = shard0(remote)
    proc = subprocess.run([sys.executable, "-c", "import sys; from megatron_sft_idx._console import "
                           "sft_idx_check; sys.exit(sft_idx_check())", url], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.strip() == (f"sft_idx_check: error: {url}: the native checker reads local files only; "
                                   "check URLs with check-idx (same checks, streamed from object storage)")


def test_the_table_in_tools_md_lists_every_case():
    """docs/TOOLS.md "URLs" has one row per command and case, saying works or refused."""
    doc = open(os.path.join(ROOT, "docs", "TOOLS.md"), encoding="utf-8").read()
    section = doc[doc.index("## URLs"):]
    rows = re.findall(r"^\| `([a-z_-]+)` \| ([^|]+?) \| (works|refused)", section, re.M)
    table = {(n, c.strip()): o for n, c, o in rows}
    expected = {(n, c): o for n, c, _, o in CASES}
    expected[("sft_idx_check", "PATH URL")] = "refused"
    assert table == expected
    assert {n for n, _ in table} == set(TOOLS) | {"sft_idx_check"}
