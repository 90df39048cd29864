"""Our store and shards against Megatron-LM PR #5017's ``SFTDataset``, element by element.

The reference is data: tests/golden/megatron_lm_5017/ holds what #5017's own code (its files at
``97b2c55e``, unmodified, beside megatron-core 0.19.2; the one stub is megatron_cpu's Triton
stand-in) returned for the conversation-level bin/idx ``repack-sft --for megatron-lm-5017``
writes from a store: ``pack_samples``' bins, its indices, every ``__getitem__`` and its batch
preprocessing. tests/compat/make_megatron_lm_5017_golden.py regenerates it. Here the same
inputs are built again (their digest checked first, so a changed writer is told apart from a
changed #5017) and compared with the store and with our shards of it packed by
``megatron_lm_mffd``:

* the same conversations, minus those longer than the sequence length, which #5017 drops;
* its packs, reproduced by our packer (bins, their order, the order inside each);
* tokens equal; masks equal up to its one-token shift, every other difference named and
  counted (the figures docs/TRAINING.md "Megatron-LM #5017" gives);
* its CP-padded batches (CP 2, and CP 2 with SP over TP 2) against our adapter's output from
  shards padded for CP 2, conversation by conversation: tokens and positions equal, every other
  difference named and counted (its 2*CP*TP multiple, its t[:-1], its -100 labels, its overflow).
"""

import json
import os
from collections import Counter

import numpy as np
import pytest

from make_megatron_lm_5017_golden import CP_TP_CELLS, GOLDEN, PAD_ID, SEQ_LENGTH, build_inputs, file_sha256

from megatron_sft_idx.packing import pack_lengths, pad_multiple_for, padded_length
from megatron_sft_idx.packing.megatron_lm import megatron_lm_bins
from megatron_sft_idx.preprocess import RepackConfig, repack
from megatron_sft_idx.preprocess.store import SequenceStore
from megatron_sft_idx.reader import MMapIndexedDataset

pytestmark = [pytest.mark.compat, pytest.mark.slow]

COMMIT = "97b2c55e4c373a072c36e79104bcdac1d77c022f"
DATASET_SHA256 = "megatron/core/datasets/sft_dataset.py"


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(GOLDEN, "golden.json")) as f:
        doc = json.load(f)
    return doc, np.load(os.path.join(GOLDEN, "arrays.npz"))


def split(arrays, key):
    sizes = arrays[f"{key}_sizes"]
    return np.split(arrays[key], np.cumsum(sizes)[:-1])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, golden):
    doc, _ = golden
    built = build_inputs(str(tmp_path_factory.mktemp("lm5017")))
    for ext in (".bin", ".idx"):
        assert file_sha256(built["prefix"] + ext) == doc["input_sha256"][ext], \
            "repack-sft --for megatron-lm-5017 wrote another pair than #5017 read: regenerate the golden"
    store = SequenceStore(built["store"])
    convs = []   # (tokens, label-aligned loss mask) per store sequence
    for k in range(len(store.partitions)):
        part = store.part(k)
        convs += [(np.asarray(p.input_ids, np.int64), np.asarray(p.loss_mask, np.int64)) for p in
                  (part[i] for i in range(len(part)))] if part is not None else []
    built["conversations"] = convs
    return built


def bins_of(arrays):
    return [b.tolist() for b in np.split(arrays["bins_flat"], np.cumsum(arrays["bins_sizes"])[:-1])]


def test_the_golden_names_its_commit_and_files(golden):
    doc, _ = golden
    assert doc["megatron_lm_commit"] == COMMIT and doc["megatron_lm_ref"] == "refs/pull/5017/head"
    assert DATASET_SHA256 in doc["files_sha256"] and doc["seq_length"] == SEQ_LENGTH
    # its default template config, tokenized by its own tokenizer layer: ten delimiters
    delims = doc["delimiters"]
    assert sorted(delims["role_start"]) == ["assistant", "system", "user"] and len(delims["think"]) == 2


