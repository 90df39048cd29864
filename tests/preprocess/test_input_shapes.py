"""The input shapes end to end: Alpaca, prompt/completion (chat and raw), through the pipeline."""

import json
import os

import numpy as np
import pytest

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess.cli import main
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.reader import MMapIndexedDataset
from support.sft_fixtures import alpaca, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
EOT = "<|im_end|>"


def cfg(tmp_path, inputs, name="ds", **kw):
    kw.setdefault("tokenizer", TOKENIZER)
    return Config(inputs=[str(p) for p in inputs], output_prefix=str(tmp_path / "out" / name), pack_size=1024,
                  progress=False, **kw)


def sequences(prefix):
    ds = MMapIndexedDataset(prefix)
    for p in range(len(ds)):
        pack = ds[p]
        b = list(pack.seq_start_id) + [len(pack.input_ids)]
        for k in range(len(b) - 1):
            yield np.asarray(pack.input_ids[b[k]:b[k + 1]]), np.asarray(pack.loss_mask[b[k]:b[k + 1]])


def decoded(prefix):
    from megatron_sft_idx.preprocess.records.chat import ChatTokenizer

    tok = ChatTokenizer(TOKENIZER)
    out = []
    for ids, mask in sequences(prefix):
        t = np.flatnonzero(mask) + 1
        runs = np.split(t, np.flatnonzero(np.diff(t) != 1) + 1) if t.size else []
        out.append((tok.decode(ids), [tok.decode(ids[r]) for r in runs]))
    return sorted(out)


def test_alpaca_keeps_its_input_and_trains_the_output(tmp_path):
    records = [alpaca(i, with_input=i % 2 == 0, system=i % 3 == 0, history=i % 4 == 0) for i in range(12)]
    path = write_jsonl(tmp_path / "alpaca.jsonl", records)
    s = run(cfg(tmp_path, [path], verify_masks=12))
    assert s["conversations"] == 12 and s["verify_masks"]["checked"] == 12
    texts = decoded(s["outputs"][0])
    for r in records:
        text, runs = next((t, runs) for t, runs in texts if r["output"] in t and r["instruction"] in t)
        query = r["instruction"] + ("\n" + r["input"] if r["input"] else "")
        assert f"<|im_start|>user\n{query}{EOT}" in text
        want = ([p[1] + EOT for p in r.get("history", [])]) + [r["output"] + EOT]
        assert runs == want
        if "system" in r:
            assert text.startswith(f"<|im_start|>system\n{r['system']}{EOT}")


def test_gpteacher_and_dolly_train_their_response_with_the_input_kept(tmp_path):
    """GPTeacher names the reply ``response``; Dolly also names the input ``context``: each trains
    its reply, the input in the user turn, checked against the source (--verify-masks)."""
    records = [{"instruction": f"Explain {i}.", "input": f"In brief {i}." if i % 2 else "", "response": f"It is {i}."}
               for i in range(4)]
    records += [{"instruction": f"Who wrote {i}?", "context": f"Ada wrote {i}.", "response": f"Ada {i}.",
                 "category": "closed_qa"} for i in range(4, 6)]
    path = write_jsonl(tmp_path / "gpteacher.jsonl", records)
    s = run(cfg(tmp_path, [path], verify_masks=6))
    assert s["conversations"] == 6 and s["verify_masks"]["failures"] == 0
    assert s["ignored_keys"] == {"metadata:category": 2}
    texts = decoded(s["outputs"][0])
    for r in records:
        text, runs = next((t, runs) for t, runs in texts if r["response"] in t)
        query = "\n".join(x for x in (r["instruction"], r.get("input") or r.get("context")) if x)
        assert f"<|im_start|>user\n{query}{EOT}" in text and runs == [r["response"] + EOT]


def test_prompt_keys_over_alpaca_refuse_the_input_instead_of_dropping_it(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [alpaca(0, with_input=False), alpaca(1, with_input=True)])
    with pytest.raises(InputError, match=rf"^{path}:2: 'input' has no place in a prompt/completion record"):
        run(cfg(tmp_path, [path], prompt_key="instruction", completion_key="output"))
    s = run(cfg(tmp_path, [path]))  # auto: Alpaca
    assert s["conversations"] == 2


