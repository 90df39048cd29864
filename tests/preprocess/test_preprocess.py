"""The preprocessing pipeline on small real files: formats, bad input, overlong, padding, splits, shards."""

import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megatron_sft_idx.errors import ShardError, ShardExistsError
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.preprocess.plan import plan_shards, split_conversations
from megatron_sft_idx.reader import MMapIndexedDataset

from support.faults import run_leftovers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
EOT = "<|im_end|>"


def chat(i, turns=1, system=True):
    messages = [{"role": "system", "content": f"System prompt {i}."}] if system else []
    for t in range(turns):
        messages += [{"role": "user", "content": f"Question {i}.{t} about packing?"},
                     {"role": "assistant", "content": f"Answer {i}.{t}: packing saves padding."}]
    return {"messages": messages}


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


def write_zst(path, records):
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(data))
    return str(path)


def cfg(tmp_path, inputs, **kw):
    kw.setdefault("tokenizer", TOKENIZER)
    kw.setdefault("pack_size", 256)
    return Config(inputs=[str(p) for p in inputs], output_prefix=str(tmp_path / "out" / "ds"), progress=False, **kw)


def sequences(prefixes):
    """(ids, mask) of every sequence in the shards, in shard/pack order."""
    out = []
    for prefix in prefixes:
        ds = MMapIndexedDataset(prefix)
        for i in range(len(ds)):
            p = ds[i]
            b = p.seq_boundaries
            out += [(np.asarray(p.input_ids[b[k]:b[k + 1]]), np.asarray(p.loss_mask[b[k]:b[k + 1]]))
                    for k in range(len(b) - 1)]
    return out


def decode_text(tok, ids):
    from megatron_sft_idx.preprocess.records.chat import ChatTokenizer

    return ChatTokenizer(str(tok)).decode(ids)


def decode_runs(ids, mask):
    from megatron_sft_idx.preprocess.records.chat import ChatTokenizer

    tok = decode_runs.tok = getattr(decode_runs, "tok", None) or ChatTokenizer(TOKENIZER)
    t = np.flatnonzero(mask) + 1
    return [tok.decode(ids[r]) for r in np.split(t, np.flatnonzero(np.diff(t) != 1) + 1)] if t.size else []


# ---------------------------------------------------------------- input formats

