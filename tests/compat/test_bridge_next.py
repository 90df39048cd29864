"""``bridge_semantics="next"`` and ``"pr5610"`` against Megatron-Bridge's own collate, element by element.

The reference is data: tests/golden/bridge_next/ holds the batches Bridge main's
``GPTSFTPackedDataset.collate_fn`` (its file at the commit recorded there, in a copy of the
installed 0.6.2 stack) returned over the packs Bridge's packer writes for the parity tests
(``bridge_data``); tests/golden/bridge_pr5610/ the same for the head of Bridge PR #5610
(``refs/pull/5610/head``, 2026-08-17). Here the installed 0.6.2 packer writes the same packs again (their digest is
checked first, so a changed packer is told apart from a changed collate), and our dataset over
Bridge's ``.npy``, its Parquet and a shard converted from them must return those batches:
every key, value, dtype and shape, and no other key. tests/compat/make_bridge_next_golden.py
regenerates the fixture.
"""

import json
import os

import numpy as np
import pytest
import torch

from bridge_data import PACK_SIZE, bridge_tokenizer, write_bridge_artifacts
from make_bridge_next_golden import GOLDEN, GOLDEN_PR5610, OPTION_SETS, compare, packs_digest
from test_bridge_parity import assert_same_batch

from megatron_sft_idx.training.bridge import PackedSFTDataset
from megatron_sft_idx.training.collate import installed_bridge_semantics
from megatron_sft_idx.tools.convert import ConvertOptions, convert


#: Each fixture: the semantics that must reproduce it, its directory, and where its batches came from
#: (Bridge commit prefix, the ref the generator was asked for, SHA-256 of the upstream file).
FIXTURES = {
    "next": (GOLDEN, "067f987d", "main", "1bc6189584ea4ee448cb144c0200284b350b3962059fa99606733abd476278fc"),
    "pr5610": (GOLDEN_PR5610, "8d95ff4c", "refs/pull/5610/head",
               "154d1efb22d6d15c6611b01e45cb1c0444ed0d4b7809c2a44cf0b303ee3ff906"),
}


def load_fixture(directory):
    with open(os.path.join(directory, "cells.json")) as f:
        doc = json.load(f)
    return doc, np.load(os.path.join(directory, "batches.npz"))


@pytest.fixture(scope="module")
def golden():
    return load_fixture(GOLDEN)


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def fixture(request):
    """``(semantics, (doc, arrays))`` for each committed fixture."""
    return request.param, load_fixture(FIXTURES[request.param][0])


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    tokenizer = bridge_tokenizer()
    out = tmp_path_factory.mktemp("bridge_next")
    arts = {(a.kind, a.pad_seq_to_mult): a for a in write_bridge_artifacts(out, tokenizer)}
    shards = {}
    for key, art in arts.items():
        prefix = str(out / f"{art.kind}_cp{art.pad_seq_to_mult}_shard")
        convert(art.npy, prefix, options=ConvertOptions(pad_seq_to_mult=art.pad_seq_to_mult,
                                                        eos_id=tokenizer.eos_id))
        shards[key] = prefix
    return tokenizer, arts, shards


def expected_batch(cell, b, arrays):
    out = {}
    for key, spec in cell["keys"][b].items():
        out[key] = torch.from_numpy(arrays[f"c{cell['id']}_b{b}_{key}"]) if "tensor" in spec else spec["value"]
    return out


def test_the_installed_stack_defaults_to_its_own_semantics():
    assert installed_bridge_semantics() == "0.6"  # the 0.6.2 stack: today's parity tests keep running on it


def test_the_fixture_names_its_bridge_commit(fixture):
    semantics, (doc, arrays) = fixture
    _, commit, ref, file_sha256 = FIXTURES[semantics]
    assert len(doc["bridge_commit"]) == 40 and doc["bridge_file"].endswith("packing/gpt_sft.py")
    # the commit, the ref asked for and the file the batches came from
    assert (doc["bridge_commit"][:8], doc["bridge_ref"], doc["bridge_file_sha256"]) == (commit, ref, file_sha256)
    assert len(doc["cells"]) == 4 * 3 * 2 * 2
    assert all("padding_mask" in keys for c in doc["cells"] for keys in c["keys"])  # main's batches, not 0.6's
    assert all(("pad_between_seqs" in keys) == (semantics == "pr5610") for c in doc["cells"] for keys in c["keys"])