def test_prompt_completion_as_chat_or_raw(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"Q{i}: why?", "completion": f"Because {i}."}
                                               for i in range(3)])
    s = run(cfg(tmp_path, [path], name="chat", verify_masks=3))
    assert decoded(s["outputs"][0])[0] == (
        f"<|im_start|>user\nQ0: why?{EOT}\n<|im_start|>assistant\nBecause 0.{EOT}\n", [f"Because 0.{EOT}"])
    s = run(cfg(tmp_path, [path], name="raw", prompt_format="raw", verify_masks=3))
    assert decoded(s["outputs"][0])[0] == (f"Q0: why?Because 0.{EOT}", [f"Because 0.{EOT}"])
    ds = MMapIndexedDataset(s["outputs"][0])
    assert ds.metadata.extra["prompt_format"] == "raw"


def test_chat_template_is_used_for_prompt_records_not_ignored(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ':\\n' + m['content'] + '<|im_end|>' }}"
                        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant:\\n' }}{% endif %}")
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q?", "completion": "A."}])
    s = run(cfg(tmp_path, [path], chat_template=str(template)))
    assert decoded(s["outputs"][0]) == [(f"<|im_start|>user:\nQ?{EOT}<|im_start|>assistant:\nA.{EOT}", [f"A.{EOT}"])]


