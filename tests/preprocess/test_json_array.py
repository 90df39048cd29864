"""The JSON-array scanner (preprocess/records/json_array.py): any array, cut anywhere, reads back element for
element as json.loads reads it; oversized elements are reported, never held; memory stays bounded."""

import io
import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sft_idx.preprocess.records import json_array as ja
from megatron_sft_idx.preprocess.records.inputs import OversizedRecord

_text = st.text(alphabet=st.sampled_from(list('ab,[]{}":\\ \n\t') + ["é", "😀", "\u2028"]), max_size=12)
_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), _text),
                     lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
                     max_leaves=12)


def read_all(data: bytes, partition_bytes: int, max_bytes: int = 1 << 20):
    blocks = [data[i:i + 7] for i in range(0, len(data), 7)]  # tiny blocks: every boundary case
    cuts = ja.cut_points(iter(blocks), partition_bytes)
    out = []
    for (a, first), (b, _) in zip(cuts, cuts[1:]):
        stream = io.BytesIO(data)
        stream.seek(a)
        out += list(ja.read_elements(stream, a, b, first, max_bytes))
    return cuts, out


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(_json, max_size=12), st.sampled_from([None, 0, 2]), st.integers(1, 64))
def test_any_array_cut_anywhere_reads_back_element_for_element(values, indent, partition_bytes):
    data = json.dumps(values, indent=indent, ensure_ascii=False).encode()
    cuts, out = read_all(data, partition_bytes)
    assert [n for n, _ in out] == list(range(1, len(values) + 1))
    assert [json.loads(raw) for _, raw in out] == values
    assert cuts[-1] == (len(data), len(values) + 1)


@settings(max_examples=100, deadline=None)
@given(st.lists(_json, min_size=1, max_size=8), st.integers(2, 40))
def test_oversized_elements_are_reported_by_number_and_size(values, max_bytes):
    data = json.dumps(values).encode()
    _, out = read_all(data, 16, max_bytes)
    for (n, raw), value in zip(out, values):
        size = len(json.dumps(value).encode())
        if size > max_bytes:
            assert isinstance(raw, OversizedRecord) and raw.size >= size
        else:
            assert json.loads(raw) == value


@pytest.mark.parametrize("bad", [b"[1,2", b"[1,,2]", b"{}", b"[1] [2]", b"[,1]", b"[1,]", b"", b"x"])
def test_what_is_not_one_array_is_refused(bad):
    with pytest.raises(ja.ArrayError):
        ja.cut_points(iter([bad]), 4)


def test_reading_a_large_array_holds_one_block_and_one_element(tmp_path):
    element = {"messages": [{"role": "user", "content": "x" * 9000}, {"role": "assistant", "content": "y"}]}
    path = tmp_path / "big.json"
    with open(path, "w") as f:
        f.write("[" + ",\n".join(json.dumps(element) for _ in range(3000)) + "]")  # ~27 MB
    size = path.stat().st_size
    tracemalloc.start()
    with open(path, "rb") as f:
        count = sum(1 for _ in ja.read_elements(f, 0, -1, 1, 64 << 10))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count == 3000 and size > 25 << 20
    assert peak < 12 << 20, f"peak {peak} bytes reading a {size}-byte array"
