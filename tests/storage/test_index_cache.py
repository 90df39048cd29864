"""The index cache of remote shards trusts nothing it wrote earlier (moto's S3 server on loopback,
the ``s3`` / ``bucket`` fixtures of tests/conftest.py).

An entry edited after its verified download — any cached file, one byte, size kept, mtime
restored as ``cp -p`` / ``rsync -t`` would — is re-verified when reused and downloaded again;
so is an entry whose receipt is malformed in any field (each one refused by name by the strict
parser). The packs served afterwards are the shard's. A process verifies a file once while
its identity is unchanged, and not again when it reopens the shard.
"""

import json
import os

import numpy as np
import pytest

from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.errors import MetadataError
from megatron_sft_idx.publishing import upload_shard
from megatron_sft_idx.storage import index_cache
from megatron_sft_idx.storage.index_cache import RECEIPT, parse_receipt


def make_shard(path, n=120, seed=0):
    packs = random_packs(np.random.default_rng(seed), n, pack_size=256)
    write_shard(str(path), packs, pack_size=256, vocab_size=1000)
    return str(path)


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)
                                    and np.array_equal(x.seq_start_id, y.seq_start_id)
                                    for x, y in zip(a.get_many(range(len(a))), b.get_many(range(len(b)))))


@pytest.fixture
def remote(s3, bucket, tmp_path):
    local = make_shard(tmp_path / "local" / "s")
    url = f"s3://{bucket}/c/s"
    upload_shard(local, url)
    ds = MMapIndexedDataset(url)
    return url, local, ds.local_index_prefix