def test_cli_flags_reach_the_shard(tmp_path, capsys):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"messages": [{"role": "user", "content": "q", "id": "m1"},
                                                             {"role": "assistant", "content": "a"}]}])
    out = str(tmp_path / "o" / "ds")
    assert main(["--input", path, "--tokenizer", TOKENIZER, "--output-prefix", out, "-q"]) == 1
    assert "'messages[0]' has field 'id'" in capsys.readouterr().err
    assert main(["--input", path, "--tokenizer", TOKENIZER, "--output-prefix", out, "--ignore-field", "id",
                 "--tool-call-loss", "mask", "--reasoning-loss", "mask", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["loss_policy"] == {"tool_calls": "mask", "reasoning": "mask", "empty_reasoning": "mask",
                                      "reasoning_tags": ["<think>", "</think>"]}
    extra = MMapIndexedDataset(out).metadata.extra
    assert extra["loss_policy"] == {"tool_calls": "mask", "reasoning": "mask"}


# ---------------------------------------------------------------- JSON arrays, saved datasets, Parquet

import gzip  # noqa: E402

from support.saved_datasets import save_to_disk, shard_bytes  # noqa: E402
from support.sft_fixtures import glaive, mixed, openai  # noqa: E402


def tool_tokenizer(families):
    return families["qwen25"]


@pytest.mark.slow
@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_array_gives_the_bytes_of_the_same_jsonl_in_partitions(tmp_path, families, indent):
    records = mixed(120)
    jsonl = write_jsonl(tmp_path / "data.jsonl", records)
    array = tmp_path / "data.json"
    array.write_text(json.dumps(records, indent=indent, ensure_ascii=False))
    tok = tool_tokenizer(families)
    a = run(cfg(tmp_path, [jsonl], name="l", tokenizer=tok))
    b = run(cfg(tmp_path, [array], name="a", tokenizer=tok, partition_bytes=4096, workers=2, verify_masks=30))
    assert b["records_read"] == a["records_read"] == 120 and b["skipped"] == a["skipped"] == {}
    assert shard_bytes(a["outputs"][0]) == shard_bytes(b["outputs"][0])
    assert b["verify_masks"]["checked"] == 30
    gz = tmp_path / "data.json.gz"
    gz.write_bytes(gzip.compress(array.read_bytes()))
    c = run(cfg(tmp_path, [gz], name="g", tokenizer=tok))
    assert shard_bytes(a["outputs"][0]) == shard_bytes(c["outputs"][0])
    named = tmp_path / "lines.json"  # JSON Lines under a .json name
    named.write_text(open(jsonl).read())
    d = run(cfg(tmp_path, [named], name="n", tokenizer=tok))
    assert shard_bytes(a["outputs"][0]) == shard_bytes(d["outputs"][0])


def test_array_records_are_numbered_and_skips_counted_by_reason(tmp_path, families):
    records = [openai(0), {"messages": "not a list"}, openai(1), [1, 2], {"conversations": []}, openai(2)]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(records, indent=1))
    with pytest.raises(InputError, match=rf"^{path}:2: 'messages' must be a list"):
        run(cfg(tmp_path, [path], tokenizer=tool_tokenizer(families)))
    s = run(cfg(tmp_path, [path], tokenizer=tool_tokenizer(families), skip_bad=True, partition_bytes=512))
    assert s["conversations"] == 3 and s["records_read"] == 6
    assert s["skipped"] == {"empty_conversation": 1, "malformed_json": 1, "missing_key": 1}
    assert s["skipped_examples"]["malformed_json"].startswith(f"{path}:4: ")


def test_every_record_skipped_says_why_not_skipped_empty(tmp_path):
    path = tmp_path / "all_bad.jsonl"
    path.write_text("".join(json.dumps(openai(i))[:-1] + "\n" for i in range(3)) + "[1]\n")
    with pytest.raises(ShardError) as e:
        run(cfg(tmp_path, [path], skip_bad=True))
    assert "skipped: 4 (4 malformed json)" in str(e.value) and f"{path}:1: malformed JSON" in str(e.value)
    path = tmp_path / "array_named.jsonl"  # an array under a .jsonl name is read as the array it is
    path.write_text(json.dumps([{"prompt": "q", "completion": "a"}]))
    assert run(cfg(tmp_path, [path], name="named"))["conversations"] == 1


def test_a_broken_array_is_refused_by_file(tmp_path):
    for name, text in (("open.json", '[{"messages": []}'), ("after.json", "[] []"), ("empty.json", "[,]")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(InputError, match=rf"^{path}: cannot read input \(ArrayError: "):
            run(cfg(tmp_path, [path], name=name))


def test_an_oversized_array_element_is_never_held_and_is_counted(tmp_path, families):
    big = {"messages": [{"role": "user", "content": "x" * 50_000}, {"role": "assistant", "content": "y"}]}
    path = tmp_path / "big.json"
    path.write_text(json.dumps([openai(0), big, openai(1)]))
    s = run(cfg(tmp_path, [path], tokenizer=tool_tokenizer(families), skip_bad=True, max_record_bytes=4096))
    assert s["conversations"] == 2 and s["skipped"] == {"record_too_large": 1}
    assert s["skipped_examples"]["record_too_large"].startswith(f"{path}:2: record of ")


@pytest.mark.compat  # the datasets package of the Bridge stack (make install-compat), in its own interpreter
@pytest.mark.subprocess
def test_a_saved_hugging_face_dataset_directory_is_read_with_pyarrow(tmp_path, families):
    records = [openai(i) for i in range(40)] + [{"messages": [{"role": "user", "content": f"q{i}"},
                                                              {"role": "assistant", "content": f"a{i}"}]}
                                                for i in range(40)]
    saved = save_to_disk(records, str(tmp_path / "saved"))
    assert len([n for n in os.listdir(saved) if n.endswith(".arrow")]) > 1
    tok = tool_tokenizer(families)
    a = run(cfg(tmp_path, [saved], name="hf", tokenizer=tok, partition_bytes=8192, verify_masks=80))
    b = run(cfg(tmp_path, [write_jsonl(tmp_path / "same.jsonl", records)], name="l", tokenizer=tok))
    assert a["records_read"] == 80 and a["verify_masks"]["checked"] == 80
    assert shard_bytes(a["outputs"][0]) == shard_bytes(b["outputs"][0])
    os.makedirs(tmp_path / "dd")
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(InputError, match="DatasetDict holds several splits"):
        run(cfg(tmp_path, [tmp_path / "dd"], name="dd", tokenizer=tok))


@pytest.mark.parametrize("state", [b"[" * 100_000 + b"]" * 100_000, b'{"_data_files": ' + b"[" * 70 + b"]" * 70 + b"}",
                                   b'{"_data_files": NaN}', b"\xff{}", b'{"_data_files": "x"}'],
                         ids=["deep", "past the depth limit", "NaN", "not utf-8", "no files"])
def test_a_saved_dataset_whose_state_json_is_hostile_is_an_input_error_naming_it(tmp_path, state):
    from megatron_sft_idx.preprocess.records.inputs import expand_inputs

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_bytes(state)
    with pytest.raises(InputError) as info:
        expand_inputs([str(saved)])
    assert info.value.path == str(saved / "state.json") and "\n" not in str(info.value), info.value


def test_parquet_rows_with_null_fields_map_as_absent(tmp_path, families):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [glaive(i) for i in range(10)] + [{"conversations": [{"from": "human", "value": "q"},
                                                                   {"from": "gpt", "value": "a"}],
                                                 "system": None, "tools": None}]
    path = tmp_path / "g.parquet"
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=3)
    s = run(cfg(tmp_path, [path], tokenizer=tool_tokenizer(families), partition_bytes=1, verify_masks=11))
    assert s["conversations"] == 11 and s["verify_masks"]["checked"] == 11
