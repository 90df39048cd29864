"""release_pages() bounds a long scan's RSS: mapped pages leave the process, the data stays readable."""

import sys

import numpy as np
import pytest

from megatron_sft_idx import MMapIndexedDataset
from support.shardgen import random_packs, write_shard


def rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    raise RuntimeError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_release_pages_drops_resident_pages_and_keeps_data(tmp_path, rng):
    packs = random_packs(rng, 64, pack_size=1024, vocab=30000, full=True)
    prefix = str(tmp_path / "s")
    write_shard(prefix, packs * 40, pack_size=1024, vocab_size=30000)  # ~7.5 MiB of data
    ds = MMapIndexedDataset(prefix)
    arrays = ds.arrays()
    before = rss_file_kib()
    checksum = int(arrays.tokens.sum()) + int(arrays.loss_mask.sum())  # fault every page in
    touched = rss_file_kib()
    assert touched - before > 6 * 1024
    ds.release_pages()
    assert rss_file_kib() < touched - 6 * 1024
    assert int(arrays.tokens.sum()) + int(arrays.loss_mask.sum()) == checksum
    np.testing.assert_array_equal(ds[65].input_ids, packs[1][0])
