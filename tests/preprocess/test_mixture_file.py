"""The mixture file (``--mix``): one valid JSON or YAML document, or one clear error naming the file
and the field -- every refusal here is a real file written to disk and read by ``load_mixture``."""

import json
import os

import pytest

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess.mixture import MAX_MIXTURE_BYTES, load_mixture

GOOD = {"version": 1, "unit": "trained_tokens", "total": 1000, "window_steps": 4,
        "sources": [{"name": "chat", "inputs": ["data/chat.jsonl", "s3://b/in/*.jsonl"], "store": "stores/chat",
                     "weight": 3, "max_epochs": 2.5, "max_tokens": 5e8},
                    {"name": "math", "store": "s3://bucket/stores/math/", "weight": 0.5}]}


def write(tmp_path, doc, name="mix.json"):
    path = tmp_path / name
    path.write_bytes(doc if isinstance(doc, bytes) else (doc if isinstance(doc, str) else json.dumps(doc)).encode())
    return str(path)


def with_source(**change):
    doc = json.loads(json.dumps(GOOD))
    doc["sources"][0].update(change)
    return doc


def test_a_good_file_resolves_paths_against_its_directory(tmp_path):
    m = load_mixture(write(tmp_path, GOOD))
    chat, math = m.sources
    assert m.unit == "trained_tokens" and m.total == 1000 and m.window_steps == 4
    assert chat.store == os.path.join(str(tmp_path), "stores", "chat")
    assert chat.inputs == (os.path.join(str(tmp_path), "data", "chat.jsonl"), "s3://b/in/*.jsonl")
    assert (chat.weight, chat.max_epochs, chat.max_tokens) == (3, 2.5, 500_000_000)
    assert math.store == "s3://bucket/stores/math" and math.inputs == () and math.max_epochs is None
    assert m.to_dict() == {"unit": "trained_tokens", "total": 1000, "window_steps": 4,
                           "sources": [{"name": "chat", "weight": 3, "max_epochs": 2.5, "max_tokens": 500000000},
                                       {"name": "math", "weight": 0.5, "max_epochs": None, "max_tokens": None}]}


def test_defaults(tmp_path):
    m = load_mixture(write(tmp_path, {"version": 1, "sources": [{"name": "a", "store": "/s/a", "weight": 1}]}))
    assert (m.unit, m.total, m.window_steps) == ("trained_tokens", None, 10)


def test_yaml_gives_the_same_mixture(tmp_path):
    yaml_text = """
version: 1
unit: trained_tokens
total: 1000
window_steps: 4
sources:
  - name: chat
    inputs: [data/chat.jsonl, "s3://b/in/*.jsonl"]
    store: stores/chat
    weight: 3
    max_epochs: 2.5
    max_tokens: 500000000
  - {name: math, store: "s3://bucket/stores/math/", weight: 0.5}
"""
    a = load_mixture(write(tmp_path, GOOD))
    b = load_mixture(write(tmp_path, yaml_text, "mix.yaml"))
    assert a.to_dict() == b.to_dict() and a.sources == b.sources


