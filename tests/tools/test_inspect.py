"""inspect-idx: the summary's numbers and histograms equal what the packs hold; one pack's
boundaries and trained spans follow label alignment; detokenizing finds the recorded
tokenizer only if its files are unchanged; the plot is a PNG."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from megatron_sft_idx.errors import FormatError, ShardError
from megatron_sft_idx.preprocess.records.chat import tokenizer_files_sha256
from megatron_sft_idx.tools import pack_view
from megatron_sft_idx.tools.inspect import format_summary, summarize
from megatron_sft_idx.tools.inspect_cli import main as inspect_main
from megatron_sft_idx.tools.merge_plan import resolve_inputs
from megatron_sft_idx.tools.pack_view import describe_pack, format_pack
from megatron_sft_idx.publishing import write_manifest
from support.shardgen import random_packs, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")


@pytest.fixture
def two_shards(tmp_path, rng):
    a, b = random_packs(rng, 60, pack_size=64), random_packs(rng, 25, pack_size=64)
    write_shard(tmp_path / "s_000", a, vocab_size=1000, metadata={"packing": {"algorithm": "ffd", "seed": 1}})
    write_shard(tmp_path / "s_001", b, vocab_size=1000, metadata={"packing": {"algorithm": "ffd", "seed": 1}})
    return [str(tmp_path / "s_000"), str(tmp_path / "s_001")], a + b


def _seq_lengths(packs):
    return np.concatenate([np.diff(np.append(s, len(ids))) for ids, _, s in packs])


def test_summary_numbers_and_histograms_match_the_packs(two_shards):
    prefixes, packs = two_shards
    s = summarize(prefixes, bins=8)
    tokens = sum(len(p[0]) for p in packs)
    assert (s["packs"], s["sequences"], s["tokens"]) == (len(packs), sum(len(p[2]) for p in packs), tokens)
    assert s["trainable_tokens"] == sum(int(p[1].sum()) for p in packs)
    assert s["packing_efficiency"] == pytest.approx(tokens / (len(packs) * 64), abs=1e-6)
    h = s["histograms"]
    per_pack = np.array([len(p[2]) for p in packs])
    edges = np.array(h["sequences_per_pack"]["edges"])
    expected = [int(((per_pack >= lo) & (per_pack < hi)).sum()) for lo, hi in zip(edges[:-1], edges[1:])]
    assert h["sequences_per_pack"]["counts"] == expected
    lengths = _seq_lengths(packs)
    edges = np.array(h["sequence_length"]["edges"])
    expected = [int(((lengths >= lo) & (lengths < hi)).sum()) for lo, hi in zip(edges[:-1], edges[1:])]
    assert h["sequence_length"]["counts"] == expected and sum(expected) == lengths.size
    assert sum(h["pack_fill"]["counts"]) == len(packs)
    assert s["provenance"]["packing"] == {"algorithm": "ffd", "seed": 1}


def test_summary_text_is_short_and_names_what_matters(two_shards, tmp_path):
    prefixes, _ = two_shards
    text = format_summary(summarize(prefixes))
    assert len(text.splitlines()) < 60
    for word in ("packs", "sequences", "trainable", "uint16", "pack size    64", "packing efficiency",
                 "sequences per pack", "sequence length", "algorithm ffd"):
        assert word in text, word
    manifest = tmp_path / "all.json"
    write_manifest(manifest, prefixes)
    assert summarize(resolve_inputs([str(manifest)]))["packs"] == 85


def test_pack_view_boundaries_and_label_aligned_trained_spans(two_shards):
    prefixes, packs = two_shards
    view = describe_pack(prefixes, 61)  # global index: pack 1 of the second shard
    ids, loss, starts = packs[61]
    assert view["local_pack"] == 1 and view["shard"] == prefixes[1]
    assert view["seq_boundaries"] == starts.tolist() + [len(ids)]
    for seq in view["sequences"]:
        trained = [j + 1 for j in range(seq["start"], seq["end"] - 1) if loss[j]]
        from_spans = [t for a, b in seq["trained_spans"] for t in range(a, b)]
        assert from_spans == trained
        assert seq["input_ids"] == ids[seq["start"]:seq["end"]].tolist()
    assert describe_pack(prefixes, -1)["local_pack"] == 24
    with pytest.raises(ShardError, match="out of range"):
        describe_pack(prefixes, 85)
    text = format_pack(view)
    assert "[[" in text and "no tokenizer recorded" in text


def _tokenized_shard(tmp_path, tokenizer_meta):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(EXAMPLE_TOKENIZER, "tokenizer.json"))
    prompt, answer = tok.encode("What is a comet?").ids, tok.encode("A ball of ice and dust.").ids
    ids = np.array(prompt + answer, dtype=np.int64)
    loss = np.zeros(ids.size, dtype=np.uint8)
    loss[len(prompt) - 1:ids.size - 1] = 1  # label-aligned: trains the answer tokens
    write_shard(tmp_path / "t", [(ids, loss, np.array([0]))], pack_size=256, metadata={"tokenizer": tokenizer_meta})
    return str(tmp_path / "t"), tok.decode(answer)


def test_detokenizes_with_the_recorded_tokenizer_found_locally(tmp_path, monkeypatch):
    digest = tokenizer_files_sha256(EXAMPLE_TOKENIZER)[0]
    prefix, answer = _tokenized_shard(tmp_path, {"name": "org/example-bpe", "files_sha256": digest})
    # (the checkout's examples/tokenizer is searched last: out of reach here, to test the other places;
    # tests/test_frictions.py finds the demo's tokenizer through it)
    monkeypatch.setattr(pack_view, "EXAMPLE_TOKENIZER", str(tmp_path / "no-checkout"))
    assert "not found on this machine" in describe_pack([prefix], 0)["tokenizer_note"]
    monkeypatch.setenv(pack_view.TOKENIZER_PATH_ENV, os.path.dirname(EXAMPLE_TOKENIZER))
    text = describe_pack([prefix], 0)["sequences"][0]["text"]
    assert text.startswith("What is a comet?") and text.endswith("[[" + answer + "]]"), text
    # a Hugging Face cache snapshot of the same files is found by the recorded name
    monkeypatch.delenv(pack_view.TOKENIZER_PATH_ENV)
    snap = tmp_path / "hub" / "models--org--example-bpe" / "snapshots" / "abc123"
    shutil.copytree(EXAMPLE_TOKENIZER, snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert describe_pack([prefix], 0)["sequences"][0].get("text")
    # changed files are not the recorded tokenizer: no text unless --tokenizer forces it
    with open(snap / "tokenizer_config.json", "a") as f:
        f.write("\n")
    view = describe_pack([prefix], 0)
    assert "text" not in view["sequences"][0]
    view = describe_pack([prefix], 0, tokenizer_path=str(snap))
    assert view["sequences"][0].get("text") and "not the tokenizer the shard records" in view["tokenizer_note"]


def test_pretrain_input_is_refused(tmp_path):
    write_shard(tmp_path / "p", random_packs(np.random.default_rng(0), 2))
    for suffix in (".loss.bin", ".seq.idx", ".seq.bin"):
        os.unlink(str(tmp_path / "p") + suffix)
    with pytest.raises(FormatError, match="pretrain"):
        summarize([str(tmp_path / "p")])


def test_cli_summary_json_pack_and_plot(two_shards, tmp_path, capsys):
    prefixes, packs = two_shards
    assert inspect_main([str(tmp_path / "s_*"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["packs"] == len(packs)
    assert inspect_main([prefixes[0], "--pack", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_boundaries"][-1] == len(packs[3][0])
    png = tmp_path / "plots" / "h.png"
    assert inspect_main([prefixes[0], "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert "plot written" in capsys.readouterr().out
    assert inspect_main([prefixes[0], "--seq", "1"]) == 2
    assert inspect_main([prefixes[0], "--pack", "1", "--plot", str(png)]) == 2
    assert inspect_main([str(tmp_path / "missing")]) == 2
    assert inspect_main([prefixes[0], "--pack", "999"]) == 1
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.subprocess
def test_missing_matplotlib_names_the_extra(two_shards, tmp_path):
    prefixes, _ = two_shards
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from megatron_sft_idx._console import run\n"
            f"sys.exit(run('inspect-idx', [{prefixes[0]!r}, '--plot', {str(tmp_path / 'x.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "needs the 'tools' extra" in proc.stderr \
        and "pip install 'megatron_sft_idx[tools]'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.subprocess
def test_the_demo_shard_detokenizes_with_the_bundled_tokenizer(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_sft.py"),
                           "--input", os.path.join(ROOT, "examples", "conversations.jsonl"),
                           "--tokenizer", EXAMPLE_TOKENIZER, "--output-prefix", str(out / "ex"),
                           "--pack-size", "2048", "--workers", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "inspect_idx.py"), str(out / "ex"),
                           "--pack", "0", "--seq", "0", "--tokenizer", EXAMPLE_TOKENIZER],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "<|im_start|>assistant" in proc.stdout and "[[" in proc.stdout and "warning" not in proc.stdout


def test_inspect_finds_the_tokenizer_where_the_run_recorded_it(tmp_path, monkeypatch, capsys):
    """issue 33, item 5: a shard's metadata names its tokenizer by hash, not by path (a path is
    no part of its identity); the run that wrote it records where it found it (its summary,
    kept beside the outputs), and inspect-idx --pack looks there first -- used only while the
    files there still hash to the shard's record, else it says what it found there."""
    from megatron_sft_idx.preprocess import Config, run
    from megatron_sft_idx.tools.inspect_cli import main as inspect_main

    tok = tmp_path / "models" / "qwen3"
    shutil.copytree(EXAMPLE_TOKENIZER, tok)
    out = tmp_path / "out"
    s = run(Config(inputs=[os.path.join(ROOT, "examples", "conversations.jsonl")], output_prefix=str(out / "ds"),
                   tokenizer=str(tok), pack_size=1024, split=[90, 10], progress=False))
    assert s["tokenizer_path"] == str(tok)
    monkeypatch.setattr(pack_view, "EXAMPLE_TOKENIZER", str(tmp_path / "no-checkout"))
    monkeypatch.delenv(pack_view.TOKENIZER_PATH_ENV, raising=False)
    shard = s["splits"]["valid"]["shards"][0]
    assert pack_view.run_recorded(shard) == [str(tok)]
    assert inspect_main([shard, "--pack", "0", "--seq", "0"]) == 0
    text = capsys.readouterr().out
    assert "[[" in text and "not found" not in text
    with open(tok / "tokenizer_config.json", "a") as f:    # the files changed since: not that tokenizer
        f.write("\n")
    view = describe_pack([shard], 0)
    assert "text" not in view["sequences"][0]
    assert f"the path its run recorded, {tok} (its files hash otherwise)" in view["tokenizer_note"]
    shutil.rmtree(tok)
    assert f"{tok} (not there)" in describe_pack([shard], 0)["tokenizer_note"]
