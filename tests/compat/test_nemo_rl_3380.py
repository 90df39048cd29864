"""Our shards against NeMo-RL PR #3380's ``MegatronSFTPackedDataset``, element by element.

The reference is data: tests/golden/nemo_rl_3380/ holds what #3380's own code (its ``nemo_rl``
package at ``a944f7c8``, unmodified, no stub; its dataset loading, row checks and
``megatron_sft_packed_preprocessor`` under the ``identity`` prompt format) returned for the JSONL
``repack-sft --for nemo-rl-3380`` writes beside our shards, at context parallelism 1 and 2, and
for two rows longer than the pack. tests/compat/make_nemo_rl_3380_golden.py regenerates it.
Here the same inputs are built again (the JSONL's digest checked first, so a changed writer is
told apart from a changed #3380) and compared:

* its split and identity tokenization give back our packs, sequences and tokens: ``input_ids``,
  ``packed_cu_seqlens``, ``position_ids`` (and its shifted ``target_ids``) equal;
* ``NemoRLPackedDataset`` over the shards returns its datum, key for key, dtype and shape, the
  same tokens, positions and boundaries, and our masks; every label it trains that we do not
  is counted (the figures docs/TRAINING.md "NeMo-RL #3380" gives);
* what it cuts: rows over the limit (silently), and packs its CP padding pushes past it.
"""

import json
import os
from collections import Counter

import numpy as np
import pytest

from make_nemo_rl_3380_golden import GOLDEN, OVERFLOW_ROWS, PACK_SIZE, TENSOR_KEYS, build_inputs, file_sha256

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.reader import MMapIndexedDataset
from megatron_sft_idx.training.nemo_rl import IGNORE_INDEX, NemoRLPackedDataset

pytestmark = [pytest.mark.compat, pytest.mark.slow]