def test_chat_sharegpt_gz_and_zst_inputs(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl.gz", [chat(i, 2) for i in range(10, 15)], opener=gzip.open)
    sg = [{"conversations": [{"from": "human", "value": f"Q{i}?"}, {"from": "gpt", "value": f"A{i}."}]}
          for i in range(5)]
    c = write_zst(tmp_path / "c.jsonl.zst", sg)
    s = run(cfg(tmp_path, [a, b, c], verify_masks=20))
    assert s["conversations"] == 20 and s["records_read"] == 20 and s["verify_masks"]["checked"] == 20
    seqs = sequences(s["outputs"])
    assert len(seqs) == 20
    texts = sorted(run_ for ids, mask in seqs for run_ in decode_runs(ids, mask))
    assert f"A3.{EOT}" in texts and f"Answer 12.1: packing saves padding.{EOT}" in texts
    ds = MMapIndexedDataset(s["outputs"][0])
    names = [i["name"] for i in ds.metadata.source["inputs"]]
    assert names == [a, b, c] and all(len(i["sha256"]) == 64 for i in ds.metadata.source["inputs"])
    assert ds.metadata.tokenizer["vocab_size"] == 1024 and ds.metadata.extra["loss_on"] == "assistant"


def test_pretokenized_jsonl_and_parquet(tmp_path):
    rows = [{"input_ids": [1, 5 + i, 6, 7, 2], "answer_start_idx": 3} for i in range(6)]
    j = write_jsonl(tmp_path / "t.jsonl", rows)
    pq.write_table(pa.Table.from_pylist([{"input_ids": [1, 9, 9, 2], "loss_mask": [0, 0, 1, 1]}] * 4),
                   tmp_path / "t.parquet")
    s = run(cfg(tmp_path, [j, tmp_path / "t.parquet"], tokenizer=None, vocab_size=50, pad_id=0,
                input_format="tokens", verify_masks=10))
    assert s["conversations"] == 10
    seqs = {tuple(ids.tolist()): mask.tolist() for ids, mask in sequences(s["outputs"])}
    assert seqs[(1, 5, 6, 7, 2)] == [0, 0, 1, 1, 0]
    assert seqs[(1, 9, 9, 2)] == [0, 1, 1, 0]


def test_prompt_completion_with_custom_keys(tmp_path):
    p = write_jsonl(tmp_path / "pc.jsonl", [{"q": f"Question {i}?", "a": f" Answer {i}."} for i in range(4)])
    s = run(cfg(tmp_path, [p], input_format="prompt", prompt_key="q", completion_key="a", verify_masks=4))
    runs = sorted(r for ids, mask in sequences(s["outputs"]) for r in decode_runs(ids, mask))
    assert runs == [f" Answer {i}.{EOT}" for i in range(4)]


def test_directory_and_glob_inputs_are_expanded_sorted(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "b.jsonl", [chat(1)])
    write_jsonl(d / "a.jsonl", [chat(0)])
    (d / "notes.txt").write_text("{not input")  # not a kind the run reads: left (and named in a warning)
    s = run(cfg(tmp_path, [d, str(d / "*.jsonl")]))
    ds = MMapIndexedDataset(s["outputs"][0])
    assert [i["name"] for i in ds.metadata.source["inputs"]] == [str(d / "a.jsonl"), str(d / "b.jsonl")]
    with pytest.raises(InputError, match="no input files match"):
        run(cfg(tmp_path, [tmp_path / "missing*.jsonl"]))


# ---------------------------------------------------------------- bad input

BAD = [
    ('{"messages": [', "malformed JSON", "malformed_json"),
    ({"text": "no known key"}, "none of the keys", "missing_key"),
    ({"messages": []}, "empty conversation", "empty_conversation"),
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "template rejected", "template_error"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "all zero", "no_trainable_tokens"),
    ({"messages": [{"role": "user"}]}, "needs string 'role' and 'content'", "missing_key"),
]


@pytest.mark.parametrize("bad,message,reason", BAD)
def test_bad_record_names_file_and_line(tmp_path, bad, message, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [chat(0), chat(1), bad, chat(3)])
    with pytest.raises(InputError, match=f"^{path}:3: .*{message}"):
        run(cfg(tmp_path, [path]))
    assert not os.path.exists(tmp_path / "out" / "ds.idx")


def test_skip_bad_counts_every_reason(tmp_path):
    records = [chat(0)] + [b for b, _, _ in BAD] + [chat(1), ""]  # blank lines are not records
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    s = run(cfg(tmp_path, [path], skip_bad=True))
    assert s["conversations"] == 2 and s["records_read"] == 2 + len(BAD)
    assert s["skipped"] == {"empty_conversation": 1, "malformed_json": 1, "missing_key": 2,
                            "no_trainable_tokens": 1, "template_error": 1}
    assert s["skipped_examples"]["malformed_json"].startswith(f"{path}:2:")


def test_token_out_of_vocab_names_line(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 2, 3], "answer_start_idx": 1},
                                              {"input_ids": [1, 2000, 3], "answer_start_idx": 1}])
    with pytest.raises(InputError, match=f"{path}:2: token id 2000"):
        run(cfg(tmp_path, [path]))
    s = run(cfg(tmp_path, [path], skip_bad=True))
    assert s["skipped"] == {"token_out_of_vocab": 1}


# ---------------------------------------------------------------- overlong, padding

def long_chat(n_words):
    return {"messages": [{"role": "user", "content": "Tell me."},
                         {"role": "assistant", "content": " ".join(["packing"] * n_words)}]}


