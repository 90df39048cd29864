"""The multi-rank proof of balanced orders: 4 torchrun processes (gloo, CPU) read a planned order
through the stock samplers and get exactly their planned packs.

* Megatron-LM's ``MegatronPretrainingSampler`` (``dataloader_type="single"``) and Megatron-Bridge's
  ``build_pretraining_data_loader(..., "single", ...)``: every rank receives, micro-batch by
  micro-batch, the packs the planner laid out for it (:func:`layout.where`), every pack once per
  epoch, and each step's per-rank cost is the planned one;
* a second torchrun resuming from ``consumed_samples`` continues the same order;
* Bridge's ``"batch"`` loader (its SFT default) re-shuffles: it does not deliver the plan, which is
  why a planned order needs ``"single"``.
"""

import json
import os
import socket
import subprocess
import sys
import zlib

import numpy as np
import pytest

from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.batching import CostModel, Topology, plan_order, shard_pack_costs
from megatron_sft_idx.batching.layout import where
from megatron_sft_idx.batching.report import step_costs
from megatron_sft_idx.training.bridge import PackedSFTDataset

HERE = os.path.dirname(os.path.abspath(__file__))
N_PACKS, DP, MBS, GBS = 150, 4, 2, 16  # 150 % 16 = 6: the epoch boundary cuts a step
NUM_SAMPLES = 2 * N_PACKS
RESUME_AT = 3 * GBS


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out, order_path, shard, consumed):
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(DP), "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), os.path.join(HERE, "batching_worker.py"), out, order_path, shard,
           str(NUM_SAMPLES), str(consumed), str(MBS), str(GBS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(DP)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("balanced")
    shard = str(root / "s")
    write_shard(shard, random_packs(np.random.default_rng(0), N_PACKS, pack_size=64, max_seqs=6))
    model = CostModel(1.0, 1.0)
    costs = shard_pack_costs(MMapIndexedDataset(shard), model)
    order = plan_order(costs, Topology(DP, MBS, GBS), model, seed=1234, epochs=2)
    order.save(str(root / "train.order"))
    full = _torchrun(str(root / "full"), str(root / "train.order"), shard, 0)
    resumed = _torchrun(str(root / "resumed"), str(root / "train.order"), shard, RESUME_AT)
    return {"shard": shard, "order": order, "costs": costs, "full": full, "resumed": resumed}


def _planned(order, consumed):
    """Per rank, the planned packs of each micro-batch the sampler will yield from ``consumed`` on."""
    stream = order.sample_index(NUM_SAMPLES)
    group = MBS * DP
    end = consumed + (NUM_SAMPLES - consumed) // group * group  # the sampler drops a partial last group
    g = np.arange(consumed, end)
    _, _, rank, _ = where(g, Topology(DP, MBS, GBS))
    return [stream[g[rank == r]].reshape(-1, MBS).tolist() for r in range(DP)], end


def _pack_of(shard):
    ds = MMapIndexedDataset(shard)
    crcs = [zlib.crc32(ds[i].input_ids.tobytes()) for i in range(len(ds))]
    assert len(set(crcs)) == len(crcs)
    return {c: i for i, c in enumerate(crcs)}


@pytest.mark.slow
def test_every_rank_receives_exactly_its_planned_packs(run):
    pack_of = _pack_of(run["shard"])
    planned, end = _planned(run["order"], 0)
    received = [[[pack_of[c] for c in mb] for mb in r["megatron"]] for r in run["full"]]
    assert received == planned
    # the balance reaches the ranks: each complete step's cost per rank is the planned one
    stream = run["order"].sample_index(NUM_SAMPLES)
    per_rank_steps = np.array([[sum(run["costs"][p] for mb in received[r][s * (GBS // DP // MBS):
                                                                           (s + 1) * (GBS // DP // MBS)] for p in mb)
                                for r in range(DP)] for s in range(end // GBS)])
    np.testing.assert_allclose(per_rank_steps, step_costs(stream[:end], run["costs"], Topology(DP, MBS, GBS)))


@pytest.mark.slow
def test_every_pack_is_seen_once_per_epoch(run):
    pack_of = _pack_of(run["shard"])
    _, end = _planned(run["order"], 0)
    stream = run["order"].sample_index(NUM_SAMPLES)
    _, _, rank, _ = where(np.arange(end), Topology(DP, MBS, GBS))
    position = {r: np.arange(end)[rank == r] for r in range(DP)}
    seen = {0: [], 1: []}
    for r, result in enumerate(run["full"]):
        got = [pack_of[c] for mb in result["megatron"] for c in mb]
        for g, p in zip(position[r], got):
            seen[int(g) // N_PACKS].append(p)
    assert sorted(seen[0]) == list(range(N_PACKS))
    assert len(seen[1]) == len(set(seen[1])) == end - N_PACKS
    assert sorted(seen[1]) == sorted(stream[N_PACKS:end].tolist())


@pytest.mark.slow
def test_resuming_from_consumed_samples_continues_the_same_order(run):
    skip = RESUME_AT // (MBS * DP)
    for full, resumed in zip(run["full"], run["resumed"]):
        assert resumed["megatron"] == full["megatron"][skip:]
        assert resumed["bridge_single"] == full["bridge_single"][skip:]
    planned, _ = _planned(run["order"], RESUME_AT)
    pack_of = _pack_of(run["shard"])
    assert [[[pack_of[c] for c in mb] for mb in r["megatron"]] for r in run["resumed"]] == planned


@pytest.mark.slow
def test_bridge_single_loader_delivers_the_plan_and_batch_reshuffles(run):
    bridge = PackedSFTDataset(run["shard"], eos_id=0, pad_to_max_length=True)
    row = {}
    for p in range(N_PACKS):
        row[p] = zlib.crc32(bridge.collate_fn([bridge[p]])["tokens"][0].numpy().tobytes())
    planned, _ = _planned(run["order"], 0)
    expected = [[[row[p] for p in mb] for mb in per_rank] for per_rank in planned]
    assert [r["bridge_single"] for r in run["full"]] == expected
    batch = [r["bridge_batch"] for r in run["full"]]
    assert batch != [e[:len(b)] for e, b in zip(expected, batch)]


@pytest.mark.slow
def test_the_megatron_lm_door_delivers_the_plan_in_every_rank(run):
    """SFTIndexedDataset(pack_order_file=...) built by megatron-core's builder in each of the 4
    torchrun ranks, read by MegatronPretrainingSampler: each rank's planned packs, from the start
    and from the resume point."""
    from megatron_sft_idx.training.megatron import _layout_pack

    ds = MMapIndexedDataset(run["shard"])
    row = {p: zlib.crc32(_layout_pack(ds[p], 64, 0, None)["tokens"].numpy().tobytes()) for p in range(N_PACKS)}
    for result, consumed in ((run["full"], 0), (run["resumed"], RESUME_AT)):
        planned, _ = _planned(run["order"], consumed)
        assert [r["mlm_door"] for r in result] == [[[row[p] for p in mb] for mb in per_rank] for per_rank in planned]
