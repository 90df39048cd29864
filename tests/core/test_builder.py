"""The builder: invariant refusals, atomic publishing, overwrite rules, add_shard, metadata, memory."""

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from megatron_sft_idx import IndexedDatasetBuilder, MMapIndexedDataset
from megatron_sft_idx import builder as builder_mod
from megatron_sft_idx.errors import (
    BuilderStateError,
    InvariantError,
    MetadataError,
    ShardError,
    ShardExistsError,
)
from megatron_sft_idx.format import ALL_SUFFIXES, Rule
from support.shardgen import random_pack, random_packs, write_shard


def shard_bytes(prefix):
    out = {}
    for suffix in ALL_SUFFIXES:
        with open(prefix + suffix, "rb") as f:
            out[suffix] = f.read()
    return out


def assert_packs_equal(ds, packs):
    assert len(ds) == len(packs)
    for i, (ids, loss, starts) in enumerate(packs):
        got = ds[i]
        np.testing.assert_array_equal(got.input_ids, ids)
        np.testing.assert_array_equal(got.loss_mask, loss)
        np.testing.assert_array_equal(got.seq_start_id, starts)


GOOD = (np.array([3, 4, 5, 6, 7, 8]), np.array([1, 0, 1, 1, 1, 0], np.uint8), np.array([0, 2]))

# rule -> (builder kwargs, (input_ids, loss_mask, seq_start_id)); every member of Rule but OK.
VIOLATIONS = {
    Rule.PACK_EMPTY: ({}, ([], [], [0])),
    Rule.PACK_TOO_LONG: ({}, (range(9), [0] * 9, [0])),
    Rule.LENGTH_MISMATCH: ({}, ([1, 2, 3], [0, 0], [0])),
    Rule.LOSS_VALUE: ({}, ([1, 2, 3], [2, 0, 0], [0])),
    Rule.LOSS_ON_LAST: ({}, ([1, 2, 3, 4], [1, 1, 0, 1], [0, 2])),
    Rule.SEQ_NONE: ({}, ([1, 2, 3], [0, 0, 0], [])),
    Rule.SEQ_FIRST_NOT_ZERO: ({}, ([1, 2, 3], [0, 0, 0], [1])),
    Rule.SEQ_NOT_INCREASING: ({}, ([1, 2, 3, 4], [0, 0, 0, 0], [0, 2, 2])),
    Rule.SEQ_START_OUT_OF_RANGE: ({}, ([1, 2, 3], [0, 0, 0], [0, 3])),
    Rule.SEQ_NOT_PAD_MULTIPLE: ({"metadata": {"pad_seq_to_mult": 2}}, ([1, 2, 3, 4, 5, 6], [0] * 6, [0, 3])),
    Rule.TOKEN_NEGATIVE: ({}, ([1, -2, 3], [0, 0, 0], [0])),
    Rule.TOKEN_TOO_LARGE: ({"dtype": np.uint16}, ([1, 70000, 3], [0, 0, 0], [0])),
    Rule.TOKEN_OUT_OF_VOCAB: ({"vocab_size": 32}, ([1, 32, 3], [0, 0, 0], [0])),
}


def test_every_rule_has_a_violation_case():
    assert set(VIOLATIONS) == set(Rule) - {Rule.OK}


@pytest.mark.parametrize("rule", sorted(VIOLATIONS), ids=lambda r: r.name)
def test_violation_names_pack_and_rule_and_builder_stays_usable(tmp_path, rule):
    kw, bad = VIOLATIONS[rule]
    prefix = str(tmp_path / "s")
    b = IndexedDatasetBuilder(prefix, pack_size=8, **kw)
    b.add_packed(*GOOD)
    with pytest.raises(InvariantError, match=rf"pack 1 rejected.*\[pack=1, .*rule={rule.name}\b") as info:
        b.add_packed(*bad)
    assert info.value.pack == 1 and info.value.rule == rule.name and info.value.path == prefix
    assert b.add_packed(*GOOD) == 1
    b.finalize()
    ds = MMapIndexedDataset(prefix, check_packs=True)
    assert_packs_equal(ds, [GOOD, GOOD])
    assert ds.metadata.stats.token_count == 12