def test_the_pair_is_the_store_one_sequence_per_conversation(inputs):
    low = MMapIndexedDataset(inputs["prefix"])
    convs = inputs["conversations"]
    assert len(low) == len(convs) == inputs["written"]["conversations"] == 71
    for g, (tokens, _) in enumerate(convs):
        assert np.array_equal(np.asarray(low[g].input_ids, np.int64), tokens)
    assert np.array_equal(low.document_indices, np.arange(len(convs) + 1))


def test_same_conversations_except_the_overlong_it_drops(golden, inputs):
    doc, arrays = golden
    lengths = np.array([len(t) for t, _ in inputs["conversations"]])
    used = np.sort(arrays["document_index"])
    assert np.array_equal(used, np.flatnonzero(lengths <= SEQ_LENGTH))     # each kept once, in no pack twice
    dropped = np.flatnonzero(lengths > SEQ_LENGTH)
    assert len(dropped) == inputs["written"]["longer_than_seq_length"] == 4  # the count the writer reports


def test_its_packs_are_reproduced_by_our_packer(golden, inputs):
    _, arrays = golden
    lengths = np.array([len(t) for t, _ in inputs["conversations"]])
    kept = np.flatnonzero(lengths <= SEQ_LENGTH)
    ours = [[int(kept[i]) for i in b] for b in megatron_lm_bins(lengths[kept], SEQ_LENGTH)]
    assert ours == bins_of(arrays)   # bins, their order, the order inside each
    flat = np.concatenate([np.asarray(b) for b in ours])
    assert np.array_equal(flat, arrays["document_index"])
    assert np.array_equal(np.cumsum([0] + [len(b) for b in ours]), arrays["sample_index"])
    a = pack_lengths(lengths[kept], SEQ_LENGTH, "megatron_lm_mffd")   # the algorithm behind --packing-algorithm
    assert [sorted(kept[a.members(b)].tolist()) for b in range(a.n_bins)] == [sorted(b) for b in ours]


def test_our_shards_hold_its_packs(golden, inputs):
    """The shards ``repack-sft --packing-algorithm megatron_lm_mffd --overlong drop`` writes: each
    pack is one of #5017's, in its order (ours keeps store order inside a pack). A conversation is
    known by its tokens (the data repeats some: each is named by its first store index)."""
    _, arrays = golden
    key = {}
    for g, (t, _) in enumerate(inputs["conversations"]):
        key.setdefault(t.tobytes(), g)
    first = [key[t.tobytes()] for t, _ in inputs["conversations"]]
    packs = []
    for prefix in inputs["shards"]:
        shard = MMapIndexedDataset(prefix)
        for i in range(len(shard)):
            p = shard[i]
            ids = np.asarray(p.input_ids, np.int64)
            bounds = list(p.seq_start_id) + [len(ids)]
            packs.append(sorted(key[ids[a:b].tobytes()] for a, b in zip(bounds[:-1], bounds[1:])))
    assert packs == [sorted(first[g] for g in b) for b in bins_of(arrays)]


def test_tokens_equal_in_every_sample(golden, inputs):
    _, arrays = golden
    convs = inputs["conversations"]
    items = {k: split(arrays, f"item_{k}") for k in ("tokens", "labels", "cu_seqlens")}
    doc_index, sample_index, shuffle = arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]
    assert sorted(shuffle.tolist()) == list(range(len(sample_index) - 1))   # each pack once per epoch
    for i, p in enumerate(shuffle):
        members = doc_index[sample_index[p]:sample_index[p + 1]]
        expected = np.concatenate([convs[g][0] for g in members])
        assert np.array_equal(items["tokens"][i], expected[:-1]) and np.array_equal(items["labels"][i], expected[1:])
        assert np.array_equal(items["cu_seqlens"][i], np.cumsum([0] + [len(convs[g][0]) for g in members]))


def token_class(tokenizer, token_id) -> str:
    """A delimiter by its text, a run of newlines as such, anything else ``text``."""
    text = tokenizer.decode([int(token_id)])
    if token_id in tokenizer.all_special_ids or text.startswith("<"):
        return text
    return repr(text) if text.strip() == "" else "text"


