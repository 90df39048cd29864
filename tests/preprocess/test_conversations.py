"""``repack-sft --for megatron-lm-5017``: a store's conversations as one upstream bin/idx pair.

What Megatron-LM #5017's ``SFTDataset`` makes of it is tests/compat/test_megatron_lm_5017.py's.
Here: the pair holds the store's sequences in store order, one document each, in the exact
upstream layout; the store is verified first; an existing output is refused; the CLI.
"""

import json
import os

import numpy as np
import pytest

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.format import IDX_HEADER_SIZE, IdxHeader
from megatron_sft_idx.preprocess.repack_cli import repack_main
from megatron_sft_idx.preprocess.conversations import write_conversations
from megatron_sft_idx.preprocess.store import SequenceStore
from megatron_sft_idx.reader import MMapIndexedDataset


@pytest.fixture(scope="module")
def store(qwen3_store):
    return qwen3_store


def store_sequences(directory):
    s = SequenceStore(directory)
    assert len(s.partitions) > 1   # the pair joins several partitions
    return [np.asarray(p.input_ids) for k in range(len(s.partitions)) for p in
            (s.part(k)[i] for i in range(len(s.part(k))))]


def test_the_pair_is_the_store_in_order_one_document_each(store, tmp_path):
    prefix = str(tmp_path / "lm" / "chat")
    out = write_conversations(store, prefix, seq_length=100)
    expected = store_sequences(store)
    pair = MMapIndexedDataset(prefix)   # the upstream pair alone: no SFT extension files
    assert not os.path.exists(prefix + ".seq.idx") and len(pair) == len(expected) == out["conversations"]
    for g, tokens in enumerate(expected):
        assert np.array_equal(pair[g].input_ids, tokens)
    assert np.array_equal(pair.document_indices, np.arange(len(expected) + 1))
    raw = open(prefix + ".idx", "rb").read()
    header = IdxHeader.parse(raw[:IDX_HEADER_SIZE], prefix + ".idx", len(raw))
    assert (header.sequence_count, header.document_count, header.file_size) == (len(expected), len(expected) + 1,
                                                                                 len(raw))
    assert header.dtype.name == out["dtype"] == "uint16"
    assert os.path.getsize(prefix + ".bin") == 2 * out["tokens"] == 2 * sum(len(t) for t in expected)
    assert out["longer_than_seq_length"] == sum(len(t) > 100 for t in expected) > 0
    assert out["store_id"] == SequenceStore(store).store_id


def test_an_existing_output_is_refused_and_replaced_with_overwrite(store, tmp_path):
    prefix = str(tmp_path / "chat")
    write_conversations(store, prefix)
    with pytest.raises(ShardError, match="the output exists"):
        write_conversations(store, prefix)
    assert write_conversations(store, prefix, overwrite=True)["conversations"] == len(store_sequences(store))


def test_a_store_that_no_longer_verifies_is_refused(store, tmp_path):
    import shutil

    copy = str(tmp_path / "store")
    shutil.copytree(store, copy)
    path = os.path.join(copy, "parts", "part_000000.bin")
    data = bytearray(open(path, "rb").read())
    data[10] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(ShardError):
        write_conversations(copy, str(tmp_path / "out"))
    assert not os.path.exists(str(tmp_path / "out.bin"))


def test_cli(store, tmp_path, capsys):
    prefix = str(tmp_path / "cli" / "chat")
    argv = ["--store", store, "--for", "megatron-lm-5017", "--output-prefix", prefix, "--pack-size", "100"]
    assert repack_main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["paths"] == [prefix + ".bin", prefix + ".idx"] and out["seq_length"] == 100
    assert repack_main(argv) == 1 and "the output exists" in capsys.readouterr().err
    assert repack_main(argv + ["--overwrite"]) == 0
    assert "longer than --pack-size 100, which SFTDataset drops" in capsys.readouterr().out
    assert repack_main(argv + ["--plan-only", str(tmp_path / "plan")]) == 2
    assert "not --mix or --plan-only" in capsys.readouterr().err
    assert repack_main(argv[:4] + ["--output-prefix", "s3://b/chat"]) == 2
    assert "--output-prefix s3://b/chat" in capsys.readouterr().err and not os.path.exists("s3:")