def test_overlong_modes(tmp_path):
    path = write_jsonl(tmp_path / "l.jsonl", [chat(0), long_chat(400), chat(1)])
    with pytest.raises(InputError, match=f"{path}:2: sequence of .* exceeds --pack-size 128"):
        run(cfg(tmp_path, [path], pack_size=128, overlong="error"))
    s = run(cfg(tmp_path, [path], pack_size=128, overlong="drop"))
    assert s["conversations"] == 2 and s["skipped"] == {"overlong_dropped": 1} and s["truncated"] == 0
    s = run(cfg(tmp_path, [path], pack_size=128, overlong="truncate", overwrite=True))
    assert s["conversations"] == 3 and s["truncated"] == 1
    lens = sorted(ids.size for ids, _ in sequences(s["outputs"]))
    assert lens[-1] == 128
    for ids, mask in sequences(s["outputs"]):
        assert mask[-1] == 0 and mask.any()


@pytest.mark.parametrize("kw,mult", [({"pad_seq_to_mult": 8}, 8), ({"cp": 2, "tp": 4, "sp": True}, 8),
                                     ({"cp": 4}, 8), ({"cp": 3, "tp": 2, "sp": True, "pad_seq_to_mult": 4}, 12)])
def test_pad_multiple_pads_every_sequence_with_loss_zero(tmp_path, kw, mult):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(i, 1 + i % 3) for i in range(20)])
    unpadded = run(cfg(tmp_path, [path]))
    base = {tuple(decode_runs(ids, m)) for ids, m in sequences(unpadded["outputs"])}
    s = run(cfg(tmp_path, [path], pad_id=3, overwrite=True, **kw))
    assert s["pad_seq_to_mult"] == mult
    ds = MMapIndexedDataset(s["outputs"][0])
    assert ds.metadata.pad_seq_to_mult == mult and ds.metadata.parallelism["cp"] == kw.get("cp", 1)
    plain = {tuple(ids.tolist()): mask for ids, mask in sequences(unpadded["outputs"])}
    for ids, mask in sequences(s["outputs"]):
        assert ids.size % mult == 0
        real = next(k for k in plain if ids[:len(k)].tolist() == list(k))
        assert (ids[len(real):] == 3).all() and not mask[len(real):].any()
        assert np.array_equal(mask[:len(real)], plain[real])
    assert {tuple(decode_runs(ids, m)) for ids, m in sequences(s["outputs"])} == base
    assert s["padding_tokens"] > 0


# ---------------------------------------------------------------- splits, shards, overwrite

def test_split_is_seeded_disjoint_and_complete(tmp_path):
    parts = split_conversations(1000, [98, 1, 1], seed=5)
    assert [p.size for p in parts] == [980, 10, 10]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1000))
    again = split_conversations(1000, [98, 1, 1], seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert not np.array_equal(split_conversations(1000, [98, 1, 1], seed=6)[1], parts[1])

    path = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(50)])
    s = run(cfg(tmp_path, [path], split=[80, 10, 10]))
    assert {k: v["conversations"] for k, v in s["splits"].items()} == {"train": 40, "valid": 5, "test": 5}
    assert s["outputs"] == [str(tmp_path / "out" / f"ds_{n}") for n in ("train", "valid", "test")]
    seen = [tuple(ids.tolist()) for p in s["outputs"] for ids, _ in sequences([p])]
    assert len(seen) == len(set(seen)) == 50
    assert MMapIndexedDataset(s["outputs"][1]).metadata.extra["split"] == "valid"
    tiny = run(Config(inputs=[path], output_prefix=str(tmp_path / "tiny" / "ds"), tokenizer=TOKENIZER,
                      pack_size=256, split=[98, 1, 1], progress=False))
    assert tiny["empty_splits"] == ["test"] and list(tiny["splits"]) == ["train", "valid"]  # 49 + 1 + 0


