"""The cost model against hand-computed FLOP counts, pack costs against their definition, and refusals."""

import numpy as np
import pytest
from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.batching.cost import (PRESETS, CostModel, ModelShape, kernel_lengths, microbatch_cost,
                                            pack_costs, shard_pack_costs)
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.multi import MultiShardDataset

TINY = ModelShape(hidden_size=8, ffn_hidden_size=16, num_layers=2, num_attention_heads=2, num_query_groups=1,
                  vocab_size=10)


def test_tiny_model_flops_by_hand():
    # d = 8 / 2 = 4. Per layer, forward, per token: QKV 2*8*4*(2 + 2*1) = 256, output 2*2*4*8 = 128,
    # gated MLP 2*3*8*16 = 768 -> 1152; two layers 2304; logits 2*8*10 = 160 -> 2464.
    assert TINY.linear_flops_per_token() == 2464
    # scores + weighted sum, causal: 2 * heads * d per L^2 per layer -> 2*2*4 = 16, two layers 32.
    assert TINY.attention_flops_per_token2() == 32
    model = CostModel.from_shape(TINY)
    assert model.linear == 3 * 2464 and model.attention == 3.5 * 32
    recompute = CostModel.from_shape(TINY, recompute=True)
    assert recompute.linear == 4 * 2464 and recompute.attention == 4.5 * 32
    # one 10-token sequence: 7392 * 10 + 112 * 100
    assert model.sequence_cost([10]).tolist() == [73920 + 11200]


def test_ungated_mlp_and_explicit_head_dim():
    shape = ModelShape(hidden_size=8, ffn_hidden_size=16, num_layers=1, num_attention_heads=2, num_query_groups=2,
                       vocab_size=10, gated_mlp=False, kv_channels=3)
    # QKV 2*8*3*(2+4) = 288, output 2*2*3*8 = 96, MLP 2*2*8*16 = 512, logits 160 -> 1056
    assert shape.linear_flops_per_token() == 1056
    assert shape.attention_flops_per_token2() == 2 * 2 * 3


def test_llama3_8b_preset_matches_its_published_dimensions():
    per_layer = 2 * 4096 * 128 * (32 + 2 * 8) + 2 * 32 * 128 * 4096 + 2 * 3 * 4096 * 14336
    linear = 32 * per_layer + 2 * 4096 * 128256
    model = CostModel.from_preset("llama3-8b")
    assert model.linear == 3 * linear
    assert abs(model.linear / 1e9 - 45.0) < 0.1  # the module doc's figure
    assert model.attention == 3.5 * 32 * 2 * 32 * 128
    # attention's share of one sequence's cost: ~8 % at 4k, ~40 % at 32k, ~73 % at 128k
    share = [model.attention * L * L / model.sequence_cost([L])[0] for L in (4096, 32768, 131072)]
    assert [round(s, 2) for s in share] == [0.08, 0.4, 0.73]
    assert model.name == "llama3-8b"
    assert set(PRESETS) >= {"llama3-8b", "llama3-70b", "qwen2.5-7b"}


def test_kernel_lengths_follow_the_padding_layouts():
    stored = CostModel(1.0, 1.0, pad_multiple=4)
    runtime = CostModel(1.0, 1.0, pad_multiple=4, pad_layout="runtime")
    assert kernel_lengths([1, 4, 5, 8, 9], stored).tolist() == [4, 4, 8, 8, 12]
    assert kernel_lengths([1, 4, 5, 8, 9], runtime).tolist() == [0, 4, 4, 8, 8]
    assert kernel_lengths([1, 4, 5], CostModel(1.0, 1.0)).tolist() == [1, 4, 5]


def test_pack_costs_by_hand():
    model = CostModel(linear=1.0, attention=1.0, pad_multiple=4)
    lengths = np.array([3, 5, 8], dtype=np.int32)
    offsets = np.array([0, 2, 3])
    # kernel lengths [4, 8 | 8]: (4 + 16) + (8 + 64) = 92 | 8 + 64 = 72
    assert pack_costs(lengths, offsets, model).tolist() == [92.0, 72.0]
    # padded to 16 tokens: 12 and 8 kernel tokens -> +4 and +8 linear
    assert pack_costs(lengths, offsets, model, pad_to=16).tolist() == [96.0, 80.0]
    assert pack_costs(np.empty(0, np.int64), np.zeros(1), model).shape == (0,)