COMMIT = "a944f7c8d29fb5afde74de290b685896506a95ad"
PAD_ID = 0   # the stand-in tokenizer's <|endoftext|>, the golden's megatron_sft_pad_token


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(GOLDEN, "golden.json")) as f:
        doc = json.load(f)
    return doc, np.load(os.path.join(GOLDEN, "arrays.npz"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, golden):
    doc, _ = golden
    built = build_inputs(str(tmp_path_factory.mktemp("rl3380")))
    assert file_sha256(built["jsonl"]) == doc["input_sha256"], \
        "repack-sft --for nemo-rl-3380 wrote another JSONL than #3380 read: regenerate the golden"
    shard = MMapIndexedDataset(built["shard"])
    built["packs"] = [shard[i] for i in range(len(shard))]
    return built


def datums(golden, name):
    """#3380's recorded datums ``name`` (``cp1``, ``cp2``, ``overflow``): one dict per row."""
    doc, arrays = golden
    split = {k: np.split(arrays[f"{name}_{k}"], np.cumsum(arrays[f"{name}_{k}_sizes"])[:-1]) for k in TENSOR_KEYS}
    return [dict(values, **{k: split[k][i] for k in TENSOR_KEYS}) for i, values in enumerate(doc["values"][name])]


def expected(pack, cp=1, limit=PACK_SIZE):
    """#3380's rule, stated: each sequence padded to ``2*cp`` (cp > 1), the row to ``limit + 1``
    with the pad, the tail joining the last sequence; what passes ``limit`` is cut."""
    lengths = pack.seq_lengths.tolist()
    mult = 2 * cp if cp > 1 else 1
    tokens, positions, ends, mask = [], [], [], []
    for k, n in enumerate(lengths):
        a = int(pack.seq_boundaries[k])
        padded = -(-n // mult) * mult
        tokens += np.asarray(pack.input_ids[a:a + n]).tolist() + [PAD_ID] * (padded - n)
        mask += np.asarray(pack.loss_mask[a:a + n]).tolist() + [0] * (padded - n)
        positions += list(range(padded))
        ends.append(len(tokens))
    cut = len(tokens) > limit
    tail = limit + 1 - len(tokens)
    positions += list(range(positions[-1] + 1, positions[-1] + 1 + max(tail, 0)))
    tokens = tokens[:limit] + [PAD_ID] if cut else tokens + [PAD_ID] * tail
    mask = (mask + [0] * limit)[:limit]
    return {"input_ids": tokens[:-1], "all": tokens, "mask": mask, "position_ids": positions[:limit],
            "packed_cu_seqlens": [0] + [min(e, limit) for e in ends[:-1]] + [limit], "cut": cut}


def test_the_golden_names_its_commit_and_files(golden):
    doc, _ = golden
    assert doc["nemo_rl_commit"] == COMMIT and doc["nemo_rl_ref"] == "refs/pull/3380/head"
    assert "nemo_rl/data/megatron_sft_packed.py" in doc["files_sha256"] and doc["pack_size"] == PACK_SIZE
    assert doc["prompt_format"] == "identity" and doc["pad_token"] == "<|endoftext|>"


def test_the_jsonl_holds_every_pack_and_sequence_as_text_that_round_trips(inputs):
    w = inputs["written"]
    assert (w["rows"], w["sequences"], w["tokens"]) == (len(inputs["packs"]), 71, 14763) == (30, 71, 14763)
    # every sequence splits at its first trained token (none needed the whole-text fallback)
    assert (w["split_at_reply"], w["whole_in_assistant"]) == (71, 0)
    assert (w["max_seq_length"], w["pad_id"], w["pad_token"]) == (PACK_SIZE, PAD_ID, "<|endoftext|>")


def test_its_split_gives_back_our_sequences(golden, inputs):
    doc, _ = golden
    assert doc["sequences_per_row"] == [len(p.seq_start_id) for p in inputs["packs"]]


def test_its_tokens_positions_and_boundaries_are_ours(golden, inputs):
    theirs = datums(golden, "cp1")
    assert len(theirs) == len(inputs["packs"])
    for pack, got in zip(inputs["packs"], theirs):
        want = expected(pack)
        assert not want["cut"]
        for key in ("input_ids", "position_ids", "packed_cu_seqlens"):
            assert got[key].tolist() == want[key], key
        # its labels: the next token, -100 where a sequence starts (identity trains the rest)
        targets = np.asarray(want["all"][1:])
        targets[np.asarray(want["packed_cu_seqlens"][1:-1], np.int64) - 1] = IGNORE_INDEX
        assert got["target_ids"].tolist() == targets.tolist()


def test_at_cp2_it_pads_each_sequence_and_cuts_the_packs_that_outgrow(golden, inputs):
    theirs = datums(golden, "cp2")
    cut = []
    for i, (pack, got) in enumerate(zip(inputs["packs"], theirs)):
        want = expected(pack, cp=2)
        for key in ("input_ids", "position_ids", "packed_cu_seqlens"):
            assert got[key].tolist() == want[key], (i, key)
        if want["cut"]:
            cut.append(i)
    # 6 of 30 packs (full at 512 unpadded) pass 512 once each sequence is padded to 4: it cuts
    # the last sequence's tail, silently; our dataset refuses them (repack with --cp 2)
    assert cut == [16, 19, 21, 24, 26, 27]
    ds = NemoRLPackedDataset(inputs["shard"], context_parallel_size=2)
    for i in range(len(ds)):
        if i in cut:
            with pytest.raises(ShardError, match="#3380 would cut it"):
                ds[i]
        else:
            ds[i]


def test_rows_over_the_limit_are_cut_and_dropped_silently(golden, inputs):
    """A conversation crossing the limit keeps its first tokens, those after it vanish; a row
    full before them loses them all. No error, no count."""
    packs = inputs["packs"]
    (a, b), (c, d) = OVERFLOW_ROWS
    first, full = datums(golden, "overflow")
    crossing = PACK_SIZE - packs[a].packed_len
    assert (packs[a].packed_len, packs[b].seq_lengths[0], len(packs[b].seq_start_id)) == (482, 56, 5)
    assert first["packed_cu_seqlens"].tolist() == [0, 482, 512]
    assert first["input_ids"].tolist() == (np.asarray(packs[a].input_ids).tolist()
                                           + np.asarray(packs[b].input_ids[:crossing]).tolist())
    assert packs[c].packed_len == PACK_SIZE and full["packed_cu_seqlens"].tolist() == [0, 512]
    assert full["input_ids"].tolist() == np.asarray(packs[c].input_ids).tolist()


def test_its_identity_default_pad_token_is_no_token_here(golden):
    doc, _ = golden
    # "<unk>" -> convert_tokens_to_ids -> None -> int(None): megatron_sft_pad_token must be set
    assert doc["default_pad_token"].startswith("TypeError: int() argument must be")


@pytest.mark.parametrize("cp", [1, 2])
def test_our_dataset_is_its_datum_key_for_key_with_our_masks(golden, inputs, cp):
    doc, _ = golden
    theirs = datums(golden, f"cp{cp}")
    ds = NemoRLPackedDataset(inputs["shard"], context_parallel_size=cp)
    compared = 0
    for i, (pack, got) in enumerate(zip(inputs["packs"], theirs)):
        if expected(pack, cp=cp)["cut"]:
            continue
        ours = ds[i]
        assert sorted(ours) == doc["keys"]
        for key in TENSOR_KEYS:
            assert str(ours[key].dtype).replace("torch.", "") == doc["dtypes"][key], key
            assert tuple(ours[key].shape) == got[key].shape, key
        for key, value in doc["values"][f"cp{cp}"][i].items():
            assert ours[key] == value, key
        for key in ("input_ids", "position_ids", "packed_cu_seqlens"):
            assert np.array_equal(ours[key].numpy(), got[key]), key
        mask = ours["token_mask"].numpy()
        assert mask.tolist() == expected(pack, cp=cp)["mask"]   # ours, in its layout; 0 on padding
        kept = ours["target_ids"].numpy() != IGNORE_INDEX
        assert np.array_equal(ours["target_ids"].numpy()[kept], got["target_ids"][kept])
        assert not (mask.astype(bool) & ~kept).any()   # every trained label is the next token
        compared += 1
    assert compared == (30 if cp == 1 else 24)
    # and its collate (rl_collate_fn) took every one of those rows when the golden was made
    assert doc["collated_rows_of_ours"][str(cp)] == compared


def turn_of(tokenizer, ids, p):
    """``(turn, part)`` of token ``p``: the role after the last ``<|im_start|>`` at or before it
    (``tool`` for a user turn opening with ``<tool_response>``), ``header`` up to that line's end."""
    start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    s = max(i for i in range(p + 1) if ids[i] == start_id)
    e = next((i for i in range(s + 1, len(ids)) if "\n" in tokenizer.decode([ids[i]])), len(ids))
    role = tokenizer.decode(ids[s + 1:e]).strip()
    if role == "user" and e + 1 < len(ids) and ids[e + 1] == tokenizer.convert_tokens_to_ids("<tool_response>"):
        role = "tool"
    return role, "header" if p <= e else "body"


def label_differences(golden, inputs, tokenizer):
    """At CP 1, each label (``target_ids[j]``, token ``j + 1``) one side trains and the other
    does not, by side and by the turn the token is in; and the trained labels of each side."""
    theirs = datums(golden, "cp1")
    diffs, trained = Counter(), Counter()
    for pack, got in zip(inputs["packs"], theirs):
        n = pack.packed_len
        ids = np.asarray(pack.input_ids).tolist()
        ours = np.zeros(PACK_SIZE, bool)
        ours[:n] = np.asarray(pack.loss_mask, bool)
        it = got["token_mask"].astype(bool)
        trained["ours"] += int(ours.sum())
        trained["theirs"] += int(it.sum())
        trained["ours on a pad-id label"] += int(np.count_nonzero(ours & (got["target_ids"] == PAD_ID)))
        for j in np.flatnonzero(ours != it):
            diffs[("ours only" if ours[j] else "theirs only",) + turn_of(tokenizer, ids, j + 1)] += 1
    return diffs, trained


#: Every label trained by one side only, measured on the golden's 30 packs (71 sequences: 40
#: chats, 14 tool-calling, 13 with reasoning, 4 truncated; docs/TRAINING.md's table): identity
#: trains every label but the 71 sequence starts, ours the template's assistant content.
EXPECTED_DIFFERENCES = {
    ("theirs only", "system", "header"): 282, ("theirs only", "system", "body"): 3447,
    ("theirs only", "user", "header"): 628, ("theirs only", "user", "body"): 1771,
    ("theirs only", "tool", "header"): 56, ("theirs only", "tool", "body"): 182,
    # "<|im_start|>assistant\n" before each reply
    ("theirs only", "assistant", "header"): 870,
    # the empty "<think>\n\n</think>\n\n" (--empty-reasoning-loss mask) and the "\n" after "<|im_end|>"
    ("theirs only", "assistant", "body"): 503,
    # a conversation truncated inside "<|im_start|>assistant": its role cut to "a"
    ("theirs only", "a", "header"): 2,
}
EXPECTED_TRAINED = {"ours": 6951, "theirs": 14692, "ours on a pad-id label": 0}


def test_every_label_it_trains_that_we_mask_is_counted(golden, inputs):
    from transformers import AutoTokenizer   # (a heavy optional dependency: only this test decodes)

    tokenizer = AutoTokenizer.from_pretrained(inputs["tokenizer"])
    diffs, trained = label_differences(golden, inputs, tokenizer)
    assert dict(diffs) == EXPECTED_DIFFERENCES
    assert dict(trained) == EXPECTED_TRAINED
    assert trained["theirs"] - sum(v for k, v in diffs.items() if k[0] == "theirs only") == trained["ours"]