def test_plan_shards_limits():
    loads = np.full(10, 100)
    counts = np.ones(10, dtype=np.int64)
    assert plan_shards(loads, counts, 2, None, None).tolist() == [0, 10]
    assert plan_shards(loads, counts, 2, 4, None).tolist() == [0, 4, 8, 10]
    # 324 bytes per pack: 700 bytes hold two packs
    assert plan_shards(loads, counts, 2, None, 700).tolist() == [0, 2, 4, 6, 8, 10]
    assert plan_shards(loads, counts, 2, None, 10).tolist() == list(range(11))  # at least one pack each


def test_max_packs_per_shard_and_bytes_split_output(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(i, 3) for i in range(40)])
    whole = run(cfg(tmp_path, [path]))
    s = run(cfg(tmp_path, [path], max_packs_per_shard=3, overwrite=True))
    n_packs = whole["packs"]
    assert s["outputs"] == [str(tmp_path / "out" / f"ds_{i:06d}") for i in range(-(-n_packs // 3))]
    assert [len(MMapIndexedDataset(p)) for p in s["outputs"]][:-1] == [3] * (len(s["outputs"]) - 1)
    assert sequences(s["outputs"]) and len(sequences(s["outputs"])) == 40
    # --overwrite removed the unnumbered shard of the first run
    assert not os.path.exists(tmp_path / "out" / "ds.idx")
    b = run(cfg(tmp_path, [path], max_shard_bytes=2000, overwrite=True))
    sizes = [sum(os.path.getsize(p + s) for s in (".bin", ".loss.bin", ".seq.bin")) for p in b["outputs"]]
    assert len(b["outputs"]) > 1 and max(sizes) <= 2000


def test_existing_output_is_not_overwritten(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(0)])
    run(cfg(tmp_path, [path]))
    before = open(tmp_path / "out" / "ds.bin", "rb").read()
    with pytest.raises(ShardExistsError, match="--overwrite"):
        run(cfg(tmp_path, [path], loss_on="all"))
    assert open(tmp_path / "out" / "ds.bin", "rb").read() == before
    s = run(cfg(tmp_path, [path], loss_on="all", overwrite=True))
    assert MMapIndexedDataset(s["outputs"][0]).metadata.extra["loss_on"] == "all"
    assert run_leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("algorithm", ["first_fit_shuffle", "best_fit_decreasing", "modified_first_fit_decreasing"])
def test_every_algorithm_end_to_end(tmp_path, algorithm):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(i, 1 + i % 4) for i in range(30)])
    s = run(cfg(tmp_path, [path], algorithm=algorithm, verify_masks=30))
    assert s["sequences"] == 30 and s["verify_masks"]["checked"] == 30
    assert MMapIndexedDataset(s["outputs"][0]).metadata.packing["algorithm"] == algorithm


def test_pad_id_outside_vocab_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(0)])
    with pytest.raises(ShardError, match="no usable pad id"):
        run(cfg(tmp_path, [path], pad_id=5000))


def test_a_run_encodes_with_the_tokenizer_files_as_they_are_now(tmp_path):
    """Two runs of one process with the same settings and tokenizer path: the second encodes with
    the files as they are when it runs (its chat template edited in between), never with an
    encoder the first run left behind."""
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(TOKENIZER, tok)
    data = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(4)])
    first = run(Config(inputs=[data], output_prefix=str(tmp_path / "a" / "ds"), tokenizer=str(tok), pack_size=256,
                       progress=False))
    config = json.load(open(tok / "tokenizer_config.json"))
    config["chat_template"] = config["chat_template"].replace("<|im_start|>assistant\\n", "<|im_start|>assistant\\nOK ")
    assert "OK " in config["chat_template"]
    with open(tok / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    second = run(Config(inputs=[data], output_prefix=str(tmp_path / "b" / "ds"), tokenizer=str(tok), pack_size=256,
                        progress=False))
    texts = [[decode_text(tok, ids) for ids, _ in sequences(r["outputs"])] for r in (first, second)]
    assert len(texts[1]) == 4 and all("assistant\nOK Answer" in t for t in texts[1])
    assert not any("OK Answer" in t for t in texts[0])
