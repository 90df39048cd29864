"""The gate walks a shard in chunks and releases each chunk's pages: same findings, bounded memory.

Every case of the corruption matrix, plus shards with more findings than the gate lists, is
checked with the default chunks (one chunk for these small shards) and with chunks of a few
packs and tokens; the reports must be identical, finding for finding (code, file, pack,
offset, message) and in the same order. A ~48 MiB shard is checked in a fresh process with
chunks of 256k tokens: its resident memory grows by a fraction of the shard's size.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from support.corrupt import layout, reseal, set_loss
from megatron_sft_idx import IndexedDatasetBuilder
from megatron_sft_idx.gate import check, content, structure
from test_gate_corruption import CASES, build

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def findings(prefix, **kw):
    report = check(prefix, **kw)
    return report.passed, [(f.code, f.severity, f.file, f.pack, f.offset, f.message)
                           for s in report.shards for f in s.findings]


def tiny_chunks(monkeypatch, packs=5, tokens=40):
    monkeypatch.setattr(content, "CHUNK_PACKS", packs)
    monkeypatch.setattr(content, "CHUNK_TOKENS", tokens)
    monkeypatch.setattr(structure, "_BODY_CHUNK", 4096)


@pytest.mark.slow
@pytest.mark.parametrize("name,corrupt,code", CASES, ids=[c[0] for c in CASES])
def test_findings_do_not_depend_on_the_chunks(tmp_path, monkeypatch, name, corrupt, code):
    prefix = build(tmp_path)  # 24 packs: chunks of 5 packs / 40 tokens split it into many
    corrupt(prefix, tmp_path)
    whole = findings(prefix, level="deep")
    with monkeypatch.context() as m:
        tiny_chunks(m)
        chunked = findings(prefix, level="deep")
    assert chunked == whole
    assert code in {f[0] for f in whole[1]}


@pytest.mark.parametrize("packs,tokens", [(1, 1), (3, 10), (7, 200)])
def test_more_findings_than_listed_are_counted_across_chunks(tmp_path, monkeypatch, packs, tokens):
    """Over MAX_PACK_FINDINGS broken packs and all-zero masks: the totals and the listed firsts
    come out the same however the packs are chunked."""
    prefix = build(tmp_path, n=150)
    ptr, lengths, _, _ = layout(prefix)
    for i in range(0, 150, 2):  # loss on the last position of every other pack
        set_loss(prefix, int(ptr[i]) // 2 + int(lengths[i]) - 1, 1)
    for i in range(1, 150, 2):  # all-zero loss on the others
        for t in range(int(lengths[i])):
            set_loss(prefix, int(ptr[i]) // 2 + t, 0)
    reseal(prefix)
    whole = findings(prefix)
    with monkeypatch.context() as m:
        tiny_chunks(m, packs, tokens)
        chunked = findings(prefix)
    assert chunked == whole
    codes = [f[0] for f in whole[1]]
    assert codes.count("LOSS_ON_LAST_POSITION") == content.MAX_PACK_FINDINGS + 1  # the total, then 64
    assert codes.count("ZERO_LOSS_PACK") == content.MAX_PACK_FINDINGS + 1


def test_clean_and_pretrain_shards_pass_in_chunks(tmp_path, monkeypatch):
    prefix = build(tmp_path, n=60, pack_size=64)
    tiny_chunks(monkeypatch)
    assert findings(prefix, level="deep")[0]
    for suffix in (".loss.bin", ".seq.idx", ".seq.bin"):
        os.unlink(prefix + suffix)
    passed, found = findings(prefix, allow_pretrain=True)
    assert passed, found


MEMORY_PROBE = r"""
import json, os, sys
import numpy as np
from megatron_sft_idx.gate import check, content
prefix, warm = sys.argv[1], sys.argv[2]
content.CHUNK_TOKENS, content.CRC_CHUNK = 1 << 18, 1 << 20
check(warm, level="deep")  # kernels loaded, maps of a tiny shard: fixed costs before the baseline

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) / 1024
    return out

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak
base = status()["VmRSS"]
report = check(prefix, level=sys.argv[3])
print(json.dumps({"passed": report.passed, "growth_mb": status()["VmHWM"] - base}))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("level", ["standard", "deep"])
def test_resident_memory_is_bounded_by_a_chunk(tmp_path, level):
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 32000, 4096) for _ in range(8)]
    prefix, warm = str(tmp_path / "big"), str(tmp_path / "warm")
    for path, count in ((prefix, 4096), (warm, 2)):
        with IndexedDatasetBuilder(path, vocab_size=32000, pack_size=4096) as b:
            for i in range(count):
                loss = np.ones(4096, np.uint8)
                loss[[2047, 4095]] = 0
                b.add_packed(pool[i % 8], loss, np.array([0, 2048]))
    size_mb = sum(os.path.getsize(prefix + s) for s in (".bin", ".loss.bin", ".idx", ".seq.idx", ".seq.bin")) / 2**20
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, prefix, warm, level], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["passed"]
    assert size_mb > 45
    # One chunk is 256k tokens (0.75 MiB of data); what else grows is the CRC buffer (1 MiB) and
    # numpy/Python temporaries. Mapping the whole shard would add its 48 MiB.
    assert result["growth_mb"] < 12, (result, size_mb)
