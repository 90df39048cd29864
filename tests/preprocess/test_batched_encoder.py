"""The batched encoder (one render, gigatoken, numba masks) against the reference, record for record.

Hypothesis draws conversations with whitespace, unicode, special tokens and awkward role orders;
for every template the batched result (ids, masks, which records fail and why) must equal the
reference path's (prefix renders, per-record ``tokenizers`` encode with offsets).
"""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.encode import RecordEncoder
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess.records.fast_tokenizer import FastTokenizer, _spec_ok, backend_spec
from megatron_sft_idx.preprocess.records.encode import EncodeOptions
from support.preprocess_identity import TEMPLATES, tokenizer_dir

CHATML = "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
GEN = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
# templates the one-render method must NOT trust: each depends on what follows a turn
HOSTILE = {
    "loop_last": "{% for m in messages %}" + CHATML + "{% if loop.last %}{{ '<|endoftext|>' }}{% endif %}{% endfor %}" + GEN,
    "length": "{% for m in messages %}{% if messages|length > 2 %}{{ '#' }}{% endif %}" + CHATML + "{% endfor %}" + GEN,
    "prepass": ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                "{% for m in messages %}{{ ns.n }}" + CHATML + "{% endfor %}" + GEN),
    "lookback": ("{% for m in messages %}{% if loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'user' %}"
                 "{{ '>' }}{% endif %}" + CHATML + "{% endfor %}" + GEN),
    "buffered": ("{% set ns = namespace(out='') %}{% for m in messages %}{% set ns.out = ns.out + '<|im_start|>' + "
                 "m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' %}{% endfor %}{{ ns.out }}" + GEN),
}
PIECES = list("ab Z.\n\t") + ["  ", "\n\n", "é", "日本", "😀", "<|im_end|>", "<|im_start|>", "<think>", "\u00a0", "e\u0301"]
_text = st.lists(st.sampled_from(PIECES), max_size=10).map("".join)
_message = st.tuples(st.sampled_from(["system", "user", "assistant", "assistant", "tool"]), _text)


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("tpl"))
    dirs = {name: tokenizer_dir(base, name) for name in TEMPLATES}
    for name, template in HOSTILE.items():
        TEMPLATES_COPY = dict(TEMPLATES)
        TEMPLATES_COPY[name] = template
        from support import preprocess_identity as pi
        old = pi.TEMPLATES
        pi.TEMPLATES = TEMPLATES_COPY
        try:
            dirs[name] = tokenizer_dir(base, name)
        finally:
            pi.TEMPLATES = old
    return dirs


def reference(tok, line, raw, loss_on):
    messages = json.loads(raw)["messages"]
    try:
        return tok.encode_chat(messages, loss_on, "h.jsonl", line)
    except InputError as err:
        return str(err)


_ENCODERS = {}


def encoder(path, loss_on):
    key = (path, loss_on)
    if key not in _ENCODERS:
        _ENCODERS[key] = RecordEncoder(EncodeOptions(tokenizer_path=path, loss_on=loss_on, skip_bad=True))
    return _ENCODERS[key]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(_message, min_size=1, max_size=6), min_size=1, max_size=5),
       st.sampled_from(sorted(TEMPLATES) + sorted(HOSTILE)), st.sampled_from(["assistant", "last-turn", "all"]))
@example(conversations=[[("assistant", ""), ("assistant", "")]], template="buffered", loss_on="last-turn")
def test_batched_equals_reference(tok_dirs, conversations, template, loss_on):
    enc = encoder(tok_dirs[template], loss_on)
    tok = enc.tok
    records = [(i + 1, json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]}))
               for i, conv in enumerate(conversations)]
    got = enc.encode_batch(records, "h.jsonl")
    want = [reference(tok, line, raw, loss_on) for line, raw in records]
    kept = [w for w in want if not isinstance(w, str)]
    assert got.lengths.tolist() == [w[0].size for w in kept]
    assert got.lines.tolist() == [line for (line, _), w in zip(records, want) if not isinstance(w, str)]
    if kept:
        assert np.array_equal(got.ids, np.concatenate([w[0] for w in kept]))
        assert np.array_equal(got.loss_mask, np.concatenate([w[1] for w in kept]))
    errors = [w for w in want if isinstance(w, str)]
    assert sum(got.skipped.values()) == len(errors)
    if errors:
        assert errors[0] in got.first_skipped.values()


