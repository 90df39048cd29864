"""The two context-parallel padding layouts: one rule, enforced by builder, gate and preprocessing."""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

from support.shardgen import write_shard

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.errors import InvariantError, MetadataError, ShardError
from megatron_sft_idx.gate import check
from megatron_sft_idx.packing.padding import is_padded, pad_offset, padded_length, truncation_length

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=50), st.integers(1, 64),
       st.sampled_from(["stored", "runtime"]))
def test_padded_length_is_the_smallest_padded_length_not_below(lengths, mult, layout):
    out = padded_length(lengths, mult, layout)
    assert (out >= lengths).all() and is_padded(out, mult, layout).all()
    assert (out - np.asarray(lengths) < mult).all()  # the smallest such length
    np.testing.assert_array_equal(padded_length(out, mult, layout), out)  # idempotent
    off = pad_offset(layout)
    t = truncation_length(4096, mult, layout)
    assert t <= 4096 and (t - off) % mult == 0 and t + mult > 4096


def test_unknown_layout_is_refused():
    with pytest.raises(ShardError, match="unknown padding layout"):
        padded_length([3], 4, "both")
    with pytest.raises(MetadataError, match="unknown padding layout"):
        write_shard("/nonexistent/x", [], metadata={"pad_layout": "both"})


@pytest.mark.parametrize("layout,lengths", [("stored", (8, 4)), ("runtime", (9, 5))])
def test_builder_and_gate_check_the_recorded_layout(tmp_path, layout, lengths):
    n = sum(lengths)
    loss = np.ones(n, np.uint8)
    loss[lengths[0] - 1] = loss[n - 1] = 0
    pack = (np.arange(1, n + 1), loss, np.array([0, lengths[0]]))
    prefix = str(tmp_path / layout)
    write_shard(prefix, [pack], metadata={"pad_seq_to_mult": 4, "pad_layout": layout})
    assert MMapIndexedDataset(prefix).metadata.pad_layout == layout
    assert check(prefix).passed
    other = "runtime" if layout == "stored" else "stored"
    with pytest.raises(InvariantError, match=f"pad_layout {other}"):
        write_shard(str(tmp_path / "bad"), [pack], metadata={"pad_seq_to_mult": 4, "pad_layout": other})


def test_gate_reports_a_sequence_off_the_recorded_layout(tmp_path):
    """A shard whose metadata claims the other layout fails with SEQ_NOT_PAD_MULTIPLE."""
    from support.corrupt import reseal

    prefix = str(tmp_path / "s")
    loss = np.array([0, 1, 1, 1, 0, 0, 1, 1, 1, 0], np.uint8)
    write_shard(prefix, [(np.arange(1, 11), loss, np.array([0, 5]))],
                metadata={"pad_seq_to_mult": 4, "pad_layout": "runtime"})
    reseal(prefix, edit=lambda m: m.update(pad_layout="stored"))
    report = check(prefix)
    assert not report.passed and "SEQ_NOT_PAD_MULTIPLE" in {f.code for f in report.findings()}


@pytest.mark.subprocess
@pytest.mark.parametrize("layout", ["stored", "runtime"])
def test_preprocess_pads_for_the_chosen_stack(tmp_path, layout):
    prefix = str(tmp_path / layout)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_sft.py"), "--input",
                           os.path.join(ROOT, "examples", "conversations_sharegpt.jsonl"), "--tokenizer",
                           os.path.join(ROOT, "examples", "tokenizer"), "--output-prefix", prefix,
                           "--pack-size", "512", "--cp", "2", "--pad-layout", layout, "--check", "--quiet"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    ds = MMapIndexedDataset(prefix)
    assert (ds.metadata.pad_layout, ds.metadata.pad_seq_to_mult) == (layout, 4)
    lengths = np.concatenate([ds[i].seq_lengths for i in range(len(ds))])
    assert set(((lengths - pad_offset(layout)) % 4).tolist()) == {0}
    stats = ds.metadata.stats
    counts = np.diff(np.asarray(ds.seq_offsets))
    assert stats.min_packed_runtime_len == int((np.asarray(ds.sequence_lengths) - counts).min())