@pytest.mark.parametrize("bad, match", [
    ((np.array([1.0, 2.0]), [0, 0], [0]), "input_ids must hold integers"),
    (([1, 2], [0.0, 0.0], [0]), "loss_mask must hold integers"),
    (([1, 2], [0, 0], np.array([0.0])), "seq_start_id must hold integers"),
    ((np.array([[1, 2]]), [0, 0], [0]), "input_ids must be one-dimensional"),
    (([1, 2], np.zeros((2, 1), int), [0]), "loss_mask must be one-dimensional"),
    (([1, 2], [0, 0], 0), "seq_start_id must be one-dimensional"),
    ((np.array(["a", "b"]), [0, 0], [0]), "input_ids must hold integers"),
    ((np.array([2 ** 64 - 1], np.uint64), [0], [0]), r"pack=0.*rule=TOKEN_TOO_LARGE"),
])
def test_non_integer_or_multi_dimensional_input_refused(tmp_path, bad, match):
    prefix = str(tmp_path / "s")
    b = IndexedDatasetBuilder(prefix)
    with pytest.raises(InvariantError, match=match):
        b.add_packed(*bad)
    b.add_packed(*GOOD)
    b.finalize()
    assert_packs_equal(MMapIndexedDataset(prefix), [GOOD])


def test_bool_loss_mask_accepted(tmp_path):
    prefix = str(tmp_path / "s")
    write_shard(prefix, [(GOOD[0], GOOD[1].astype(bool), GOOD[2])])
    assert_packs_equal(MMapIndexedDataset(prefix), [GOOD])


def test_auto_dtype_refuses_token_beyond_int32(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "s"))
    with pytest.raises(InvariantError, match="rule=TOKEN_TOO_LARGE"):
        b.add_packed([2 ** 31], [0], [0])
    b.abort()


@pytest.mark.parametrize("kw, match", [
    ({"pack_size": 0}, "pack_size must be an integer in 1..2147483647"),
    ({"vocab_size": -1}, "vocab_size must be an integer in 1..2147483647"),
    ({"pack_size": True}, "pack_size must be an integer in 1..2147483647"),
    ({"dtype": np.int64}, "token dtype must be uint16 or int32"),
    ({"dtype": "foo"}, "'foo' is not a numpy dtype"),
    ({"dtype": np.complex64}, "numpy dtype complex64 has no Megatron dtype code"),
    ({"metadata": {"extra": "abc"}}, r"metadata\['extra'\] must be a mapping"),
    ({"metadata": {"extra": [("a", 1)]}}, r"metadata\['extra'\] must be a mapping"),
    ({"metadata": ["a"]}, "metadata must be a mapping"),
    ({"dtype": np.uint16, "vocab_size": 70000}, "vocab_size 70000 does not fit uint16"),
    ({"metadata": {"pad_seq_to_mult": 0}}, r"pad_seq_to_mult must be an int in 1\.\.2147483647"),
    ({"metadata": {"tokenizer": "gpt2"}}, r"metadata\['tokenizer'\] must be a mapping"),
    ({"metadata": {"stats": {}}}, r"\['stats'\] are written by the builder"),
    ({"metadata": {"pack_size": 3, "vocab_size": 3}}, r"\['pack_size', 'vocab_size'\]"),
])
def test_bad_arguments_refused_and_nothing_written(tmp_path, kw, match):
    with pytest.raises(ShardError, match=match):
        IndexedDatasetBuilder(str(tmp_path / "s"), **kw)
    assert os.listdir(tmp_path) == []