@pytest.mark.parametrize("source", ["npy", "parquet", "shard"])
def test_batches_identical_to_bridges_collate(fixture, packs, source):
    semantics, (doc, arrays) = fixture
    tokenizer, arts, shards = packs
    assert doc["eos_id"] == tokenizer.eos_id and doc["pack_size"] == PACK_SIZE
    checked = set()
    for cell in doc["cells"]:
        if cell["source"] != ("parquet" if source == "parquet" else "npy"):
            continue
        art = arts[(cell["kind"], cell["pad_seq_to_mult"])]
        if art.npy not in checked:
            assert packs_digest(art.npy, art.pad_seq_to_mult) == cell["packs_sha256"], \
                "the installed packer wrote other packs than the fixture's: regenerate it"
            checked.add(art.npy)
        path = {"npy": art.npy, "parquet": art.parquet,
                "shard": shards[(cell["kind"], cell["pad_seq_to_mult"])]}[source]
        ds = PackedSFTDataset(path, max_seq_length=PACK_SIZE, eos_id=tokenizer.eos_id,
                              pad_seq_to_mult=art.pad_seq_to_mult, pack_metadata_file_path=art.metadata,
                              answer_only_loss=cell["answer_only_loss"], bridge_semantics=semantics,
                              **OPTION_SETS[cell["options"]])
        assert len(ds) == cell["num_packs"]
        for b, idx in enumerate(cell["batches"]):
            got = ds.collate_fn([ds[i] for i in idx])
            assert_same_batch(expected_batch(cell, b, arrays), got,
                              f"{semantics}: {source} cell {cell['id']} ({cell['kind']} cp{cell['pad_seq_to_mult']} "
                              f"{cell['options']} answer_only={cell['answer_only_loss']}) batch {idx}")


def test_compare_names_what_another_bridge_commit_changes(golden, tmp_path, capsys):
    """The generator's --compare (how the figures for PR #5610's head in docs/TRAINING.md were
    measured): nothing against itself; a changed tensor and a new key, counted per batch."""
    doc, arrays = golden
    assert compare(GOLDEN, GOLDEN) == {}
    other = dict(arrays)
    cell = next(c for c in doc["cells"] if c["pad_seq_to_mult"] == 4)
    name = f"c{cell['id']}_b0_cu_seqlens_q"
    other[name] = other[name].copy()
    other[name][0, 1] += 1
    changed = json.loads(json.dumps(doc))
    for c in changed["cells"]:
        for keys in c["keys"]:
            keys["pad_between_seqs"] = {"value": c["pad_seq_to_mult"] > 1}
    np.savez_compressed(tmp_path / "batches.npz", **other)
    with open(tmp_path / "cells.json", "w") as f:
        json.dump(changed, f)
    counts = compare(str(tmp_path), GOLDEN)
    batches = {m: sum(len(c["batches"]) for c in doc["cells"] if c["pad_seq_to_mult"] == m) for m in (1, 4)}
    assert counts == {("cu_seqlens_q", 4, "differs"): 1, ("pad_between_seqs", 1, "only in new"): batches[1],
                      ("pad_between_seqs", 4, "only in new"): batches[4]}
    assert f"pad_between_seqs = true in {batches[4]} of them (pad_seq_to_mult=4)" in capsys.readouterr().out


def test_pr5610_fixture_differs_from_main_where_docs_say(golden):
    """What PR #5610's head changes against main on these cells (the figures in docs/TRAINING.md),
    so that "pr5610" and "next" are told apart by the data: logical boundaries and padding_mask only
    with context parallelism, pad_between_seqs everywhere, True only with context parallelism."""
    counts = compare(GOLDEN_PR5610, GOLDEN)
    assert counts == {("cu_seqlens_q", 4, "differs"): 133, ("cu_seqlens_kv", 4, "differs"): 133,
                      ("padding_mask", 4, "differs"): 133, ("pad_between_seqs", 1, "only in new"): 240,
                      ("pad_between_seqs", 4, "only in new"): 240}
    doc, _ = load_fixture(GOLDEN_PR5610)
    flags = {m: [keys["pad_between_seqs"]["value"] for c in doc["cells"] if c["pad_seq_to_mult"] == m
                 for keys in c["keys"]] for m in (1, 4)}
    assert flags[1].count(False) == 240 and flags[4].count(True) == 213 and flags[4].count(False) == 27
    assert all(type(v) is bool for m in flags for v in flags[m])
    # split by kind: the batches whose logical boundaries moved
    main_doc, main_arrays = load_fixture(GOLDEN)
    _, arrays = load_fixture(GOLDEN_PR5610)
    moved = {"prompt": 0, "chat": 0}
    for cell in doc["cells"]:
        for b in range(len(cell["batches"])):
            name = f"c{cell['id']}_b{b}_cu_seqlens_q"
            moved[cell["kind"]] += int(name in arrays and not np.array_equal(arrays[name], main_arrays[name]))
    assert moved == {"prompt": 88, "chat": 45}


