"""Parquet list columns whose values are not token ids (issue 21, item 6): a null inside a list,
or a value outside the dtype it is stored in, is refused naming the file, the row and the column
-- never read as token 0 (numpy's cast of a null), never wrapped into a valid-looking value.

A family over the columns x faults x entry points: ``open_packed`` and ``convert-packed`` on
Bridge-style packed Parquet (``input_ids``, ``loss_mask``, ``seq_start_id``), and
``preprocess-sft`` on pre-tokenized Parquet (``input_ids``, ``loss_mask``), where a bad record
is a ``file:row`` InputError, or skipped and counted under ``--skip-bad``.
"""

import os
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess.records.errors import InputError
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.tools.convert_cli import main as convert_main
from megatron_sft_idx.open import open_packed

GOOD = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 0], "seq_start_id": [0, 2]}
TYPES = {"input_ids": pa.int64(), "loss_mask": pa.int64(), "seq_start_id": pa.int64()}

#: fault -> (the value put in the bad row's list, its Arrow value type, the words the error says)
FAULTS = {
    "null": (None, None, "holds a null"),
    "over the dtype": ({"input_ids": 2 ** 31, "loss_mask": 256, "seq_start_id": 2 ** 32 + 2}, None, "outside"),
    "uint64 past int64": (2 ** 64 - 1, pa.uint64(), "outside"),
    "negative": ({"input_ids": -1, "loss_mask": -1, "seq_start_id": -(2 ** 31) - 1}, None, "outside"),
}


def write(path, column, fault, rows=7, bad_row=5, row_group_size=2):
    """``rows`` good packs, with row ``bad_row``'s ``column`` holding the fault at position 1."""
    value, arrow_type, _ = FAULTS[fault]
    value = value[column] if isinstance(value, dict) else value
    data = {k: [list(v) for _ in range(rows)] for k, v in GOOD.items()}
    data[column][bad_row][1] = value
    types = dict(TYPES, **({column: arrow_type} if arrow_type else {}))
    pq.write_table(pa.table({k: pa.array(v, pa.list_(types[k])) for k, v in data.items()}), path,
                   row_group_size=row_group_size)
    return str(path)


CASES = [(c, f) for c in GOOD for f in FAULTS if not (f == "uint64 past int64" and c == "seq_start_id")]


@pytest.mark.parametrize("column,fault", CASES)
def test_open_packed_refuses_a_null_or_unfit_value_naming_file_row_and_column(tmp_path, column, fault):
    path = write(tmp_path / "p.parquet", column, fault)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (a numpy cast of a null warns: it must never be reached)
        with pytest.raises(ShardError) as e:
            open_packed(path)
    assert e.value.path == path and e.value.field == column and e.value.pack == 5, e.value
    assert f"row 5 of column '{column}'" in str(e.value) and FAULTS[fault][2] in str(e.value)


@pytest.mark.parametrize("column,fault", CASES)
def test_convert_packed_refuses_it_and_writes_nothing(tmp_path, capsys, column, fault):
    path = write(tmp_path / "p.parquet", column, fault)
    assert convert_main([path, str(tmp_path / "out" / "ds"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"{path}: row 5 of column '{column}'" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == []


def test_the_good_file_converts(tmp_path):
    """(The family's control: the same file without the fault is accepted.)"""
    data = {k: [list(v) for _ in range(7)] for k, v in GOOD.items()}
    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({k: pa.array(v, pa.list_(TYPES[k])) for k, v in data.items()}), path, row_group_size=2)
    assert len(open_packed(path)) == 7


TOKEN_RECORDS = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}


@pytest.mark.parametrize("column", sorted(TOKEN_RECORDS))
@pytest.mark.parametrize("fault", ["null", "uint64 past int64", "over the dtype"])
def test_preprocess_refuses_pretokenized_parquet_records_by_row_or_counts_them(tmp_path, column, fault):
    value, arrow_type, _ = FAULTS[fault]
    value = 2 ** 40 if isinstance(value, dict) else value
    data = {k: [list(v) for _ in range(6)] for k, v in TOKEN_RECORDS.items()}
    data[column][3][1] = value
    types = {k: arrow_type if (k == column and arrow_type) else pa.int64() for k in data}
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({k: pa.array(v, pa.list_(types[k])) for k, v in data.items()}), path, row_group_size=2)
    cfg = dict(inputs=[path], vocab_size=1000, input_format="tokens", pad_id=0, pack_size=64, progress=False)
    with pytest.raises(InputError) as e:
        run(Config(output_prefix=str(tmp_path / "a" / "ds"), **cfg))
    assert str(e.value).startswith(f"{path}:4: ") and e.value.field == column, e.value
    s = run(Config(output_prefix=str(tmp_path / "b" / "ds"), skip_bad=True, **cfg))
    assert s["conversations"] == 5 and sum(s["skipped"].values()) == 1