def test_vocab_size_picks_dtype(tmp_path):
    assert write_shard(str(tmp_path / "a"), [GOOD], vocab_size=65536).token_dtype == "uint16"
    assert write_shard(str(tmp_path / "b"), [GOOD], vocab_size=65537).token_dtype == "int32"
    assert write_shard(str(tmp_path / "c"), [GOOD], dtype=np.int32).token_dtype == "int32"
    assert MMapIndexedDataset(str(tmp_path / "b"))[0].input_ids.dtype == np.int32


# ----------------------------------------------------------------------------- atomic publishing


def test_context_manager_publishes_all_five_files_and_nothing_else(tmp_path):
    prefix = str(tmp_path / "sub" / "s")
    with IndexedDatasetBuilder(prefix) as b:
        b.add_packed(*GOOD)
    assert sorted(os.listdir(tmp_path / "sub")) == sorted("s" + s for s in ALL_SUFFIXES)
    assert b.metadata is not None
    with pytest.raises(BuilderStateError, match="finalized"):
        b.add_packed(*GOOD)
    with pytest.raises(BuilderStateError):
        b.finalize()


def test_exception_inside_with_leaves_nothing(tmp_path):
    with pytest.raises(KeyError):
        with IndexedDatasetBuilder(str(tmp_path / "s")) as b:
            b.add_packed(*GOOD)
            raise KeyError("boom")
    assert os.listdir(tmp_path) == []
    with pytest.raises(BuilderStateError, match="aborted"):
        b.add_packed(*GOOD)


def test_finalize_with_zero_packs_refused_and_leaves_nothing(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "s"))
    with pytest.raises(BuilderStateError, match="no packs were added"):
        b.finalize()
    assert os.listdir(tmp_path) == []
    with pytest.raises(BuilderStateError):
        with IndexedDatasetBuilder(str(tmp_path / "s")):
            pass
    assert os.listdir(tmp_path) == []


def test_abandoned_builder_removes_its_temporaries(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "s"))
    b.add_packed(*GOOD)
    assert os.listdir(tmp_path)  # temporaries exist while writing
    del b
    assert os.listdir(tmp_path) == []


def test_existing_shard_refused_without_overwrite_and_replaced_with_it(tmp_path, rng):
    prefix = str(tmp_path / "s")
    old = random_packs(rng, 3)
    write_shard(prefix, old)
    before = shard_bytes(prefix)
    with pytest.raises(ShardExistsError, match="already exists") as info:
        IndexedDatasetBuilder(prefix)
    assert isinstance(info.value, FileExistsError)
    assert shard_bytes(prefix) == before
    reader_of_old = MMapIndexedDataset(prefix)
    reader_of_old[0]  # maps the old files
    new = random_packs(rng, 5)
    write_shard(prefix, new, overwrite=True)
    assert_packs_equal(MMapIndexedDataset(prefix), new)
    assert_packs_equal(reader_of_old, old)  # renames never rewrite a mapped file in place
    assert sorted(os.listdir(tmp_path)) == sorted("s" + s for s in ALL_SUFFIXES)


def test_companions_without_idx_are_leftovers_not_a_shard(tmp_path):
    """Only .idx (published last) makes a shard: an interrupted build's companions are replaced."""
    prefix = str(tmp_path / "s")
    for suffix in (".bin", ".loss.bin", ".seq.idx", ".seq.bin"):
        (tmp_path / ("s" + suffix)).write_bytes(b"left over")
    write_shard(prefix, [GOOD])
    assert_packs_equal(MMapIndexedDataset(prefix), [GOOD])
    (tmp_path / "s.seq.idx").unlink()
    with pytest.raises(ShardExistsError):  # a lone .idx is still somebody's data
        IndexedDatasetBuilder(prefix)


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_dead_writer_are_cleared_live_ones_kept(tmp_path):
    prefix = str(tmp_path / "s")
    dead = _dead_pid()
    stale = [f"{prefix}{s}.tmp-{dead}-deadbeef" for s in ALL_SUFFIXES]
    live_writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = f"{prefix}.bin.tmp-{live_writer.pid}-cafecafe"
        other = str(tmp_path / "other.bin.tmp-1-00000000")  # another prefix: not ours to touch
        for path in stale + [live, other]:
            open(path, "wb").close()
        write_shard(prefix, [GOOD])
        left = set(os.listdir(tmp_path)) - {"s" + s for s in ALL_SUFFIXES}
        assert left == {os.path.basename(live), os.path.basename(other)}
    finally:
        live_writer.kill()
        live_writer.wait()