BAD = [
    (with_source(weight=0), "sources[0].weight", "finite number > 0"),
    (with_source(weight=-1), "sources[0].weight", "finite number > 0"),
    (with_source(weight="3"), "sources[0].weight", "finite number > 0"),
    (with_source(weight=True), "sources[0].weight", "finite number > 0"),
    (with_source(max_epochs=0), "sources[0].max_epochs", "finite number > 0"),
    (with_source(max_tokens=1.5), "sources[0].max_tokens", "whole number"),
    (with_source(name="a b"), "sources[0].name", "malformed"),
    (with_source(inputs=[]), "sources[0].inputs", "lists no input"),
    (with_source(inputs=[""]), "sources[0].inputs[0]", "non-empty"),
    (with_source(store=""), "sources[0].store", "path or a URL"),
    (with_source(shards="x"), "sources[0].shards", "unknown key 'shards'"),
    (dict(GOOD, unit="bytes"), "unit", "known values"),
    (dict(GOOD, unit="epochs"), "total", "no meaning"),
    (dict(GOOD, total=0), "total", "finite number > 0"),
    (dict(GOOD, window_steps=0), "window_steps", "out of range"),
    (dict(GOOD, version=2), "version", "unsupported mixture version 2"),
    (dict(GOOD, sources=[]), "sources", "1 to 1024 sources"),
    (dict(GOOD, extra=1), "extra", "unknown key 'extra'"),
    ({k: v for k, v in GOOD.items() if k != "version"}, "version", "missing"),
    (dict(GOOD, sources=[GOOD["sources"][0], dict(GOOD["sources"][1], name="chat")]), "sources[1].name",
     "given twice"),
    (dict(GOOD, sources=[GOOD["sources"][0], dict(GOOD["sources"][1], store="stores/chat")]), "sources[1].store",
     "one store"),
    ([GOOD], "(top level)", "JSON object"),
    ('{"version": 1, "version": 1, "sources": []}', "version", "names the key 'version' twice"),
    ('{"version": 1, "sources": [{"name": "a", "store": "s", "weight": NaN}]}', "mixture file", "not valid"),
    ('{"version": 1, "sources": [{"name": "a", "store": "s", "weight": 1e999}]}', "mixture file", "limits"),
    ('{"version": 1} {"version": 1}', "mixture file", "not valid"),
    (b"\xff\xfe{}", "mixture file", "not valid"),
    ('{"version": 1, "sources": [' * 3, "mixture file", "not valid"),
]


@pytest.mark.parametrize("doc, field, words", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_json_is_one_error_naming_the_file_and_field(tmp_path, doc, field, words):
    path = write(tmp_path, doc)
    with pytest.raises(ShardError) as err:
        load_mixture(path)
    assert err.value.path == path and err.value.field == field, str(err.value)
    assert words in str(err.value)


YAML_BAD = [
    ("version: 1\nsources:\n  - {name: a, store: s, weight: .nan}\n", "sources[0].weight", "finite number"),
    ("version: 1\nsources:\n  - {name: a, store: s, weight: .inf}\n", "sources[0].weight", "finite number"),
    ("version: 1\nversion: 1\nsources: []\n", "version", "given twice"),
    ("version: 1\nsources: &s [{name: a, store: s, weight: 1}]\nx: *s\n", "(document)", "anchors and aliases"),
    ("version: 1\n---\nversion: 1\n", "(document)", "one valid YAML document"),
    ("version: 1\nsources:\n  - {name: a, store: s, weight: 1, max_epochs: 2020-01-01}\n",
     "sources[0].max_epochs", "not a JSON value"),
    ("version: 1\nsources: [\n", "(document)", "one valid YAML document"),
    ("- 1\n- 2\n", "(top level)", "JSON object"),
]


@pytest.mark.parametrize("text, field, words", YAML_BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(YAML_BAD)])
def test_bad_yaml_is_one_error_naming_the_file_and_field(tmp_path, text, field, words):
    path = write(tmp_path, text, "mix.yml")
    with pytest.raises(ShardError) as err:
        load_mixture(path)
    assert err.value.path == path and err.value.field == field, str(err.value)
    assert words in str(err.value)


def test_a_file_too_large_or_missing_is_refused(tmp_path):
    path = write(tmp_path, b" " * (MAX_MIXTURE_BYTES + 1))
    with pytest.raises(ShardError, match="larger than"):
        load_mixture(path)
    with pytest.raises(ShardError, match="cannot read the mixture file"):
        load_mixture(str(tmp_path / "none.json"))


def test_a_yaml_file_without_pyyaml_is_one_error_naming_the_extra(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_yaml(name, *args, **kw):
        if name == "yaml":
            raise ImportError("No module named 'yaml'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_yaml)
    path = write(tmp_path, "version: 1\n", "mix.yaml")
    with pytest.raises(ShardError, match=r"needs PyYAML") as err:
        load_mixture(path)
    assert "megatron_sft_idx[preprocess]" in str(err.value) and err.value.path == path
