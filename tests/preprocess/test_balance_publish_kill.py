"""A ``--balance-for`` run SIGKILLed while it publishes, then ``--resume``d (issue 30, attack family).

The kill lands on the real command at a file-level moment of the publish -- just after the first
shard's commit point, before and after a balanced order is written, after the first manifest --
found by watching the renames into final names (``os.replace``: every commit of this package is
one), so the test does not depend on how the publish is organised. Right after the kill a reader
sees a consistent output: no set, or a whole set whose manifest's order record matches the order
file beside it; never a manifest pointing at an order of another generation. ``--resume`` then
ends with the bytes of an uninterrupted run (shards, orders, manifests) and an order the adapters'
``"auto"`` door accepts -- or, if it refuses, in one line naming a file (a clear refusal).
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from megatron_sft_idx.batching.serve import checked_order, resolve_order
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.open import open_packed
from support.token_inputs import tokens_input

pytestmark = [pytest.mark.subprocess]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT)
SEED = 1234

# The command, with os.replace watched: the process SIGKILLs itself around the rename whose target
# (inside the output directory) ends with KILL_SUFFIX -- the KILL_NTH such one -- before it
# (KILL_WHEN=before) or just after it (after).
KILLED = r"""
import os, signal, sys
real, out = os.replace, os.path.realpath(os.environ["KILL_DIR"])
suffix, nth, when, seen = os.environ["KILL_SUFFIX"], int(os.environ["KILL_NTH"]), os.environ["KILL_WHEN"], [0]
def replace(src, dst, *a, **k):
    target = os.path.realpath(os.fspath(dst))
    hit = os.path.dirname(target) == out and target.endswith(suffix) and not os.path.basename(target).startswith(".")
    if hit:
        seen[0] += 1
    if hit and seen[0] == nth and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst, *a, **k)
    if hit and seen[0] == nth and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
from megatron_sft_idx.preprocess.cli import main
sys.exit(main(sys.argv[1:]))
"""

# (suffix, nth, when): after the first shard's .idx; before and after the first order; after the
# second order (both written, no manifest yet); after the first manifest.
KILLS = [(".idx", 1, "after"), (".order", 1, "before"), (".order", 1, "after"), (".order", 2, "after"),
         (".json", 1, "after"), (".idx", 3, "before")]


def argv(corpus, out, *extra):
    return ["--input", str(corpus / "in.jsonl"), "--input-format", "tokens", "--vocab-size", "50", "--pad-id", "0",
            "--pack-size", "256", "--split", "80,20", "--max-packs-per-shard", "12", "--balance-for", "2,1,4",
            "--seed", str(SEED), "--output-prefix", str(out / "ds"), "--quiet", *extra]


def tool(corpus, out, *extra, env=ENV):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_sft.py"), *argv(corpus, out, *extra)],
                          env=env, capture_output=True, text=True, timeout=600)


def outputs(directory):
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if not n.startswith(".") and os.path.isfile(os.path.join(directory, n))} if os.path.isdir(directory) else {}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("balance_kill")
    tokens_input(d / "in.jsonl", count=400)
    proc = tool(d, d / "ref")
    assert proc.returncode == 0, proc.stderr
    ref = outputs(d / "ref")
    assert {"ds_train.json", "ds_valid.json", "ds_train.order", "ds_valid.order"} <= set(ref), sorted(ref)
    assert len([n for n in ref if n.endswith(".seq.idx")]) >= 3
    return d


def consistent(out):
    """What a reader sees now: every manifest present opens as a whole set, and the order beside
    it is the one its record names (the "auto" door checks size, CRC-32 and topology)."""
    for name in sorted(os.listdir(out)):
        if name.endswith(".json") and not name.startswith("."):
            manifest = str(out / name)
            try:
                source = open_packed(manifest)
            except ShardError as exc:   # a set that is not whole is refused by name, never served mixed
                assert manifest in str(exc) or str(out) in str(exc), exc
                continue
            order = resolve_order("auto", manifest)
            assert order is not None and order.num_packs == len(source), manifest
            checked_order(order, source, seed=SEED)


@pytest.mark.parametrize("suffix,nth,when", KILLS, ids=[f"{w}-{s}-{n}" for s, n, w in KILLS])
def test_a_balanced_publish_killed_then_resumed_is_consistent(corpus, tmp_path, suffix, nth, when):
    out = tmp_path / "out"
    env = dict(ENV, KILL_DIR=str(out), KILL_SUFFIX=suffix, KILL_NTH=str(nth), KILL_WHEN=when)
    proc = subprocess.run([sys.executable, "-c", KILLED, *argv(corpus, out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)
    consistent(out)
    done = tool(corpus, out, "--resume", "--json")
    if done.returncode != 0:   # a clear refusal: one line, naming a file, no traceback
        err = done.stderr.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in done.stderr and str(out) in err[0], done.stderr
        pytest.fail(f"--resume refused after a kill in the publish: {err[0]}")
    summary = json.loads(done.stdout)
    assert sorted(summary["orders"]) == sorted(str(out / n) for n in ("ds_train.order", "ds_valid.order"))
    assert outputs(out) == outputs(corpus / "ref")   # shards, orders and manifests: an uninterrupted run's
    consistent(out)
    for split in ("train", "valid"):
        manifest = str(out / f"ds_{split}.json")
        checked_order(resolve_order("auto", manifest), open_packed(manifest), seed=SEED)
    again = tool(corpus, out, "--resume", "--json")   # and the finished run stays finished
    assert again.returncode == 0 and json.loads(again.stdout)["resumed_units"] == {"done": 1}, again.stderr
    assert outputs(out) == outputs(corpus / "ref")