# ----------------------------------------------------------------------------- add_shard


def test_add_shard_equals_adding_packs_one_by_one(tmp_path, rng, monkeypatch):
    a, b = random_packs(rng, 7), random_packs(rng, 11, full=True)
    write_shard(str(tmp_path / "a"), a, vocab_size=1000)
    write_shard(str(tmp_path / "b"), b, vocab_size=1000)
    write_shard(str(tmp_path / "direct"), a + b[:1] + b, vocab_size=1000)
    monkeypatch.setattr(builder_mod, "_COPY_CHUNK", 50)  # force several chunks per source
    with IndexedDatasetBuilder(str(tmp_path / "merged"), pack_size=64, vocab_size=1000) as m:
        m.add_shard(str(tmp_path / "a"))
        m.add_packed(*b[0])
        m.add_shard(tmp_path / "b")
    assert shard_bytes(str(tmp_path / "merged")) == shard_bytes(str(tmp_path / "direct"))


def test_add_shard_widens_auto_dtype(tmp_path, rng):
    small = random_packs(rng, 3)
    big = [(np.array([70000, 1, 2]), np.array([1, 1, 0]), np.array([0]))]
    write_shard(str(tmp_path / "big"), big, pack_size=None)
    with IndexedDatasetBuilder(str(tmp_path / "m")) as m:
        for p in small:
            m.add_packed(*p)
        m.add_shard(str(tmp_path / "big"))
    assert m.metadata.token_dtype == "int32"
    assert_packs_equal(MMapIndexedDataset(str(tmp_path / "m")), small + big)


def test_add_shard_refuses_pretrain_source(tmp_path):
    prefix = str(tmp_path / "p")
    write_shard(prefix, [GOOD])
    for suffix in (".loss.bin", ".seq.idx", ".seq.bin"):
        os.unlink(prefix + suffix)
    m = IndexedDatasetBuilder(str(tmp_path / "m"))
    with pytest.raises(ShardError, match="add_shard takes SFT shards"):
        m.add_shard(prefix)
    m.add_packed(*GOOD)
    m.finalize()


@pytest.mark.parametrize("kw, rule", [({"pack_size": 8}, "PACK_TOO_LONG"),
                                      ({"vocab_size": 50, "dtype": np.int32}, "TOKEN_OUT_OF_VOCAB"),
                                      ({"dtype": np.uint16}, "TOKEN_TOO_LARGE"),
                                      ({"metadata": {"pad_seq_to_mult": 2}}, "SEQ_NOT_PAD_MULTIPLE")])
def test_add_shard_refuses_packs_breaking_stricter_rules(tmp_path, kw, rule):
    src = str(tmp_path / "src")
    packs = [GOOD, (np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 70000]), np.zeros(10, np.uint8), np.array([0, 5]))]
    write_shard(src, packs, pack_size=None)
    m = IndexedDatasetBuilder(str(tmp_path / "m"), **kw)
    with pytest.raises(InvariantError, match=rf"{src}: source pack rejected.*pack=1.*rule={rule}"):
        m.add_shard(src)
    m.abort()
    assert sorted(os.listdir(tmp_path)) == sorted("src" + s for s in ALL_SUFFIXES)


def _patch_int64(path, offset, value):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.array([value], "<i8").tobytes())


