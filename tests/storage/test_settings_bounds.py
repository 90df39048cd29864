"""Every size, count and duration setting refuses a value out of its range -- ``inf``, ``nan``,
``1e999``, negative, absurd -- in one line naming the variable or the flag, never an
``OverflowError`` traceback (issue 30, item 3): the ``MEGATRON_SFT_IDX_*`` environment variables
of the remote read path (docs/STORAGE.md) and the commands' size and duration flags."""

import os
import re

import numpy as np
import pytest

from support.shardgen import random_packs, write_shard

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.publishing import upload_shard
from megatron_sft_idx.storage import StorageConfig
from megatron_sft_idx.storage.config import ENV_PREFIX, ENV_VARS, RANGES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "megatron_sft_idx")
#: Variables that hold no number: a directory, a switch, a library path.
NOT_NUMBERS = {"CACHE", "CRC", "NATIVE", "NATIVE_LIB", "TOKENIZER_PATH"}
BAD = ["inf", "-inf", "nan", "1e999", "-1", "99999999999999999999999999999", "1" + "0" * 400, "lots", "0x10"]


def test_every_numeric_variable_of_the_package_is_a_bounded_setting():
    names = set()
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    names |= set(re.findall(r"MEGATRON_SFT_IDX_([A-Z][A-Z_]*[A-Z])", f.read()))
    assert names - NOT_NUMBERS == set(ENV_VARS), "a new MEGATRON_SFT_IDX_ variable: give it a range in RANGES"
    assert set(ENV_VARS.values()) == set(RANGES)


@pytest.fixture
def clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(ENV_PREFIX + var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("var", sorted(ENV_VARS))
def test_a_variable_out_of_range_is_one_line_naming_it(clean_env, var, value):
    clean_env.setenv(ENV_PREFIX + var, value)
    with pytest.raises(ShardError) as info:
        StorageConfig.resolve()
    assert info.value.field == ENV_PREFIX + var
    assert str(info.value).startswith(ENV_PREFIX + var) and "\n" not in str(info.value)


@pytest.mark.parametrize("var", sorted(ENV_VARS))
def test_each_variable_takes_its_bounds_and_refuses_past_them(clean_env, var):
    name = ENV_VARS[var]
    kind, least, most = RANGES[name]
    good = [most] + ([least] if kind != "seconds" and (name != "block_size" or least % 4096 == 0) else [0.5])
    for value in good:
        clean_env.setenv(ENV_PREFIX + var, str(value))
        assert getattr(StorageConfig.resolve(), name) == value
    over = most * 2 if kind == "size" else most + 1
    for value in [over, least - 1 if kind != "seconds" else 0]:
        clean_env.setenv(ENV_PREFIX + var, str(value))
        with pytest.raises(ShardError, match=f"^{ENV_PREFIX + var} "):
            StorageConfig.resolve()


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1, 10 ** 30, True])
@pytest.mark.parametrize("name", sorted(RANGES))
def test_an_argument_out_of_range_is_refused_naming_it(clean_env, name, value):
    with pytest.raises(ShardError) as info:
        StorageConfig.resolve(**{name: value})
    assert info.value.field == name


@pytest.mark.remote
@pytest.mark.parametrize("value", ["inf", "1e999"])
def test_the_reader_and_the_gate_name_the_variable(s3, bucket, tmp_path, monkeypatch, capsys, value):
    from megatron_sft_idx import MMapIndexedDataset
    from megatron_sft_idx.gate.cli import main

    local = str(tmp_path / "s")
    write_shard(local, random_packs(np.random.default_rng(0), 8, pack_size=64, vocab=500), pack_size=64, vocab_size=500)
    url = f"s3://{bucket}/d/s"
    upload_shard(local, url)
    monkeypatch.setenv(ENV_PREFIX + "BLOCK_SIZE", value)
    with pytest.raises(ShardError, match=f"^{ENV_PREFIX}BLOCK_SIZE is not a size"):
        MMapIndexedDataset(url)
    capsys.readouterr()
    code = main([url])
    out, err = capsys.readouterr()
    assert code != 0 and "Traceback" not in out + err and "OverflowError" not in out + err
    assert f"{ENV_PREFIX}BLOCK_SIZE" in out + err


SIZE_FLAGS = ["--max-shard-bytes", "--max-record-bytes", "--partition-bytes"]


@pytest.mark.parametrize("value", ["inf", "nan", "1e999", "-1", "9" * 400, "9" * 400 + "P", "2000P"])
@pytest.mark.parametrize("flag", SIZE_FLAGS + ["--log-interval"])
def test_a_size_or_duration_flag_out_of_range_is_a_usage_error(capsys, flag, value):
    from megatron_sft_idx.preprocess.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--input", "x.jsonl", "--tokenizer", "t", "--output-prefix", "o", flag, value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and flag in err and "Traceback" not in err


def test_the_flags_still_take_sizes_and_seconds():
    from megatron_sft_idx.preprocess.cli import build_parser

    args = build_parser().parse_args(["--input", "x.jsonl", "--tokenizer", "t", "--output-prefix", "o",
                                      "--max-shard-bytes", "1.5G", "--log-interval", "0.5"])
    assert args.max_shard_bytes == int(1.5 * (1 << 30)) and args.log_interval == 0.5
