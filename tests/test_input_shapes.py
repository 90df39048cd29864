"""The input shapes end to end: Alpaca, prompt/completion (chat and raw), through the pipeline."""

import json
import os

import numpy as np
import pytest

from megatron_sft_idx.preprocess.cli import main
from megatron_sft_idx.preprocess.errors import InputError
from megatron_sft_idx.preprocess.pipeline import Config, run
from megatron_sft_idx.reader import MMapIndexedDataset
from sft_fixtures import alpaca, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    from megatron_sft_idx.preprocess.chat import ChatTokenizer

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