@pytest.mark.parametrize("where", ["pointer", "csr"])
def test_add_shard_refuses_a_source_whose_index_is_not_contiguous(tmp_path, where):
    """Offsets in bounds but not cumulative: the packs validated would differ from the bytes copied."""
    src = str(tmp_path / "src")
    write_shard(src, [GOOD, GOOD, GOOD])
    ds = MMapIndexedDataset(src)
    if where == "pointer":
        _patch_int64(src + ".idx", ds.idx_header.pointers_offset + 8, 0)  # pack 1 claims pack 0's bytes
    else:
        _patch_int64(src + ".seq.idx", ds.seq_header.csr_offset + 8, 0)
    m = IndexedDatasetBuilder(str(tmp_path / "m"))
    with pytest.raises(InvariantError, match=r"source shard index is corrupt.*pack=1"):
        m.add_shard(src)
    m.abort()


# ----------------------------------------------------------------------------- metadata, determinism


def test_metadata_keys_kept_and_reserved(tmp_path):
    prefix = str(tmp_path / "s")
    meta = {"tokenizer": {"name": "t", "sha": "abc"}, "packing": {"algo": "ffd", "seed": 3},
            "parallelism": {"cp": 2}, "source": {"files": ["x.jsonl"]}, "run": "r17",
            "extra": {"note": "n"}, "pad_seq_to_mult": 2}
    write_shard(prefix, [(np.arange(6), np.array([1, 0, 1, 1, 1, 0]), np.array([0, 2]))], metadata=meta)
    m = MMapIndexedDataset(prefix).metadata
    assert m.tokenizer == {"name": "t", "sha": "abc"} and m.packing == {"algo": "ffd", "seed": 3}
    assert m.parallelism == {"cp": 2} and m.source == {"files": ["x.jsonl"]}
    assert m.extra == {"note": "n", "run": "r17"} and m.pad_seq_to_mult == 2
    assert m.loss_mask_convention == "label_aligned" and m.producer["name"] == "megatron_sft_idx"


def test_unserialisable_metadata_refused_at_construction_and_nothing_left(tmp_path):
    with pytest.raises(MetadataError, match="not JSON-serialisable"):
        IndexedDatasetBuilder(str(tmp_path / "s"), metadata={"blob": object()})
    assert os.listdir(tmp_path) == []


def test_same_packs_give_byte_identical_files(tmp_path, rng):
    packs = random_packs(rng, 20, pack_size=32, max_seqs=4)
    for name in ("a", "b"):
        write_shard(str(tmp_path / name), packs, pack_size=32, vocab_size=1000,
                    metadata={"tokenizer": {"name": "x"}})
    assert shard_bytes(str(tmp_path / "a")) == shard_bytes(str(tmp_path / "b"))


# ----------------------------------------------------------------------------- bounded memory


@pytest.mark.slow
def test_heap_grows_by_a_few_bytes_per_pack(tmp_path):
    """Per-pack bookkeeping is compact int32 blocks (8 bytes per pack), never Python objects.

    The pack count ends exactly where a new 64Ki block starts, so the measurement includes
    one whole block per buffer and block slack does not blur the slope.
    """
    n = 65536
    ids, loss, starts = np.array([5, 6, 7]), np.array([1, 1, 0], np.uint8), np.array([0])
    b = IndexedDatasetBuilder(str(tmp_path / "s"), pack_size=8)
    b.add_packed(ids, loss, starts)  # warm up kernels and buffers
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(n):
            b.add_packed(ids, loss, starts)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    b.finalize()
    assert (current - base) / n <= 10, (current - base) / n
    assert peak - base <= 12 * n + (256 << 10), (peak - base) / n
    assert len(MMapIndexedDataset(str(tmp_path / "s"))) == n + 1


# ----------------------------------------------------------------------------- state machine