def mask_differences(golden, inputs, tokenizer):
    """Every position ``j`` where #5017's loss mask, read label-aligned (its ``loss_mask[j]``
    trains ``labels[j] = tokens[j+1]``, as ours), differs from ours: counted by side, by the
    class of ``tokens[j]`` and of the label ``tokens[j+1]``, and whether ``j`` starts one of our
    trained runs (a reply's first label); and the trained labels of each side."""
    _, arrays = golden
    convs = inputs["conversations"]
    masks = split(arrays, "item_loss_mask")
    doc_index, sample_index, shuffle = arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]
    diffs, trained = Counter(), Counter()
    for i, p in enumerate(shuffle):
        theirs_all = np.append(masks[i].astype(np.int64), 0)   # nothing follows the sample's last token
        start = 0
        for g in doc_index[sample_index[p]:sample_index[p + 1]]:
            tokens, ours = convs[g]
            theirs = theirs_all[start:start + len(tokens)]
            start += len(tokens)
            assert theirs[-1] == 0, "it would train across conversations"   # the template ends in "\n"
            trained["ours"] += int(ours.sum())
            trained["theirs"] += int(theirs.sum())
            runs = np.flatnonzero(np.diff(np.concatenate([[0], ours])) == 1)   # our trained runs' starts
            trained["runs"] += len(runs)
            trained["runs whose first label it does not train"] += int(np.count_nonzero(theirs[runs] == 0))
            for j in np.flatnonzero(ours != theirs):
                side = "ours only" if ours[j] else "theirs only"
                where = "first label of a run" if ours[j] and j in runs else "inside"
                diffs[(side, where, token_class(tokenizer, tokens[j]), token_class(tokenizer, tokens[j + 1]))] += 1
    return diffs, trained


NL = repr("\n")
#: Every difference, measured on the golden's 67 packed conversations (40 chats, 14 tool-calling,
#: 13 with reasoning; docs/TRAINING.md's table): (side, where, token j, label j+1): positions.
EXPECTED_DIFFERENCES = {
    # its shift: the first token of a reply is never a trained label (the token before it is a delimiter)
    ("ours only", "first label of a run", NL, "text"): 63,
    # ... nor the first token of a reasoning trace, of the answer after it, of a tool call
    ("ours only", "inside", "<think>", NL): 13,
    ("ours only", "inside", "</think>", NL): 13,
    ("ours only", "inside", NL, "text"): 14,
    # delimiters it never trains: the <think> and <tool_call> tags opening a reply, the newline ending "<tool_call>\n"
    ("ours only", "first label of a run", NL, "<think>"): 13,
    ("ours only", "first label of a run", NL, "<tool_call>"): 14,
    ("ours only", "inside", "<tool_call>", NL): 14,
    # the empty "<think>\n\n</think>\n\n" the template inserts in a last turn without reasoning: it trains
    # it (3 labels a block, 54 blocks); ours masks it (--empty-reasoning-loss mask, the default)
    ("theirs only", "inside", NL, NL): 108,
    ("theirs only", "inside", NL, "</think>"): 54,
}
EXPECTED_TRAINED = {"ours": 5551, "theirs": 5569, "runs": 144, "runs whose first label it does not train": 90}


def test_masks_equal_up_to_its_shift_and_every_difference_named(golden, inputs):
    from transformers import AutoTokenizer   # (a heavy optional dependency: only this test decodes)

    tokenizer = AutoTokenizer.from_pretrained(inputs["tokenizer"])
    diffs, trained = mask_differences(golden, inputs, tokenizer)
    assert dict(diffs) == EXPECTED_DIFFERENCES
    assert dict(trained) == EXPECTED_TRAINED
    # nothing else: its labels minus ours plus theirs, position for position
    ours_only = sum(v for k, v in diffs.items() if k[0] == "ours only")
    assert trained["ours"] - ours_only + (sum(diffs.values()) - ours_only) == trained["theirs"]