def edit_in_place(path, offset):
    """Flip one byte, keeping the size and the mtime (as cp -p or rsync -t leave a file)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x20]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(path) == st.st_size


@pytest.mark.parametrize("suffix,where", [(".idx", "last"), (".idx", "header"), (".seq.idx", "last"),
                                          (".seq.idx", "metadata"), (".seq.bin", "last")])
def test_an_entry_edited_after_its_download_is_downloaded_again(s3, remote, suffix, where):
    url, local, cached = remote
    path = cached + suffix
    offset = {"last": os.path.getsize(path) - 1, "header": 20, "metadata": 200}[where]
    before = open(path, "rb").read()
    edit_in_place(path, offset)
    s3.clear()
    assert same(MMapIndexedDataset(url), MMapIndexedDataset(local))
    assert s3.count("GET", "/c/s" + suffix) == 1  # that file fetched again, the entry repaired
    assert open(path, "rb").read() == before


def test_a_pretrain_idx_is_verified_by_its_receipt(s3, bucket, tmp_path):
    """No metadata covers a pretrain .idx: the CRC-32 its receipt recorded at download does."""
    local = str(tmp_path / "pre")
    _write_pretrain(local)
    url = f"s3://{bucket}/pre/s"
    client = s3.client()
    for suffix in (".bin", ".idx"):
        client.put_object(Bucket=bucket, Key="pre/s" + suffix, Body=open(local + suffix, "rb").read())
    ds = MMapIndexedDataset(url)
    path = ds.local_index_prefix + ".idx"
    edit_in_place(path, os.path.getsize(path) - 1)
    s3.clear()
    again = MMapIndexedDataset(url)
    assert s3.count("GET", "/pre/s.idx") == 1
    assert np.array_equal(again.sequence_lengths, MMapIndexedDataset(local).sequence_lengths)


def _write_pretrain(prefix):
    """A pretrain .bin/.idx pair (upstream MMIDIDX v1, no SFT companions)."""
    from megatron_sft_idx.format import DType, IdxHeader

    lengths = np.array([5, 9, 3], np.int32)
    np.arange(lengths.sum(), dtype=np.uint16).tofile(prefix + ".bin")
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1]) * 2]).astype(np.int64)
    docs = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(IdxHeader(int(DType.from_numpy(np.uint16)), len(lengths), len(docs)).pack())
        f.write(lengths.tobytes() + pointers.tobytes() + docs.tobytes())


# --------------------------------------------------------------------------- the receipt


def _mutations():
    def drop(field):
        return lambda d: d.pop(field)

    def set_(path, value):
        def edit(d):
            *head, last = path
            for k in head:
                d = d[k]
            d[last] = value
        return edit

    return {
        "format": (set_(["format"], "other"), "format"),
        "version 1": (set_(["version"], 1), "version"),
        "version as text": (set_(["version"], "2"), "version"),
        "version as bool": (set_(["version"], True), "version"),
        "missing url": (drop("url"), "url"),
        "extra field": (set_(["extra"], 1), "extra"),
        "url type": (set_(["url"], 7), "url"),
        "generation": (set_(["generation"], "zz"), "generation"),
        "objects type": (set_(["objects"], []), "objects"),
        "object suffix": (set_(["objects", ".npy"], {"size": 1, "etag": ""}), "objects..npy"),
        "object size text": (set_(["objects", ".bin", "size"], "10"), "objects..bin.size"),
        "object size negative": (set_(["objects", ".bin", "size"], -1), "objects..bin.size"),
        "object etag type": (set_(["objects", ".bin", "etag"], 5), "objects..bin.etag"),
        "object extra key": (set_(["objects", ".bin", "x"], 5), "objects..bin.x"),
        "file size": (lambda d: d["files"][".idx"].update(size=d["files"][".idx"]["size"] + 1), "files..idx.size"),
        "file crc range": (set_(["files", ".idx", "crc32"], 1 << 32), "files..idx.crc32"),
        "file crc float": (set_(["files", ".idx", "crc32"], 1.5), "files..idx.crc32"),
        "file missing key": (lambda d: d["files"][".idx"].pop("crc32"), "files..idx.crc32"),
    }


MUTATIONS = _mutations()


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_a_malformed_receipt_is_refused_by_field_and_the_entry_redone(s3, remote, case):
    url, local, cached = remote
    path = os.path.join(os.path.dirname(cached), RECEIPT)
    doc = json.load(open(path))
    edit, field = MUTATIONS[case]
    edit(doc)
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(MetadataError) as info:
        parse_receipt(path)
    assert info.value.field == field and info.value.path == path, info.value
    s3.clear()
    assert same(MMapIndexedDataset(url), MMapIndexedDataset(local))
    assert s3.count("GET", "/c/s.seq.idx") == 1  # downloaded again
    parse_receipt(path)  # and committed with a good receipt


NOT_RECEIPTS = {"not json": b"{", "not utf-8": b"\xff\xfe{}", "a list": b"[]", "huge": b" " * (1 << 17) + b"{}",
                "empty": b"", "NaN": b'{"version": NaN}',
                # deeper than Python's parser can recurse (was a RecursionError on every later open)
                "deep": b"[" * 30_000 + b"]" * 30_000,
                "deep in a field": b'{"format": ' + b"{\"a\":" * 5_000 + b"1" + b"}" * 5_000 + b"}",
                # deeper than the metadata limit, shallow enough to parse
                "nested beyond the limit": b'{"objects": ' + b"[" * 70 + b"]" * 70 + b"}"}


@pytest.mark.parametrize("case", sorted(NOT_RECEIPTS))
def test_a_receipt_that_is_not_one(s3, remote, case):
    url, local, cached = remote
    path = os.path.join(os.path.dirname(cached), RECEIPT)
    with open(path, "wb") as f:
        f.write(NOT_RECEIPTS[case])
    with pytest.raises(MetadataError) as info:
        parse_receipt(path)
    assert info.value.path == path and info.value.field in ("json", "size", "receipt"), info.value
    s3.clear()
    assert same(MMapIndexedDataset(url), MMapIndexedDataset(local))
    assert s3.count("GET", "/c/s.seq.idx") == 1  # a corrupt entry: downloaded again, not a traceback
    parse_receipt(path)  # and committed with a good receipt


@pytest.mark.parametrize("case", ["url", "generation", "objects", "crc32", "files"])
def test_a_receipt_of_another_entry_is_not_trusted(s3, remote, case):
    """Well formed, but describing another URL, generation, listing or file: redone."""
    url, local, cached = remote
    path = os.path.join(os.path.dirname(cached), RECEIPT)
    doc = json.load(open(path))
    if case == "url":
        doc["url"] = url + "x"
    elif case == "generation":
        doc["generation"] = "0" * 16
    elif case == "objects":
        doc["objects"][".bin"]["etag"] = '"other"'
    elif case == "crc32":
        doc["files"][".idx"]["crc32"] ^= 1
    else:
        doc["files"].pop(".seq.bin")
    with open(path, "w") as f:
        json.dump(doc, f)
    parse_receipt(path)  # well formed
    s3.clear()
    assert same(MMapIndexedDataset(url), MMapIndexedDataset(local))
    assert s3.count("GET", "/c/s.idx") == 1
    assert json.load(open(path))["url"] == url


@pytest.mark.parametrize("case", ["deleted", "truncated", "receipt deleted"])
def test_a_damaged_entry_is_downloaded_again(s3, remote, case):
    url, local, cached = remote
    if case == "deleted":
        os.unlink(cached + ".seq.bin")
    elif case == "truncated":
        os.truncate(cached + ".idx", os.path.getsize(cached + ".idx") - 8)
    else:
        os.unlink(os.path.join(os.path.dirname(cached), RECEIPT))
    assert same(MMapIndexedDataset(url), MMapIndexedDataset(local))


def test_a_process_verifies_a_file_once_while_it_is_unchanged(s3, remote, monkeypatch):
    url, local, cached = remote
    calls = []
    real = index_cache._file_crc
    monkeypatch.setattr(index_cache, "_file_crc", lambda fd, *a, **k: calls.append(fd) or real(fd, *a, **k))
    MMapIndexedDataset(url)
    MMapIndexedDataset(url)
    assert calls == []  # verified at download, in this process
    index_cache._VERIFIED.clear()  # as a new process (another rank, a spawned worker) starts
    MMapIndexedDataset(url)
    assert len(calls) == 3  # .seq.idx body, .idx, .seq.bin: once each
    MMapIndexedDataset(url)
    assert len(calls) == 3
    edit_in_place(cached + ".seq.bin", 0)
    MMapIndexedDataset(url)
    assert len(calls) > 3  # its identity changed (ctime): verified again, then downloaded again