class BuilderMachine(RuleBasedStateMachine):
    """Any interleaving of valid and refused packs yields a shard of exactly the valid ones."""

    CASES = {rule: case for rule, (kw, case) in VIOLATIONS.items() if not kw.get("metadata")}

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp()
        self.prefix = os.path.join(self.dir, "s")
        self.builder = IndexedDatasetBuilder(self.prefix, dtype=np.uint16, vocab_size=32, pack_size=8)
        self.expected = []

    @rule(seed=st.integers(0, 2 ** 32 - 1))
    def add_valid(self, seed):
        pack = random_pack(np.random.default_rng(seed), pack_size=8, vocab=32, max_seqs=8)
        assert self.builder.add_packed(*pack) == len(self.expected)
        self.expected.append(pack)

    @rule(violation=st.sampled_from(sorted(CASES)))
    def add_invalid(self, violation):
        with pytest.raises(InvariantError, match=rf"pack={len(self.expected)}, .*rule={violation.name}\b"):
            self.builder.add_packed(*self.CASES[violation])

    @invariant()
    def length_counts_only_accepted_packs(self):
        assert len(self.builder) == len(self.expected)

    def teardown(self):
        import shutil

        try:
            if self.expected:
                self.builder.finalize()
                assert_packs_equal(MMapIndexedDataset(self.prefix, check_packs=True), self.expected)
            else:
                with pytest.raises(BuilderStateError):
                    self.builder.finalize()
                assert os.listdir(self.dir) == []
        finally:
            shutil.rmtree(self.dir)


TestBuilderMachine = BuilderMachine.TestCase
TestBuilderMachine.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)


# --------------------------------------------------------------------------- sources (format 1.2)


def test_source_ids_are_checked_per_pack_and_counted(tmp_path):
    from megatron_sft_idx.errors import BuilderStateError, InvariantError

    meta = {"sources": [{"name": "a", "store_id": "x"}, {"name": "b"}]}
    ids, loss = np.array([1, 2, 3, 4]), np.array([1, 0, 1, 0])
    with IndexedDatasetBuilder(str(tmp_path / "s"), vocab_size=32, pack_size=8, metadata=meta) as b:
        for bad, words in (([2, 0], "one id in"), ([0], "one id in"), (None, "pass source_ids"), ([-1, 0], "one id in")):
            with pytest.raises(InvariantError, match=words):
                b.add_packed(ids, loss, np.array([0, 2]), source_ids=bad)
        with pytest.raises(BuilderStateError, match="cannot record sources"):
            b.add_sequences(ids, loss, np.array([2, 2]))
        b.add_packed(ids, loss, np.array([0, 2]), source_ids=[1, 1])   # the builder is still usable
        b.add_packed(ids, loss, np.array([0]), source_ids=np.array([0], np.uint8))
    ds = MMapIndexedDataset(str(tmp_path / "s"))
    assert [(s.name, s.sequences, s.extra) for s in ds.metadata.sources] == [("a", 1, {"store_id": "x"}), ("b", 2, {})]
    assert ds.seq_header.version_minor == 2 and ds.source_ids(0).tolist() == [1, 1]
    with IndexedDatasetBuilder(str(tmp_path / "plain"), vocab_size=32, pack_size=8) as b:
        with pytest.raises(InvariantError, match="names no sources"):
            b.add_packed(ids, loss, np.array([0]), source_ids=[0])
        with pytest.raises(ShardError, match="add_shard would drop"):
            b.add_shard(str(tmp_path / "s"))
        b.add_packed(ids, loss, np.array([0]))
    assert MMapIndexedDataset(str(tmp_path / "plain")).seq_header.version_minor == 1


def test_an_aborted_builder_leaves_no_source_spill(tmp_path):
    meta = {"sources": [{"name": "a"}]}
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "s"), vocab_size=32, pack_size=8, metadata=meta) as b:
            b.add_packed(np.array([1, 2]), np.array([1, 0]), np.array([0]), source_ids=[0])
            raise RuntimeError("stop")
    assert os.listdir(tmp_path) == []