@pytest.mark.parametrize("stem,mult", [("cp1", 1), ("cp2", 4), ("cp2tp2sp", 8)])
def test_its_batch_padding_joins_the_last_conversation(golden, inputs, stem, mult):
    """What its batch step (``preprocess_sft_batch``) hands the model, stated in docs/TRAINING.md:
    each conversation padded to ``2*cp`` when ``cp > 1`` (``2*cp*tp`` with SP), then the sample padded to the sequence
    length *inside its last conversation* (its ``cu_seqlens`` end at the sequence length, its
    positions run on through the padding); padding labels -100, loss 0."""
    _, arrays = golden
    convs = inputs["conversations"]
    doc_index, sample_index, shuffle = arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]
    got = {k: split(arrays, f"{stem}_{k}") for k in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens")}
    for i, p in enumerate(shuffle):
        lengths = [len(convs[g][0]) for g in doc_index[sample_index[p]:sample_index[p + 1]]]
        padded = [-(-n // mult) * mult for n in lengths]
        padded[-1] += SEQ_LENGTH - sum(padded)
        assert np.array_equal(got["position_ids"][i], np.concatenate([np.arange(n) for n in padded]))
        ends = np.cumsum([0] + lengths[:-1] + [SEQ_LENGTH - sum(lengths[:-1])])
        assert np.array_equal(got["cu_seqlens"][i], ends)   # the real lengths, the last one padded
        assert len(got["tokens"][i]) == SEQ_LENGTH
        pads = got["labels"][i] == -100
        assert not got["loss_mask"][i][pads].any() and pads.sum() >= SEQ_LENGTH - sum(lengths)


# ------------------------------------------------------------- its CP-padded batches against our adapter's

CELLS = {"cp2": (2, 1, False)} | {k: (cp, tp, sp) for k, cp, tp, sp in CP_TP_CELLS}


@pytest.fixture(scope="module")
def our_cp_samples(inputs, tmp_path_factory):
    """Per conversation (its first store index), its segment in what our Megatron-LM adapter
    (``SFTIndexedDataset``, built by megatron-core's builder) returns from our shards of the store
    padded for CP 2 (``repack-sft --cp 2``, stored layout, #5017's packer, pad id #5017's): the
    sequence with its stored CP padding, the pack's last one stretched to the sequence length."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_sft_idx.training import megatron as M

    out = repack(RepackConfig(inputs["store"], str(tmp_path_factory.mktemp("cp2") / "chat"), pack_size=SEQ_LENGTH,
                              overlong="drop", algorithm="megatron_lm_mffd", cp=2, pad_id=PAD_ID, progress=False))
    cfg = M.SFTIndexedDatasetConfig(random_seed=1, sequence_length=SEQ_LENGTH,
                                    blend=M.parse_data_path(out["outputs"][0]),
                                    split="100,0,0", path_to_cache=None, tokenizer=None, context_parallel_size=2,
                                    pad_token_id=PAD_ID)
    ds = BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [None, 0, 0], lambda: True, cfg).build()[0]
    first = {}
    for g, (t, _) in enumerate(inputs["conversations"]):
        first.setdefault(t.tobytes(), g)
    ours = {}
    for i in range(len(ds)):
        s = ds[i]
        cu = s["cu_seqlens"].numpy()
        bounds = cu[:int(np.flatnonzero(cu == SEQ_LENGTH)[0]) + 1]
        tokens = s["tokens"].numpy()
        for a, b in zip(bounds[:-1], bounds[1:]):
            g = next(first[k] for k in (tokens[a:a + n].tobytes() for n in range(b - a, 0, -1)) if k in first)
            ours[g] = {k: s[k].numpy()[a:b] for k in ("tokens", "labels", "loss_mask", "position_ids")}
    return ours


def cp_differences(golden, inputs, ours, stem, factor):
    """Its batch step's output at ``stem`` against our adapter's, conversation by conversation, over
    its CP-padded segment (``cu_seqlens_padded``; not the stretch to the sequence length): where
    each key differs (the conversation's tokens, its last position, the padding), and what its
    truncation of an overfull sample costs."""
    _, arrays = golden
    convs = inputs["conversations"]
    first = {}
    for g, (t, _) in enumerate(convs):
        first.setdefault(t.tobytes(), g)
    got = {k: split(arrays, f"{stem}_{k}") for k in ("tokens", "labels", "loss_mask", "position_ids",
                                                       "cu_seqlens_padded")}
    doc_index, sample_index, shuffle = arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]
    out = Counter()
    for i, p in enumerate(shuffle):
        members = doc_index[sample_index[p]:sample_index[p + 1]]
        lens = [len(convs[g][0]) for g in members]
        cup = got["cu_seqlens_padded"][i]
        if sum(-(-n // factor) * factor for n in lens) > SEQ_LENGTH:   # its sample overflows: it cuts the tail
            out["samples it truncates"] += 1
            start, n = int(cup[-2]), lens[len(cup) - 2] - (len(cup) - 1 == len(members))
            cut = n - max(0, min(n, SEQ_LENGTH - start)) + sum(lens[len(cup) - 1:])
            assert cut == sum(lens) - 1 - int(np.count_nonzero(got["labels"][i] != -100))   # its labels agree
            out["conversation tokens it cuts"] += cut
        for k, g in enumerate(members[:len(cup) - 1]):
            n, last = lens[k], k == len(members) - 1
            a, b = int(cup[k]), int(cup[k + 1])
            theirs_len, ours_len = -(-n // factor) * factor, int(padded_length([n], pad_multiple_for(cp=2))[0])
            out[("CP-padded length", "equal" if theirs_len == ours_len else "longer (its 2*CP*TP)")] += 1
            out["its padding beyond ours"] += theirs_len - ours_len
            mine = ours[first[convs[g][0].tobytes()]]
            m = min(theirs_len, ours_len, b - a)
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                for j in np.flatnonzero(got[key][i][a:a + m] != mine[key][:m]):
                    where = "conversation" if j < n - 1 else "its last position" if j == n - 1 else "padding"
                    out[(key, where + (" (a sample's last conversation)" if last else ""))] += 1
    return out


#: Per cell, every difference (measured on the golden; docs/TRAINING.md "Megatron-LM PR #5017").
#: Inside every conversation tokens and positions are equal, labels too but at its last position.
LAST = " (a sample's last conversation)"
_BOTH = {
    ("labels", "its last position"): 38,   # its label is the next conversation's first token, ours our CP pad
    ("labels", "padding"): 61,             # its padding labels are -100, ours the pad id (loss 0 on both sides)
    # the loss masks' named differences (EXPECTED_DIFFERENCES: 144 + 162 labels), at the same positions
    ("loss_mask", "conversation"): 197,
    ("loss_mask", "conversation" + LAST): 109,
}
EXPECTED_CP = {
    # a sample's last conversation: its tokens stop one short at the last position (t[:-1]: padding
    # there, ours the token; its label -100); it packs unpadded lengths and pads after, so a sample
    # can overflow the sequence length and lose its tail ("samples it truncates")
    "cp2": _BOTH | {("CP-padded length", "equal"): 67,
                    ("labels", "its last position" + LAST): 21, ("tokens", "its last position" + LAST): 21,
                    ("labels", "padding" + LAST): 31, "samples it truncates": 5, "conversation tokens it cuts": 6},
    # with SP it pads to 2*CP*TP = 8 where lcm(2*CP, CP*TP) = 4 suffices (ours; Bridge's rule too)
    "cp2tp2sp": _BOTH | {("CP-padded length", "equal"): 33, ("CP-padded length", "longer (its 2*CP*TP)"): 34,
                         "its padding beyond ours": 136,
                         ("labels", "its last position" + LAST): 16, ("tokens", "its last position" + LAST): 16,
                         ("labels", "padding" + LAST): 24, "samples it truncates": 10,
                         "conversation tokens it cuts": 38},
}


@pytest.mark.parametrize("stem", sorted(CELLS))
def test_its_cp_padded_batches_against_our_adapters(golden, inputs, our_cp_samples, stem):
    """Its ``preprocess_sft_batch`` at CP 2 (and with SP over TP 2) against what our adapter reads
    from shards padded for CP 2 (our multiple ``lcm(2*CP, CP*TP)`` is 4 in both cells): tokens
    and positions equal inside every conversation; the differences are counted and named."""
    cp, tp, sp = CELLS[stem]
    factor = 2 * cp * (tp if tp > 1 and sp else 1)
    diffs = cp_differences(golden, inputs, our_cp_samples, stem, factor)
    assert {k: v for k, v in diffs.items() if v} == EXPECTED_CP[stem]
    assert diffs[("loss_mask", "conversation")] + diffs[("loss_mask", "conversation" + LAST)] == \
        sum(EXPECTED_DIFFERENCES.values())