def test_pr5610_keeps_the_supervised_eos_that_ends_a_runtime_segment(packs):
    """Why they moved, on these packs (docs/TRAINING.md): CP-4 sequences whose runtime segment ends in
    an EOS input with stored loss 1; "next" ends their logical length before it, "pr5610" keeps it."""
    tokenizer, arts, _ = packs
    eos = tokenizer.eos_id
    ending = {}
    for kind in ("prompt", "chat"):
        art = arts[(kind, 4)]
        ours = {s: PackedSFTDataset(art.npy, max_seq_length=PACK_SIZE, eos_id=eos, pad_seq_to_mult=4,
                                    bridge_semantics=s) for s in ("next", "pr5610")}
        ending[kind], sequences = 0, 0
        for i in range(len(ours["next"])):
            item = ours["next"][i]
            lengths = {s: np.diff(ds.collate_fn([item])["cu_seqlens_q"][0].numpy()) for s, ds in ours.items()}
            starts = item["seq_boundaries"]
            sequences += len(starts) - 1
            for k in range(len(starts) - 1):
                last = int(starts[k + 1]) - 2  # the segment's last input
                if item["input_ids"][last] == eos and item["loss_mask"][last] != 0:
                    ending[kind] += 1
                    runtime = last - int(starts[k]) + 1
                    assert lengths["pr5610"][k] == runtime and lengths["next"][k] < runtime, (kind, i, k)
        assert sequences == 64, kind
    assert ending == {"prompt": 47, "chat": 14}


def test_0_6_semantics_differ_from_main_on_these_cells(golden, packs):
    """The fixture tells the two apart: 0.6's batches (no padding_mask, EOS loss zeroed) are not main's."""
    doc, arrays = golden
    tokenizer, arts, _ = packs
    cell = next(c for c in doc["cells"] if c["kind"] == "prompt" and c["pad_seq_to_mult"] == 4
                and c["answer_only_loss"] and c["source"] == "npy" and c["options"] == "max")
    art = arts[("prompt", 4)]
    ds = PackedSFTDataset(art.npy, max_seq_length=PACK_SIZE, eos_id=tokenizer.eos_id, pad_seq_to_mult=4,
                          pad_to_max_length=True, bridge_semantics="0.6")
    diff = 0
    for b, idx in enumerate(cell["batches"]):
        got, want = ds.collate_fn([ds[i] for i in idx]), expected_batch(cell, b, arrays)
        assert "padding_mask" not in got
        diff += int((got["loss_mask"] != want["loss_mask"]).sum())
    assert diff > 0  # Bridge's packer stores loss 1 on EOS alignment padding; main trains it


def test_the_audit_counts_what_each_bridge_version_trains(packs, golden):
    """``inspect-idx --consumers`` on a converted shard: Bridge 0.6's count is what the installed
    Bridge 0.6.2's own collate trains over every pack of the original file, Bridge main's what
    main's collate trains (our 'next' collate, equal to it on the fixture's cells) and what PR #5610's
    head trains ('pr5610': its loss rule is main's); and the gate
    names trained EOS alignment padding where Bridge's prompt-template packer stored it."""
    from megatron.bridge.data.builders.gpt_sft import build_gpt_sft_split

    from megatron_sft_idx.gate import check
    from megatron_sft_idx.tools.inspect_consumers import consumer_audit

    tokenizer, arts, shards = packs
    warned = []
    for key, art in arts.items():
        bridge = build_gpt_sft_split(art.npy, tokenizer=tokenizer, seq_length=PACK_SIZE, memmap_workers=1,
                                     seed=1234, packed_sequence_size=PACK_SIZE, pack_metadata_path=art.metadata,
                                     pad_cu_seqlens=False, pad_seq_to_mult=art.pad_seq_to_mult,
                                     dataset_kwargs={"pad_to_max_length": False, "max_num_samples": None})
        ours = PackedSFTDataset(shards[key], max_seq_length=PACK_SIZE, eos_id=tokenizer.eos_id,
                                bridge_semantics="next")
        trained_06 = sum(int(bridge.collate_fn([bridge[i]])["loss_mask"].sum()) for i in range(len(bridge)))
        trained_next = sum(int(ours.collate_fn([ours[i]])["loss_mask"].sum()) for i in range(len(ours)))
        pr = PackedSFTDataset(shards[key], max_seq_length=PACK_SIZE, eos_id=tokenizer.eos_id,
                              bridge_semantics="pr5610")
        trained_pr5610 = sum(int(pr.collate_fn([pr[i]])["loss_mask"].sum()) for i in range(len(pr)))
        total = consumer_audit([shards[key]])["total"]  # the EOS id is the one the conversion recorded
        assert total["megatron-bridge-0.6"] == trained_06, key
        assert total["megatron-bridge-next"] == trained_next == trained_pr5610 == total["trl-padding-free"], key
        codes = check(shards[key]).shards[0].codes()
        assert ("BRIDGE_ALIGNMENT_PADDING_TRAINED" in codes) == bool(total["alignment_padding_trained"]), key
        if total["alignment_padding_trained"]:
            warned.append(key)
    assert ("prompt", 4) in warned  # Bridge's prompt-template packer trains its CP padding