def test_fast_paths_are_taken_where_provable(tok_dirs):
    conversations = [json.loads(line) for line in open(tokenizer_dir.__globals__["EXAMPLE_INPUTS"][0])][:50]
    records = [(i + 1, json.dumps(c)) for i, c in enumerate(conversations)]
    for name in ("markers", "no_markers", "default_system", "folded_system"):
        enc = RecordEncoder(EncodeOptions(tokenizer_path=tok_dirs[name]))
        enc.encode_batch(records, "x.jsonl")
        assert enc.stats == {"one_render": 50, "prefix_render": 0, "fast_tokens": 50, "reference_tokens": 0}, name
    for name in HOSTILE:
        enc = RecordEncoder(EncodeOptions(tokenizer_path=tok_dirs[name], skip_bad=True))
        assert enc.locator is None, name   # disqualified by the probes: the reference renders prefixes


def test_gigatoken_agrees_on_probes_and_disagreement_stops_the_run(tok_dirs, monkeypatch):
    tok = ChatTokenizer(tok_dirs["markers"])
    fast = FastTokenizer.load(tok, "gigatoken")
    assert fast is not None and fast.byte_positions
    assert _spec_ok(backend_spec(tok.backend)) == (True, False, False)
    assert _spec_ok(backend_spec(ChatTokenizer(tok_dirs["space_prompt_trim"]).backend))[2] is True
    enc = RecordEncoder(EncodeOptions(tokenizer_path=tok_dirs["markers"]))
    real = enc.fast.trained_flags

    def corrupt(*args):  # a fast path that claims proof but differs: the sampled check must catch it
        trained, proven = real(*args)
        trained[0] ^= 1
        return trained, proven
    monkeypatch.setattr(enc.fast, "trained_flags", corrupt)
    record = (7, json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}))
    with pytest.raises(ShardError, match="x.jsonl:7: gigatoken and tokenizers disagree") as e:
        enc.encode_batch([record], "x.jsonl")
    assert "--tokenizer-backend hf" in str(e.value)


def test_hf_backend_needs_no_gigatoken(tok_dirs, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_gigatoken(name, *a, **k):
        if name == "gigatoken":
            raise ImportError("no gigatoken")
        return real_import(name, *a, **k)
    tok = ChatTokenizer(tok_dirs["markers"])
    monkeypatch.setattr(builtins, "__import__", no_gigatoken)
    assert FastTokenizer.load(tok, "auto") is None
    with pytest.raises(ShardError, match="needs the gigatoken package"):
        FastTokenizer.load(tok, "gigatoken")


def test_errors_surface_in_record_order_as_the_reference_raises_them(tmp_path):
    import shutil

    from support.preprocess_identity import EXAMPLE_TOKENIZER

    d = tmp_path / "no_template"
    shutil.copytree(EXAMPLE_TOKENIZER, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    records = [(1, b"{not json"), (2, good)]
    strict = RecordEncoder(EncodeOptions(tokenizer_path=str(d), skip_bad=False))
    with pytest.raises(InputError, match="x.jsonl:1: malformed JSON"):
        strict.encode_batch(records, "x.jsonl")
    lenient = RecordEncoder(EncodeOptions(tokenizer_path=str(d), skip_bad=True))
    with pytest.raises(ShardError, match="no chat template"):   # not a bad record: never skipped
        lenient.encode_batch(records, "x.jsonl")
