"""The report's data_path column is what megatron-core does: per-source shards blended by the
mixture's weights as sample weights, built by the real BlendedMegatronDatasetBuilder, give the
samples and trained-token shares the report predicts."""

import json

import numpy as np
import pytest

from megatron_sft_idx.preprocess.repack_cli import repack_main

from support.stages import CHAT, preprocess

builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("blendstores")
    preprocess(str(d / "o1"), inputs=[CHAT[0]], store=str(d / "chat"))
    preprocess(str(d / "o2"), inputs=[CHAT[1]], store=str(d / "share"))
    return d


def test_the_data_path_numbers_are_megatron_cores(stores, tmp_path, capsys):
    from megatron_sft_idx.training import megatron as M

    weights = {"chat": 1, "share": 3}
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"version": 1, "sources": [
        {"name": n, "store": str(stores / n), "weight": w, "max_epochs": 20} for n, w in weights.items()],
        "total": 60000}))
    assert repack_main(["--mix", str(mix), "--plan-only", str(tmp_path / "m.plan"), "--pack-size", "1024",
                        "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)["mixture"]["splits"]["all"]
    # each source alone, as preprocess-sft of that source writes it (one epoch, the same packing)
    for name in weights:
        assert repack_main(["--store", str(stores / name), "--output-prefix", str(tmp_path / name), "--pack-size",
                            "1024", "-q"]) == 0
    n = report["packs"]
    blend = ([str(tmp_path / k) for k in weights], [float(w) for w in weights.values()])
    config = M.SFTIndexedDatasetConfig(random_seed=5, sequence_length=1024, blend_per_split=[blend, None, None])
    train, _, _ = builder.BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [n, None, None], lambda: True,
                                                        config).build()
    index = np.asarray(train.dataset_index)
    trained = np.zeros(2)
    for j in range(n):
        trained[index[j]] += float(train[j]["loss_mask"].sum())
    rows = {r["name"]: r for r in report["sources"]}
    for k, name in enumerate(weights):
        dp = rows[name]["data_path"]
        assert abs((index == k).sum() - dp["samples"]) <= 1                 # Megatron's blend: the weights' samples
        assert dp["packs_alone"] == len(train.datasets[k].dataset)           # of packs each source alone makes
        assert trained[k] / trained.sum() == pytest.approx(dp["trained_share"], abs=0.03)
    # the mixture trains its target share; the same weights as sample weights do not
    assert abs(rows["chat"]["trained_share"] - 0.25) < abs(rows["chat"]["data_path"]["trained_share"] - 0.25) + 0.01