def test_shard_pack_costs_read_the_index_and_match_the_definition(tmp_path, rng):
    packs = random_packs(rng, 40, pack_size=64, max_seqs=6)
    write_shard(str(tmp_path / "a"), packs[:25])
    write_shard(str(tmp_path / "b"), packs[25:])
    model = CostModel(linear=3.0, attention=0.5, pad_multiple=2)
    lengths = np.concatenate([np.diff(np.append(s, len(ids))) for ids, _, s in packs])
    offsets = np.concatenate([[0], np.cumsum([len(s) for _, _, s in packs])])
    expected = pack_costs(lengths, offsets, model)
    for ids, _, starts in packs[:3]:
        seq = np.diff(np.append(starts, len(ids)))
        k = -(-seq // 2) * 2
        assert pack_costs(seq, [0, seq.size], model)[0] == float((3.0 * k + 0.5 * k * k).sum())
    single = shard_pack_costs(MMapIndexedDataset(str(tmp_path / "a")), model)
    np.testing.assert_array_equal(single, expected[:25])
    multi = MultiShardDataset.open([str(tmp_path / "a"), str(tmp_path / "b")])
    np.testing.assert_array_equal(shard_pack_costs(multi, model), expected)
    with pytest.raises(ShardError, match="cannot read sequence lengths"):
        shard_pack_costs([1, 2, 3], model)


def test_microbatch_cost_packed_and_padded():
    model = CostModel(linear=2.0, attention=1.0, pad_multiple=4)
    assert microbatch_cost([3, 8], model) == (2 * 4 + 16) + (2 * 8 + 64)
    assert microbatch_cost([3, 8], model, padded=True) == 2 * (2 * 8 + 64)
    assert microbatch_cost([], model) == 0.0


@pytest.mark.parametrize("kwargs, field", [
    (dict(linear=0.0, attention=1.0), "linear"),
    (dict(linear=float("nan"), attention=1.0), "linear"),
    (dict(linear=1.0, attention=-1.0), "attention"),
    (dict(linear=1.0, attention=1.0, pad_multiple=0), "pad_multiple"),
    (dict(linear=1.0, attention=1.0, pad_layout="sideways"), "pad_layout"),
])
def test_cost_model_refuses_bad_coefficients(kwargs, field):
    with pytest.raises(ShardError) as err:
        CostModel(**kwargs)
    assert err.value.field == field


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ShardError, match="unknown model preset 'gpt-5'") as err:
        CostModel.from_preset("gpt-5")
    assert "llama3-8b" in err.value.expected


def test_model_shape_refuses_non_positive_dimensions():
    with pytest.raises(ShardError, match="num_layers must be an integer >= 1"):
        ModelShape(hidden_size=8, ffn_hidden_size=16, num_layers=0, num_attention_heads=2, num_query_groups=1,
                   vocab_size=10)


def test_cost_model_dict_round_trip_is_strict():
    model = CostModel.from_preset("qwen2.5-7b", pad_multiple=8, pad_layout="runtime")
    assert CostModel.from_dict(model.to_dict()) == model
    assert CostModel.from_dict({**model.to_dict(), "future_key": 1}) == model
    for key, value in (("linear", "1"), ("pad_multiple", 2.0), ("pad_multiple", True), ("name", None)):
        with pytest.raises(ShardError, match=f"cost model field '{key}'"):
            CostModel.from_dict({**model.to_dict(), key: value}, path="x.order")
    with pytest.raises(ShardError) as err:
        CostModel.from_dict({**model.to_dict(), "pad_multiple": 0}, path="x.order")
    assert err.value.path == "x.order" and err.value.field == "cost_model.pad_multiple"


@pytest.mark.parametrize("lengths, offsets, match", [
    ([3, 5], [0, 3], "offsets must rise"),
    ([3, 5], [1, 2], "offsets must rise"),
    ([3, 0], [0, 2], "has length 0"),
    ([3.5, 2.0], [0, 2], "must be integers"),
    ([[3, 5]], [0, 2], "one-dimensional"),
])
def test_pack_costs_refuse_malformed_csr(lengths, offsets, match):
    with pytest.raises(ShardError, match=match):
        pack_costs(np.array(lengths), np.array(offsets), CostModel(1.0, 1.0))
