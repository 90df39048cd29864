"""The order file: round trip, and every kind of damage refused by the project's errors."""

import json
import struct
import warnings
import zlib

import numpy as np
import pytest

from megatron_sft_idx.batching.balance import plan_order
from megatron_sft_idx.batching.cost import CostModel
from megatron_sft_idx.batching.layout import Topology
from megatron_sft_idx.batching.order import HEADER, HEADER_SIZE, Order, TopologyMismatchWarning
from megatron_sft_idx.errors import HeaderError, ShardError, VersionError

TOPO = Topology(2, 1, 8)
MODEL = CostModel.from_preset("llama3-8b", pad_multiple=2)


@pytest.fixture
def order():
    costs = np.random.default_rng(0).uniform(1, 100, 50)
    return plan_order(costs, TOPO, MODEL, seed=17, epochs=3, source={"prefixes": ["/d/a"]})


def test_round_trip_keeps_every_field(order, tmp_path):
    path = tmp_path / "x.order"
    order.save(path)
    back = Order.load(path)
    np.testing.assert_array_equal(back.permutations, order.permutations)
    np.testing.assert_array_equal(back.costs, order.costs)
    assert (back.topology, back.cost_model, back.seed, back.first_epoch) == (TOPO, MODEL, 17, 0)
    assert (back.algorithm, back.exchange_window, back.source) == ("kk", 1, {"prefixes": ["/d/a"]})
    assert back.stats == json.loads(json.dumps(order.stats))
    assert not list(tmp_path.glob("*.tmp-*"))  # written atomically


def test_sample_index_concatenates_epochs_and_cuts(order):
    index = order.sample_index(120)
    assert index.tolist() == np.concatenate([order.permutation(e) for e in range(3)])[:120].tolist()
    with pytest.raises(ShardError, match="need epochs 0..3"):
        order.sample_index(151)
    with pytest.raises(ShardError, match="not 3"):
        order.permutation(3)


def test_topology_mismatch_warns_and_names_both(order):
    assert order.topology_mismatch(TOPO) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert order.warn_if_mismatch(Topology(4, 1, 8))
    assert caught[0].category is TopologyMismatchWarning
    assert "DP 2, micro-batch 1, global batch 8" in str(caught[0].message)
    assert "DP 4, micro-batch 1, global batch 8" in str(caught[0].message)


def test_costs_of_other_data_are_refused(order):
    order.check_costs(order.costs.copy())
    changed = order.costs.copy()
    changed[7] += 1
    with pytest.raises(ShardError, match="pack 7's cost differs") as err:
        order.check_costs(changed, path="/d/a")
    assert err.value.pack == 7 and err.value.path == "/d/a"
    with pytest.raises(ShardError, match="different number of packs"):
        order.check_costs(order.costs[:-1])


def _rewrite(path, metadata=None, arrays=None):
    """Rewrite a valid order file with new metadata or array bytes and correct CRCs."""
    data = bytearray(path.read_bytes())
    _, major, minor, _, meta_off, meta_len, _, _, _, _ = HEADER.unpack(data[:HEADER_SIZE])
    body = bytes(data[HEADER_SIZE:meta_off]) if arrays is None else arrays
    meta = data[meta_off:meta_off + meta_len] if metadata is None else \
        metadata if isinstance(metadata, bytes) else json.dumps(metadata).encode()
    meta_off = HEADER_SIZE + len(body)
    crc = zlib.crc32(meta, zlib.crc32(body))
    head = HEADER.pack(b"MSFTORD\x00", major, minor, 0, meta_off, len(meta), meta_off + len(meta), b"\0" * 16,
                       crc, 0)[:60]
    path.write_bytes(head + struct.pack("<I", zlib.crc32(head)) + body + meta)


def _meta(path):
    data = path.read_bytes()
    _, _, _, _, off, length, _, _, _, _ = HEADER.unpack(data[:HEADER_SIZE])
    return json.loads(data[off:off + length])


