"""``repack-sft --for nemo-rl-3380`` and ``NemoRLPackedDataset``: our packs for NeMo-RL PR #3380.

What #3380's own code makes of them is tests/compat/test_nemo_rl_3380.py's (against its golden).
Here: every row is a pack and every sequence's text re-encodes to its stored ids; the fallback
and the refusals (a text that does not round-trip, CP-padded shards, the CLI's usage errors);
the dataset's datum on the same shard.
"""

import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, normalizers

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess import RepackConfig, repack
from megatron_sft_idx.preprocess.repack_cli import repack_main
from megatron_sft_idx.preprocess.nemo_rl import ROUND_TRIP, sequence_messages, write_nemo_rl_jsonl
from megatron_sft_idx.reader import MMapIndexedDataset
from megatron_sft_idx.training.nemo_rl import IGNORE_INDEX, NemoRLPackedDataset

PACK = 256


@pytest.fixture(scope="module")
def store(qwen3_store):
    return qwen3_store


@pytest.fixture(scope="module")
def shard(store, tmp_path_factory):
    out = repack(RepackConfig(store, str(tmp_path_factory.mktemp("s") / "chat"), pack_size=PACK, progress=False))
    return out["outputs"][0]


def test_cli_writes_one_row_per_pack_whose_text_gives_back_the_ids(store, families, tmp_path, capsys):
    argv = ["--store", store, "--for", "nemo-rl-3380", "--output-prefix", str(tmp_path / "rl" / "chat"),
            "--pack-size", str(PACK), "--tokenizer", families["qwen3"]]
    assert repack_main(argv + ["--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    [out] = summary["nemo-rl-3380"]
    [prefix] = summary["outputs"]
    shard = MMapIndexedDataset(prefix)
    tok = Tokenizer.from_file(os.path.join(families["qwen3"], "tokenizer.json"))
    with open(out["path"], encoding="utf-8") as f:
        rows = [json.loads(line)["messages"] for line in f]
    assert len(rows) == len(shard) == out["rows"] and out["pad_token"] == "<|endoftext|>"
    for i, messages in enumerate(rows):
        pack = shard[i]
        b = pack.seq_boundaries
        assert [m["role"] for m in messages] == ["system", "assistant"] * (len(b) - 1)   # #3380 splits at system
        for k in range(len(b) - 1):
            text = messages[2 * k]["content"] + messages[2 * k + 1]["content"]
            assert tok.encode(text, add_special_tokens=False).ids == pack.input_ids[b[k]:b[k + 1]].tolist()
    assert out["sequences"] == sum(len(shard[i].seq_start_id) for i in range(len(shard)))
    assert repack_main(argv + ["--overwrite"]) == 0
    assert "megatron_sft_pad_token '<|endoftext|>'" in capsys.readouterr().out


@pytest.mark.parametrize("extra, words", [(["--cp", "2"], "NeMo-RL pads each itself"),
                                          (["--pad-seq-to-mult", "8"], "drop --cp"),
                                          (["--plan-only", "PLAN"], "not --plan-only")])
def test_cli_refuses_padding_and_plans(store, tmp_path, capsys, extra, words):
    argv = ["--store", store, "--for", "nemo-rl-3380", "--output-prefix", str(tmp_path / "c")]
    assert repack_main(argv + extra) == 2
    assert words in capsys.readouterr().err and not os.listdir(tmp_path)


def test_a_text_that_does_not_round_trip_is_refused_naming_the_pack(shard, families, tmp_path):
    """Fault injection: a tokenizer that lowercases before encoding cannot give back the ids."""
    tok = Tokenizer.from_file(os.path.join(families["qwen3"], "tokenizer.json"))
    tok.normalizer = normalizers.Lowercase()
    tok.save(str(tmp_path / "tokenizer.json"))
    out = str(tmp_path / "rows.jsonl")
    with pytest.raises(ShardError, match="does not survive decoding") as e:
        write_nemo_rl_jsonl(shard, str(tmp_path / "tokenizer.json"), out)
    assert e.value.pack == 0 and e.value.rule == ROUND_TRIP and not os.path.exists(out)


def test_a_split_inside_a_character_falls_back_to_the_whole_text(families):
    tok = Tokenizer.from_file(os.path.join(families["qwen3"], "tokenizer.json"))
    ids = tok.encode("ab \U0001d11e cd", add_special_tokens=False).ids
    text = [tok.decode([i]) for i in ids]
    j = next(j for j, t in enumerate(text) if "\ufffd" in t)   # a byte of the 4-byte character
    mask = np.zeros(len(ids), np.uint8)
    mask[j:] = 1   # the first trained token is the character's second byte
    assert sequence_messages(tok, ids, mask) == ("", "ab \U0001d11e cd")
    mask[:] = 0
    assert sequence_messages(tok, ids, mask) == ("ab \U0001d11e cd", "")   # nothing trained: all prompt


def test_cp_padded_shards_are_refused(store, families, tmp_path):
    [prefix] = repack(RepackConfig(store, str(tmp_path / "cp"), pack_size=PACK, cp=2, progress=False))["outputs"]
    with pytest.raises(ShardError, match="pads them itself") as e:
        write_nemo_rl_jsonl(prefix, families["qwen3"])
    assert e.value.field == "pad_seq_to_mult"


def test_the_dataset_datum_holds_the_pack_and_its_mask(shard):
    src = MMapIndexedDataset(shard)
    ds = NemoRLPackedDataset(shard, max_seq_length=PACK + 8)
    for i in range(len(src)):
        pack, d = src[i], ds[i]
        n, b = pack.packed_len, pack.seq_boundaries
        ids = d["input_ids"].numpy()
        assert len(ids) == d["length"] == PACK + 8 and (ids[n:] == 0).all() and (ids[:n] == pack.input_ids).all()
        assert d["token_mask"].numpy().tolist() == pack.loss_mask.tolist() + [0.0] * (PACK + 8 - n)
        assert d["packed_cu_seqlens"].tolist() == b[:-1].tolist() + [PACK + 8]
        assert d["position_ids"][:n].tolist() == np.concatenate([np.arange(x) for x in np.diff(b)]).tolist()
        targets = d["target_ids"].numpy()
        trained = d["token_mask"].numpy() > 0
        assert not trained[-1] and (targets[:-1][trained[:-1]] == ids[1:][trained[:-1]]).all()
        assert (targets[b[1:-1] - 1] == IGNORE_INDEX).all() and (targets[n - 1:] == 0).all()
    assert ds.task_data_processors["megatron_sft_packed"][1](0)["idx"] == 0
    with pytest.raises(ShardError, match="another context_parallel_size"):
        ds.datum(0, context_parallel_size=2)
    with pytest.raises(ShardError, match="below the packs' size"):
        NemoRLPackedDataset(shard, max_seq_length=PACK - 1)
