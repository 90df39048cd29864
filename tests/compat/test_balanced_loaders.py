"""A balanced order written by ``repack-sft --balance-for`` reaches every data-parallel rank through
the stock loaders of the installed stack (Megatron-Bridge 0.6.2 on megatron-core 0.19):

* Megatron-LM: ``SFTIndexedDataset(pack_order_file="auto")`` built by ``BlendedMegatronDatasetBuilder``
  over the set's manifest, read by the real ``MegatronPretrainingSampler`` (``dataloader_type="single"``)
  for each of the 4 ranks: every rank receives, micro-batch by micro-batch, exactly the packs the
  planner laid out for it (:func:`layout.where`), from the start and from a resume point;
* Megatron-Bridge: ``PackedSFTDatasetProvider(balanced_order="auto", dataloader_type="single")`` built
  through ``build_datasets`` and read by Bridge's ``build_pretraining_data_loader(..., "single", ...)``:
  the same; the provider refuses ``"batch"``/``"cyclic"`` with the reason.

(The 4-process torchrun proof of the same slicing is tests/compat/test_batching_torchrun.py.)
"""

import zlib

import numpy as np
import pytest

from support.token_inputs import tokens_input

from megatron.bridge.data.samplers import build_pretraining_data_loader
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

from megatron_sft_idx.batching import Order, Topology
from megatron_sft_idx.batching.layout import where
from megatron_sft_idx.batching.serve import OrderRecordWarning
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.open import open_packed
from megatron_sft_idx.preprocess import Config, RepackConfig, run
from megatron_sft_idx.preprocess.driver import repack
from megatron_sft_idx.training import megatron as M
from megatron_sft_idx.training.bridge_provider import PackedSFTDatasetProvider, build_context

DP, MBS, GBS, SEED = 4, 2, 16, 99
NUM_SAMPLES = 200


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("balanced_loaders")
    run(Config([tokens_input(root / "in.jsonl", count=500, seed=3)], str(root / "first"), store=str(root / "store"),
               input_format="tokens", vocab_size=50, pad_id=0, pack_size=256, progress=False))
    summary = repack(RepackConfig(str(root / "store"), str(root / "set"), pack_size=256, pad_id=0,
                                  max_packs_per_shard=25, balance_for=(DP, MBS, GBS), balance_seed=SEED,
                                  balance_epochs=2, progress=False))
    manifest = str(root / "set.json")
    assert summary["manifests"] == [manifest] and summary["orders"] == [str(root / "set.order")]
    return {"manifest": manifest, "order": Order.load(str(root / "set.order")), "root": root}


@pytest.fixture(autouse=True)
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def planned(order, consumed):
    """Per rank, the planned pack ids of each micro-batch a sampler yields from ``consumed`` on."""
    stream = order.sample_index(NUM_SAMPLES)
    group = MBS * DP
    g = np.arange(consumed, consumed + (NUM_SAMPLES - consumed) // group * group)
    _, _, rank, _ = where(g, Topology(DP, MBS, GBS))
    return [stream[g[rank == r]].reshape(-1, MBS).tolist() for r in range(DP)]


def pack_ids(manifest):
    source = open_packed(manifest)
    crcs = [zlib.crc32(source[i].input_ids.tobytes()) for i in range(len(source))]
    return crcs


def test_megatron_sampler_gives_every_rank_its_planned_packs(data):
    cfg = M.SFTIndexedDatasetConfig(random_seed=SEED, sequence_length=256, blend=M.parse_data_path(data["manifest"]),
                                    split="100,0,0", path_to_cache=None, tokenizer=None, pack_order_file="auto",
                                    data_parallel_size=DP, micro_batch_size=MBS, global_batch_size=GBS)
    train = BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [NUM_SAMPLES, 0, 0], lambda: True, cfg).build()[0]
    crcs = pack_ids(data["manifest"])
    row_of = {}
    for p in range(len(crcs)):
        row_of[zlib.crc32(M._layout_pack(open_packed(data["manifest"])[p], 256, train.pad_token_id, None)
                          ["tokens"].numpy().tobytes())] = p
    for consumed in (0, 3 * GBS):
        for rank in range(DP):
            sampler = MegatronPretrainingSampler(total_samples=len(train), consumed_samples=consumed,
                                                 micro_batch_size=MBS, data_parallel_rank=rank, data_parallel_size=DP)
            got = [[row_of[zlib.crc32(train[i]["tokens"].numpy().tobytes())] for i in mb] for mb in sampler]
            assert got == planned(data["order"], consumed)[rank]


