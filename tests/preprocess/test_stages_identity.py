"""Byte identity of preprocessing outputs, pinned against shards built by the pre-staged pipeline.

``tests/golden/stages_digests.json`` was written by the single-process-tree pipeline that
the staged one replaced (main at 8013c3a, format 1.1 with ``pad_layout``; ``python
tests/preprocess/test_preprocess_identity.py --write`` run on that tree). Every case runs here through today's pipeline and must give the same bytes:
the data files in full, and ``.seq.idx`` as its CSR bytes plus its metadata without the
``producer`` key (which changes with every release, and so would pin the version, not the data).

Since shards written as a set record it (metadata ``set``, issue 21), the ``.seq.idx`` digests
of the four multi-shard cases (``mffd_bytes_split_last``, ``runtime_layout_cp4``,
``split_shards_cp2``, ``tokens_truncate``) were updated: their metadata without ``set`` still
gives the old digests, and every other file is unchanged.

Inputs are copied under fixed relative names and the run happens with that directory as the
working directory, because each input's name, as given, is part of the shard metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
EXAMPLES = os.path.join(ROOT, "examples")
TOKENIZER = os.path.join(EXAMPLES, "tokenizer")
GOLDEN = os.path.join(ROOT, "tests", "golden", "stages_digests.json")
CHAT = ["in/conversations.jsonl", "in/conversations_sharegpt.jsonl"]

CASES = {
    "example_default": dict(inputs=CHAT, pack_size=1024),
    "split_shards_cp2": dict(inputs=CHAT, pack_size=1024, split=[98, 1, 1], max_packs_per_shard=7, cp=2),
    "shuffle_mult8_seed7": dict(inputs=CHAT, pack_size=512, algorithm="first_fit_shuffle", seed=7,
                                pad_seq_to_mult=8, overlong="truncate"),
    "bfd_drop_256": dict(inputs=CHAT, pack_size=256, algorithm="best_fit_decreasing", overlong="drop"),
    "mffd_bytes_split_last": dict(inputs=CHAT, pack_size=768, algorithm="modified_first_fit_decreasing",
                                  max_shard_bytes=20000, split=[80, 20], loss_on="last-turn"),
    "first_fit_all_sp": dict(inputs=CHAT, pack_size=640, algorithm="first_fit", loss_on="all", cp=2, tp=2,
                             sp=True, pad_id=0),
    "tokens_truncate": dict(inputs=["in/tokens.jsonl"], tokenizer=None, vocab_size=70000, pad_id=1,
                            input_format="tokens", pack_size=64, overlong="truncate", split=[90, 10]),
    "runtime_layout_cp4": dict(inputs=CHAT, pack_size=333, cp=4, pad_layout="runtime", overlong="truncate",
                               max_packs_per_shard=40),
}


def write_tokens_input(path: str) -> None:
    """Deterministic pre-tokenized records; ids above 65535 force int32 tokens; some overlong."""
    rng = np.random.default_rng(11)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(300):
            n = int(rng.integers(2, 100))
            ids = rng.integers(0, 70000, n).tolist()
            if i % 2:
                rec = {"input_ids": ids, "answer_start_idx": int(rng.integers(0, n - 1))}
            else:
                mask = (rng.random(n) < 0.5).astype(int).tolist()
                mask[-1] = 1
                rec = {"input_ids": ids, "loss_mask": mask}
            f.write(json.dumps(rec) + "\n")


def prepare_inputs(directory: str) -> None:
    os.makedirs(os.path.join(directory, "in"), exist_ok=True)
    for name in ("conversations.jsonl", "conversations_sharegpt.jsonl"):
        shutil.copyfile(os.path.join(EXAMPLES, name), os.path.join(directory, "in", name))
    write_tokens_input(os.path.join(directory, "in", "tokens.jsonl"))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_outputs(out_dir: str) -> dict:
    """{shard file name: sha256}, ``.seq.idx`` as CSR bytes + metadata without ``producer``."""
    from megatron_sft_idx.format import ALL_SUFFIXES, SEQ_IDX_HEADER_SIZE, SeqIdxHeader

    out = {}
    for name in sorted(n for n in os.listdir(out_dir) if n.endswith(ALL_SUFFIXES)):
        data = open(os.path.join(out_dir, name), "rb").read()
        if name.endswith(".seq.idx"):
            h = SeqIdxHeader.parse(data[:SEQ_IDX_HEADER_SIZE], name, len(data))
            meta = json.loads(data[64:64 + h.metadata_length])
            meta.pop("producer")
            data = json.dumps(meta, sort_keys=True).encode() + data[h.csr_offset:]
        out[name] = _sha(data)
    return out


def run_case(work: str, name: str, **overrides) -> dict:
    """Run case ``name`` with today's pipeline in ``work``; returns {digests, summary}."""
    from megatron_sft_idx.preprocess import Config, run

    kw = dict(CASES[name])
    kw.update(overrides)
    kw.setdefault("tokenizer", TOKENIZER)
    out_rel = os.path.join("out", name, "ds")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        s = run(Config(output_prefix=out_rel, progress=False, **kw))
    finally:
        os.chdir(cwd)
    summary = {k: s[k] for k in ("conversations", "records_read", "packs", "tokens", "truncated",
                                 "padding_tokens", "skipped")}
    summary["splits"] = {k: v["conversations"] for k, v in s["splits"].items()}
    return {"digests": digest_outputs(os.path.join(work, "out", name)), "summary": summary}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("identity"))
    prepare_inputs(d)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_outputs_are_byte_identical_to_the_pre_staged_pipeline(work, name):
    with open(GOLDEN, encoding="utf-8") as f:
        golden = json.load(f)[name]
    got = run_case(work, name)
    assert got["summary"] == golden["summary"]
    assert got["digests"] == golden["digests"]


def _write_golden() -> None:
    import tempfile

    result = {}
    with tempfile.TemporaryDirectory() as d:
        prepare_inputs(d)
        for name in sorted(CASES):
            result[name] = run_case(d, name)
            print(name, result[name]["summary"])
    with open(GOLDEN, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/preprocess/test_stages_identity.py --write  (only from the legacy pipeline)")
    _write_golden()
