"""Megatron-LM side against the installed megatron-core of this stack (0.16.1 and 0.19.2).

* a blend with ``path_to_cache`` where a small shard's split is empty: a clear refusal,
  the same in the same run and in every rerun, and no poisoned cache (issue 9, item 10);
* CP padding layouts: a "runtime"-layout shard is refused at CP > 1, served at CP 1;
* blends whose shards disagree (another tokenizer, chat template or vocabulary) and a blend
  entry holding two generations of a set are refused by name, in every split (issue 21);
* a real 4-process torchrun (gloo): rank 0 builds the index cache, the others reuse it,
  each rank reads its slice through Megatron's sampler, every sample seen exactly once.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from support.shardgen import random_packs, write_shard

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

from megatron_sft_idx.errors import IncompatibleShardsError, ShardError, ShardSetError
from megatron_sft_idx.training import megatron as M

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlm")
    write_shard(str(d / "big"), random_packs(np.random.default_rng(0), 160))
    write_shard(str(d / "small"), random_packs(np.random.default_rng(1), 5))
    return {"big": str(d / "big"), "small": str(d / "small")}


@pytest.fixture(autouse=True)
def one_process_group(tmp_path):
    """megatron-core's builder calls torch.distributed.get_rank() when distributed is available."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def build(blend, split, sizes, cache, seed=3, **kw):
    cfg = M.SFTIndexedDatasetConfig(random_seed=seed, sequence_length=64, blend=M.parse_data_path(blend),
                                    split=split, path_to_cache=cache, tokenizer=None, **kw)
    return BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, sizes, lambda: True, cfg).build()


def test_empty_split_of_a_small_shard_is_refused_clearly_in_every_run(shards, tmp_path):
    cache = str(tmp_path / "cache")
    blend = f"0.5 {shards['big']} 0.5 {shards['small']}"
    messages = []
    for _ in range(3):  # the first run, and reruns against the same cache
        with pytest.raises(ShardError) as info:
            build(blend, "90,5,5", [100, 10, 10], cache)
        messages.append(str(info.value))
        assert "oversamples it in excess of its size 0" in messages[-1] and shards["small"] in messages[-1]
        assert "stale" not in messages[-1]
    assert len(set(messages)) == 1
    # Nothing of the empty split was cached, so a corrected configuration builds from the same cache.
    train, valid, test = build(blend, "90,5,5", [100, 0, 0], cache)
    assert len(train) == 100


def test_runtime_layout_shard_is_refused_at_cp2_and_served_at_cp1(tmp_path):
    prefix = str(tmp_path / "bridge_cp")
    # Runtime layout, multiple 4: each stored sequence is 4k + 1 tokens.
    packs = [(np.arange(1, 11), np.array([0, 1, 1, 1, 0, 0, 1, 1, 1, 0]), np.array([0, 5]))] * 4
    write_shard(prefix, packs, metadata={"pad_seq_to_mult": 4, "pad_layout": "runtime"})
    with pytest.raises(ShardError, match="runtime segments") as info:
        build(prefix, "100,0,0", [4, 0, 0], None, context_parallel_size=2)
    assert info.value.field == "pad_layout"
    train, _, _ = build(prefix, "100,0,0", [4, 0, 0], None, context_parallel_size=1)
    assert len(train) == 4


LLAMA = {"name": "meta-llama/Llama-3.1-8B-Instruct", "files_sha256": "a" * 64, "chat_template_sha256": "c" * 64}


@pytest.mark.parametrize("other, words", [
    ({"tokenizer": {"name": "deepseek-ai/DeepSeek-V3", "files_sha256": "d" * 64}}, "different tokenizers"),
    ({"tokenizer": dict(LLAMA, chat_template_sha256="f" * 64)}, "different chat templates"),
])
def test_blends_of_disagreeing_shards_are_refused(shards, tmp_path, other, words):
    write_shard(str(tmp_path / "llama"), random_packs(np.random.default_rng(2), 40), metadata={"tokenizer": LLAMA})
    write_shard(str(tmp_path / "other"), random_packs(np.random.default_rng(3), 40), metadata=other)
    for blend, split, sizes in ((f"0.6 {tmp_path}/llama 0.4 {tmp_path}/other", "90,10,0", [50, 5, 0]),
                                (f"{tmp_path}/llama {tmp_path}/other", "90,10,0", [50, 5, 0])):
        with pytest.raises(IncompatibleShardsError, match=words) as info:
            build(blend, split, sizes, None)
        assert str(tmp_path / "other") in str(info.value) and str(tmp_path / "llama") in str(info.value)
    train, _, _ = build(f"0.6 {tmp_path}/llama 0.4 {shards['big']}", "90,10,0", [50, 5, 0], None)
    assert len(train) == 50  # a shard that records no tokenizer is not compared on it


def test_a_blend_entry_of_two_generations_is_refused(shards, tmp_path):
    for i, set_id in enumerate(["n" * 32, "o" * 32]):
        write_shard(str(tmp_path / "set" / f"ds_{i:06d}"), random_packs(np.random.default_rng(i), 30),
                    metadata={"set": {"id": set_id, "index": i, "count": 2, "name": "train"}})
    with pytest.raises(ShardSetError, match=r"set nnnnnnnnnnnn \(train\): 1 of its 2 shards"):
        build(f"0.5 {shards['big']} 0.5 {tmp_path}/set", "90,10,0", [50, 5, 0], None)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_four_ranks_each_sample_once(shards, tmp_path):
    out = str(tmp_path)
    blend = f"0.7 {shards['big']} 0.3 {shards['small']}"
    samples = 96
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), os.path.join(HERE, "torchrun_worker.py"), out, blend, str(samples)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]
    length = results[0]["length"]
    assert length >= samples and all(r["length"] == length for r in results)
    epoch = length // (2 * 4) * (2 * 4)  # micro-batch 2 x 4 ranks; the sampler drops the partial last step
    per_rank = [set(map(int, r["seen"])) for r in results]
    assert sum(len(s) for s in per_rank) == epoch and set().union(*per_rank) == set(range(epoch))
    # Each rank read the same bytes any process reads for that sample index.
    train, _, _ = build(blend, "100,0,0", [samples, 0, 0], os.path.join(out, "cache"), seed=7)  # the workers' seed
    import zlib
    for r in results:
        for i, crc in r["seen"].items():
            assert zlib.crc32(train[int(i)]["tokens"].numpy().tobytes()) == crc
    cached = os.listdir(os.path.join(out, "cache"))
    assert any(f.endswith("SFTIndexedDataset-train-sample_index.npy") for f in cached)
    if "bridge_seen" in results[0]:
        seen = [set(map(int, r["bridge_seen"])) for r in results]
        bridge_epoch = samples // 8 * 8
        assert sum(len(s) for s in seen) == bridge_epoch and set().union(*seen) == set(range(bridge_epoch))