def test_bridge_single_loader_gives_every_rank_its_planned_packs(data):
    provider = PackedSFTDatasetProvider(train_path=data["manifest"], seq_length=256, seed=SEED, eos_id=0,
                                        pad_to_max_length=True, balanced_order="auto", dataloader_type="single",
                                        dataset_kwargs={"topology": Topology(DP, MBS, GBS)})
    train, valid, test = provider.build_datasets(build_context(NUM_SAMPLES))
    assert valid is None and test is None
    source = open_packed(data["manifest"])
    row_of = {zlib.crc32(train.collate_fn([{"input_ids": source[p].input_ids,
                                            "seq_boundaries": source[p].seq_boundaries,
                                            "loss_mask": source[p].loss_mask}])["tokens"][0].numpy().tobytes()): p
              for p in range(len(source))}
    for consumed in (0, 5 * GBS):
        for rank in range(DP):
            loader = build_pretraining_data_loader(train, consumed, provider.dataloader_type, MBS, 0, False,
                                                   collate_fn=train.collate_fn, data_parallel_rank=rank,
                                                   data_parallel_size=DP, global_batch_size=GBS, seed=SEED)
            got = [[row_of[zlib.crc32(row.numpy().tobytes())] for row in batch["tokens"]] for batch in loader]
            assert got == planned(data["order"], consumed)[rank]


@pytest.mark.parametrize("kind", ["batch", "cyclic"])
def test_the_provider_refuses_a_reshuffling_loader(data, kind):
    with pytest.raises(ShardError, match="only through dataloader_type=\"single\"") as info:
        PackedSFTDatasetProvider(train_path=data["manifest"], seq_length=256, seed=SEED, balanced_order="auto",
                                 dataloader_type=kind)
    assert "num_epochs" in str(info.value)
    provider = PackedSFTDatasetProvider(train_path=data["manifest"], seq_length=256, seed=SEED,
                                        balanced_order="auto", dataloader_type="single")
    provider.dataloader_type = kind   # changed after construction: refused at build
    with pytest.raises(ShardError, match="re-shuffles"):
        provider.build_datasets(build_context(NUM_SAMPLES))


def test_bridge_refuses_another_seed_and_notes_a_replanned_order(data, tmp_path):
    with pytest.raises(ShardError, match="another data seed"):
        PackedSFTDatasetProvider(train_path=data["manifest"], seq_length=256, seed=1234, balanced_order="auto",
                                 dataloader_type="single").build_datasets(build_context(NUM_SAMPLES))
    order_path = data["manifest"][:-len(".json")] + ".order"
    original = open(order_path, "rb").read()
    try:   # a valid order of these packs, but not the one the manifest records: served, with a warning
        other = Order.load(order_path)
        other.stats = {"note": "replanned"}
        other.save(order_path)
        with pytest.warns(OrderRecordWarning, match="re-planned"):
            train = PackedSFTDatasetProvider(train_path=data["manifest"], seq_length=256, seed=SEED,
                                             balanced_order="auto", dataloader_type="single").build_datasets(
                build_context(NUM_SAMPLES))[0]
        np.testing.assert_array_equal(train.samples_mapping, other.sample_index(NUM_SAMPLES))
        with open(order_path, "r+b") as f:   # a corrupt one: refused by its own CRCs
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(ShardError, match="CRC-32 mismatch"):
            PackedSFTDatasetProvider(train_path=data["manifest"], seq_length=256, seed=SEED, balanced_order="auto",
                                     dataloader_type="single").build_datasets(build_context(NUM_SAMPLES))
    finally:
        with open(order_path, "wb") as f:
            f.write(original)


def test_bridge_refuses_more_samples_than_the_order_holds(data):
    n = data["order"].num_packs
    with pytest.raises(ShardError, match="need 3 epochs of the balanced order; it holds 2") as info:
        PackedSFTDatasetProvider(train_path=data["manifest"], seq_length=256, seed=SEED, balanced_order="auto",
                                 dataloader_type="single").build_datasets(build_context(2 * n + 1))
    assert "--balance-epochs" in str(info.value)