@pytest.mark.parametrize("damage, error, match", [
    (lambda d: d[:40], HeaderError, "shorter than an order header"),
    (lambda d: d[:-5], HeaderError, "truncated or extended"),
    (lambda d: d + b"\0", HeaderError, "truncated or extended"),
    (lambda d: b"NOTORDER" + d[8:], HeaderError, "bad magic"),
    (lambda d: d[:100] + bytes([d[100] ^ 1]) + d[101:], HeaderError, "body CRC-32 mismatch"),
    (lambda d: d[:20] + bytes([d[20] ^ 1]) + d[21:], HeaderError, "header CRC-32 mismatch"),
])
def test_damaged_files_are_refused(order, tmp_path, damage, error, match):
    path = tmp_path / "x.order"
    order.save(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(error, match=match) as err:
        Order.load(path)
    assert err.value.path == str(path)


def test_unknown_major_version_is_refused(order, tmp_path):
    path = tmp_path / "x.order"
    order.save(path)
    data = bytearray(path.read_bytes())
    data[8:10] = (2).to_bytes(2, "little")
    data[60:64] = struct.pack("<I", zlib.crc32(bytes(data[:60])))
    path.write_bytes(bytes(data))
    with pytest.raises(VersionError, match="unsupported order major version 2.0"):
        Order.load(path)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(format="megatron_sft_idx.plan"), "names another format"),
    (lambda m: m.update(num_packs="50"), "'num_packs' is missing or not an integer"),
    (lambda m: m.update(epochs=0), "'epochs' is missing or not an integer >= 1"),
    (lambda m: m.update(seed=True), "'seed' is missing"),
    (lambda m: m.update(algorithm="magic"), "'algorithm' is not a known algorithm"),
    (lambda m: m.update(source=[1]), "'source' must be an object"),
    (lambda m: m["topology"].update(global_batch_size=7), "global_batch_size must be a multiple"),
    (lambda m: m["cost_model"].update(attention="x"), "cost model field 'attention'"),
    (lambda m: m["arrays"].update(costs=[64, 50, "float32"]), "no valid \\[offset, count, dtype\\] locator"),
    (lambda m: m["arrays"]["permutations"].__setitem__(1, 149), "holds 149 values, expected 150"),
    (lambda m: m["arrays"]["costs"].__setitem__(0, 10**9), "outside the arrays section"),
    (lambda m: m.update(num_packs=49), "holds 150 values, expected 147"),
])
def test_metadata_is_parsed_strictly(order, tmp_path, edit, match):
    path = tmp_path / "x.order"
    order.save(path)
    meta = _meta(path)
    edit(meta)
    _rewrite(path, metadata=meta)
    with pytest.raises(ShardError, match=match):
        Order.load(path)


@pytest.mark.parametrize("metadata", [
    b"[" * 100_000 + b"]" * 100_000,                                     # past Python's recursion limit
    b'{"format": "megatron_sft_idx.order", "stats": ' + b"[" * 65 + b"]" * 65 + b"}",  # past the format's depth
    b'{"format": "megatron_sft_idx.order", "seed": NaN}',
    b'{"format": "megatron_sft_idx.order", "seed": 1' + b"0" * 30 + b"}",
], ids=["deep", "past the depth limit", "NaN", "beyond int64"])
def test_metadata_beyond_the_limits_is_a_header_error_naming_the_file(order, tmp_path, metadata):
    path = tmp_path / "x.order"
    order.save(path)
    _rewrite(path, metadata=metadata)
    with pytest.raises(HeaderError) as info:
        Order.load(path)
    assert info.value.path == str(path) and info.value.field == "order metadata", info.value


def test_unknown_metadata_keys_are_ignored(order, tmp_path):
    path = tmp_path / "x.order"
    order.save(path)
    meta = _meta(path)
    meta["written_by_a_newer_minor"] = {"x": 1}
    _rewrite(path, metadata=meta)
    assert Order.load(path).seed == 17


def test_a_row_that_is_not_a_permutation_is_refused(order, tmp_path):
    path = tmp_path / "x.order"
    order.save(path)
    meta = _meta(path)
    data = path.read_bytes()
    body = bytearray(data[HEADER_SIZE:HEADER.unpack(data[:HEADER_SIZE])[4]])
    body[4 * 50:4 * 51] = body[4 * 51:4 * 52]  # epoch 1: a pack twice, another never
    _rewrite(path, metadata=meta, arrays=bytes(body))
    with pytest.raises(HeaderError, match="row 1 of the order is not a permutation"):
        Order.load(path)


def test_negative_costs_are_refused(order, tmp_path):
    path = tmp_path / "x.order"
    bad = Order(**{**order.__dict__, "costs": -order.costs})
    bad.save(path)
    with pytest.raises(HeaderError, match="costs must be finite and >= 0"):
        Order.load(path)


def test_missing_file_is_a_shard_error(tmp_path):
    with pytest.raises(ShardError, match="cannot read the order file"):
        Order.load(tmp_path / "none.order")
