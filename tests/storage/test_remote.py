"""Shards read from and written to a real S3 API (moto's server on 127.0.0.1, through a
counting, fault-injecting proxy), via boto3 and via multi-storage-client. The server and the
environment pointing at it are the ``loop`` / ``s3`` / ``bucket`` fixtures of tests/conftest.py."""

import multiprocessing
import os
import pickle
import threading

import numpy as np
import pytest

from bench.s3loop import reset_clients
from conftest import S3_BLOCK_SIZE
from support.shardgen import random_packs, write_shard

from megatron_sft_idx import MMapIndexedDataset, open_packed
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.errors import (ChecksumError, IncompleteShardError, ObjectChangedError, RemoteStorageError,
                                     ShardExistsError, ShardNotFoundError)
from megatron_sft_idx.publishing import publish, upload_shard
from megatron_sft_idx.reader import MMapIndexedDataset as RemoteIndexedDataset

PACK = 256
BLOCK = S3_BLOCK_SIZE  # the `s3` fixture's block size (tests/conftest.py)


def make_shard(path, n=200, seed=0):
    write_shard(str(path), random_packs(np.random.default_rng(seed), n, pack_size=PACK), pack_size=PACK,
                vocab_size=1000)
    return str(path)


@pytest.fixture
def local(tmp_path):
    return make_shard(tmp_path / "local" / "train_000")


def same(a, b):
    return all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- reading


def test_remote_shard_reads_like_local(s3, bucket, local):
    upload_shard(local, f"s3://{bucket}/sft/train_000")
    remote, ref = MMapIndexedDataset(f"s3://{bucket}/sft/train_000"), MMapIndexedDataset(local)
    assert isinstance(remote, RemoteIndexedDataset) and len(remote) == len(ref)
    assert remote.metadata == ref.metadata
    assert np.array_equal(remote.sequence_lengths, ref.sequence_lengths)
    for i in range(len(ref)):
        assert same(remote[i], ref[i]), i
    order = np.random.default_rng(1).permutation(len(ref))
    for got, want in zip(remote.get_many(order), ref.get_many(order)):
        assert same(got, want)
    assert all(same(a, b) for a, b in zip(remote[10:20], ref[10:20]))
    assert same(remote.get(7, 3, 20), ref.get(7, 3, 20))
    assert same(remote[-1], ref[-1])
    clone = pickle.loads(pickle.dumps(remote))  # a worker reopens from the node's cache
    assert same(clone[5], ref[5]) and clone.config == remote.config


def test_a_large_seq_bin_is_read_remotely(s3, bucket, local, monkeypatch):
    monkeypatch.setenv("MEGATRON_SFT_IDX_SEQ_BIN_LIMIT", "0")  # every .seq.bin counts as large
    upload_shard(local, f"s3://{bucket}/q/s")
    remote, ref = MMapIndexedDataset(f"s3://{bucket}/q/s"), MMapIndexedDataset(local)
    assert not os.path.exists(remote.local_index_prefix + ".seq.bin")
    assert all(same(a, b) for a, b in zip(remote.get_many(range(len(ref))), ref))
    assert same(remote[17], ref[17]) and ".seq.bin" in remote.block_stats()


def test_a_pack_costs_at_most_one_request_per_data_file(s3, bucket, local):
    upload_shard(local, f"s3://{bucket}/s")
    remote, ref = MMapIndexedDataset(f"s3://{bucket}/s"), MMapIndexedDataset(local)
    ptr, length = ref.sequence_pointers, ref.sequence_lengths.astype(np.int64)
    straddles = (ptr // BLOCK) != ((ptr + 2 * length - 1) // BLOCK)
    assert straddles.any() and (~straddles).any()
    for i in list(np.flatnonzero(straddles)[:5]) + list(np.flatnonzero(~straddles)[:5]):
        remote.clear_block_cache()
        s3.clear()
        assert same(remote[int(i)], ref[int(i)])
        assert s3.count("GET", "/s.bin") == 1 and s3.count("GET", "/s.loss.bin") == 1
        assert s3.count("GET") == 2
    s3.clear()
    remote[int(np.flatnonzero(~straddles)[0])]  # cached now: no request
    assert s3.count("GET") == 0


def test_msc_profile_reads_and_uploads(s3, bucket, local, tmp_path, monkeypatch):
    monkeypatch.setenv("MSC_CONFIG", s3.msc_config(str(tmp_path / "msc.json"), "loop", bucket))
    upload_shard(local, "msc://loop/msc/train_000")
    remote, ref = MMapIndexedDataset("msc://loop/msc/train_000"), MMapIndexedDataset(local)
    assert len(remote) == len(ref)
    for i in range(len(ref)):
        assert same(remote[i], ref[i])
    # The same objects through boto3: MSC wrote exactly what was asked.
    assert same(MMapIndexedDataset(f"s3://{bucket}/msc/train_000")[3], ref[3])


def test_a_changed_msc_config_is_honoured_in_the_same_process(s3, bucket, local, tmp_path, monkeypatch):
    """MSC caches one client per profile name for the whole process; ours must follow MSC_CONFIG
    (an answer must not depend on which config a previous call in the process used)."""
    other = s3.make_bucket(bucket + "-2")
    monkeypatch.setenv("MSC_CONFIG", s3.msc_config(str(tmp_path / "one.json"), "same", bucket))
    upload_shard(local, "msc://same/x/train_000")
    monkeypatch.setenv("MSC_CONFIG", s3.msc_config(str(tmp_path / "two.json"), "same", other))
    upload_shard(local, "msc://same/y/train_000")
    assert same(MMapIndexedDataset(f"s3://{bucket}/x/train_000")[0], MMapIndexedDataset(local)[0])
    assert same(MMapIndexedDataset(f"s3://{other}/y/train_000")[0], MMapIndexedDataset(local)[0])
    with pytest.raises(ShardError):  # y was written through the second config only
        MMapIndexedDataset(f"s3://{bucket}/y/train_000")


# --------------------------------------------------------------------------- every door takes a URL


def test_open_packed_directories_globs_and_manifests(s3, bucket, tmp_path):
    shards = [make_shard(tmp_path / "stage" / f"train_{k:03d}", n=30, seed=k) for k in range(3)]
    published = publish(shards, f"s3://{bucket}/set", manifest="all.json")
    assert published == [f"s3://{bucket}/set/train_{k:03d}" for k in range(3)]
    want = [p for s in shards for p in MMapIndexedDataset(s)]
    for spec in (f"s3://{bucket}/set/all.json", f"s3://{bucket}/set", f"s3://{bucket}/set/",
                 f"s3://{bucket}/set/train_*", published):
        ds = open_packed(spec)
        assert len(ds) == 90 and all(same(ds[i], want[i]) for i in (0, 31, 89)), spec
    local_manifest = tmp_path / "remote_set.json"
    from megatron_sft_idx.publishing import write_manifest
    write_manifest(str(local_manifest), published)  # a local manifest listing URLs
    ds = open_packed(str(local_manifest))
    assert ds.prefixes == published and same(ds[60], want[60])
    with pytest.raises(ShardNotFoundError):
        open_packed(f"s3://{bucket}/nothing_here")


def test_adapters_train_from_s3(s3, bucket, local, tmp_path):
    torch = pytest.importorskip("torch")
    from megatron_sft_idx.training.bridge import PackedSFTDataset

    upload_shard(local, f"s3://{bucket}/b/train_000")
    remote = PackedSFTDataset(f"s3://{bucket}/b/train_000", max_num_samples=64, pad_to_max_length=True)
    ref = PackedSFTDataset(local, max_num_samples=64, pad_to_max_length=True)
    got, want = remote.collate_fn([remote[i] for i in range(8)]), ref.collate_fn([ref[i] for i in range(8)])
    assert got.keys() == want.keys()
    for key in got:
        assert (got[key] is None and want[key] is None) or torch.equal(torch.as_tensor(got[key]),
                                                                       torch.as_tensor(want[key])), key

    builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron_sft_idx.training import megatron as M

    blend = M.parse_data_path(f"0.5 s3://{bucket}/b/train_000 0.5 {local}")
    config = M.SFTIndexedDatasetConfig(random_seed=3, sequence_length=PACK, blend=blend, split="90,5,5")
    train, _, _ = builder.BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [100, 10, 10],
                                                        lambda: True, config).build()
    a, b = train.datasets
    assert isinstance(a.dataset, RemoteIndexedDataset)
    for k in range(10):
        assert torch.equal(a[k]["tokens"], b[k]["tokens"])  # same shard, same seed, same order

    # megatron-core's own object-storage config has the same meaning here.
    from megatron.core.datasets.object_storage_utils import ObjectStorageConfig
    config = ObjectStorageConfig(path_to_idx_cache=str(tmp_path / "upstream_cache"), bin_chunk_nbytes=8192)
    ds = MMapIndexedDataset(f"s3://{bucket}/b/train_000", object_storage_config=config)
    assert ds.config.block_size == 8192 and ds.local_index_prefix.startswith(str(tmp_path / "upstream_cache"))
    assert same(ds[3], MMapIndexedDataset(local)[3])


def test_publish_to_exact_prefixes_and_directories(s3, bucket, local, tmp_path):
    from megatron_sft_idx.publishing import publish_shard

    ref = MMapIndexedDataset(local)
    for dest in (f"s3://{bucket}/exact/name_a", str(tmp_path / "pub" / "name_b")):
        assert publish_shard(local, dest) == dest
        assert same(MMapIndexedDataset(dest)[9], ref[9])
        with pytest.raises(ShardExistsError):
            publish_shard(local, dest)
        publish_shard(local, dest, replace=True)
    assert os.path.exists(local + ".idx")  # publishing copies: the staged shard stays
    shards = [make_shard(tmp_path / "st" / f"s_{k}", n=10, seed=k) for k in range(2)]
    published = publish(shards, str(tmp_path / "set"), manifest="all.json")
    ds = open_packed(str(tmp_path / "set" / "all.json"))
    assert ds.prefixes == published and same(ds[15], MMapIndexedDataset(shards[1])[5])


# --------------------------------------------------------------------------- one index download per node


def _open_and_read(prefix, env, barrier, out):
    os.environ.update(env)
    barrier.wait()
    ds = MMapIndexedDataset(prefix)
    out.put((len(ds), int(ds[len(ds) - 1].input_ids.sum())))


def test_two_ranks_share_one_index_download(s3, bucket, local):
    upload_shard(local, f"s3://{bucket}/r/s")
    s3.clear()
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    env = {k: os.environ[k] for k in os.environ if k.startswith(("AWS_", "MEGATRON_SFT_IDX_"))}
    procs = [ctx.Process(target=_open_and_read, args=(f"s3://{bucket}/r/s", env, barrier, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    ref = MMapIndexedDataset(local)
    assert results == [(len(ref), int(ref[len(ref) - 1].input_ids.sum()))] * 2
    for suffix in (".idx", ".seq.idx", ".seq.bin"):
        assert s3.count("GET", "/s" + suffix) == 1, suffix  # one downloader, the other waited


def test_dataloader_workers_share_index_downloads(s3, bucket, tmp_path):
    torch = pytest.importorskip("torch")
    shards = [make_shard(tmp_path / "st" / f"p_{k}", n=40, seed=k) for k in range(2)]
    publish(shards, f"s3://{bucket}/dl", manifest="m.json")
    s3.clear()
    ds = open_packed(f"s3://{bucket}/dl/m.json")  # shards open lazily, in the workers
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, shuffle=True,
                                         collate_fn=lambda pack: int(pack.input_ids.sum()),
                                         persistent_workers=True,
                                         generator=torch.Generator().manual_seed(0))
    got = sorted(loader)
    want = sorted(int(p.input_ids.sum()) for s in shards for p in MMapIndexedDataset(s))
    assert got == want
    for k in range(2):
        for suffix in (".idx", ".seq.idx"):
            assert s3.count("GET", f"/p_{k}{suffix}") == 1, (k, suffix)


class _Probe:
    """A pack's sums plus the identity of the store (client) that served it, in this process."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        pack = self.ds[i]
        return int(pack.input_ids.sum()), int(pack.loss_mask.sum()), id(self.ds._tokens.store())


def test_forked_workers_use_their_own_connections(s3, bucket, local):
    torch = pytest.importorskip("torch")
    upload_shard(local, f"s3://{bucket}/fork/s")
    ds = MMapIndexedDataset(f"s3://{bucket}/fork/s")
    ds[0]  # the parent has mapped the shard and holds pooled connections when the workers fork
    parent_store = id(ds._tokens.store())
    ds.clear_block_cache()
    loader = torch.utils.data.DataLoader(_Probe(ds), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    got = list(loader)
    ref = MMapIndexedDataset(local)
    assert [tuple(g[:2]) for g in got] == [(int(p.input_ids.sum()), int(p.loss_mask.sum())) for p in ref]
    assert parent_store not in {g[2] for g in got}  # every worker read through a client of its own


# --------------------------------------------------------------------------- faults


def test_resets_500s_and_throttling_are_retried(s3, bucket, local):
    upload_shard(local, f"s3://{bucket}/f/s")
    s3.inject("503", lambda m, k, h: m == "GET" and "list-type" not in k and k.endswith(".seq.idx"))
    s3.inject("reset", lambda m, k, h: m == "GET" and k.endswith("/s.bin"), times=2)
    s3.inject("500", lambda m, k, h: m == "GET" and k.endswith(".loss.bin"), times=2)
    s3.inject("truncate", lambda m, k, h: m == "GET" and k.endswith("/s.bin"), times=1)
    remote, ref = MMapIndexedDataset(f"s3://{bucket}/f/s"), MMapIndexedDataset(local)
    for i in range(len(ref)):
        assert same(remote[i], ref[i])
    assert s3.injected == {"503": 1, "reset": 2, "500": 2, "truncate": 1}


def test_retries_exhausted_name_the_object(s3, bucket, local):
    upload_shard(local, f"s3://{bucket}/g/s")
    remote = MMapIndexedDataset(f"s3://{bucket}/g/s")
    s3.inject("500", lambda m, k, h: m == "GET" and k.endswith("/g/s.bin"), times=100)
    with pytest.raises(RemoteStorageError, match=r"s3://.*/g/s\.bin.*after 4 attempts.*InternalError"):
        remote[0]
    assert s3.injected["500"] == 4
    s3.clear()
    assert same(remote[0], MMapIndexedDataset(local)[0])  # the store recovered: so does the reader


def test_idx_uploaded_without_its_bin_does_not_open(s3, bucket, local):
    client = s3.client()
    for suffix in (".idx", ".seq.idx", ".seq.bin", ".loss.bin"):
        with open(local + suffix, "rb") as f:
            client.put_object(Bucket=bucket, Key="h/s" + suffix, Body=f.read())
    with pytest.raises(IncompleteShardError, match=r"\.bin is missing"):
        MMapIndexedDataset(f"s3://{bucket}/h/s")
    with open(local + ".bin", "rb") as f:
        client.put_object(Bucket=bucket, Key="h/s.bin", Body=f.read())
    client.delete_object(Bucket=bucket, Key="h/s.loss.bin")
    with pytest.raises(IncompleteShardError, match="companions"):
        MMapIndexedDataset(f"s3://{bucket}/h/s")


def test_an_object_not_matching_the_metadata_is_refused(s3, bucket, local):
    client = s3.client()
    for suffix in (".bin", ".loss.bin", ".seq.bin", ".seq.idx", ".idx"):
        with open(local + suffix, "rb") as f:
            data = bytearray(f.read())
        if suffix == ".seq.bin":
            data[4] ^= 1  # same size, one bit flipped
        client.put_object(Bucket=bucket, Key="c/s" + suffix, Body=bytes(data))
    with pytest.raises(ChecksumError, match=r"s3://.*/c/s\.seq\.bin.*CRC-32"):
        MMapIndexedDataset(f"s3://{bucket}/c/s")
    assert s3.count("GET", "/c/s.seq.bin") == 2  # downloaded again once before refusing


def test_a_replaced_shard_is_never_mixed_in(s3, bucket, local, tmp_path):
    url = f"s3://{bucket}/x/s"
    upload_shard(local, url)
    old = MMapIndexedDataset(url)
    old_dir = os.path.dirname(old.local_index_prefix)
    assert same(old[0], MMapIndexedDataset(local)[0])
    newer = make_shard(tmp_path / "v2" / "s", n=150, seed=99)
    with pytest.raises(ShardExistsError):
        upload_shard(newer, url)
    upload_shard(newer, url, replace=True)
    old.clear_block_cache()
    with pytest.raises(ObjectChangedError, match="changed since"):
        old[1]  # its ETag no longer matches: refused, never a pack of the new generation
    fresh = MMapIndexedDataset(url)
    assert len(fresh) == 150 and same(fresh[149], MMapIndexedDataset(newer)[149])
    assert os.path.dirname(fresh.local_index_prefix) != old_dir and not os.path.exists(old_dir)


def test_multipart_upload_puts_idx_last_and_readers_never_see_half(s3, bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_SFT_IDX_PART_SIZE", "5M")
    reset_clients()
    big = str(tmp_path / "big" / "s")
    rng = np.random.default_rng(5)
    write_shard(big, random_packs(rng, 1600, pack_size=2048, vocab=60000, full=True), pack_size=2048, vocab_size=60000)
    assert os.path.getsize(big + ".bin") > 5 << 20
    url = f"s3://{bucket}/big/s"
    seen, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            try:
                ds = MMapIndexedDataset(url)
                seen.append(("open", len(ds)))
            except (ShardNotFoundError, IncompleteShardError) as exc:
                seen.append(("refused", type(exc).__name__))

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        upload_shard(big, url)
    finally:
        stop.set()
        reader.join()
    puts = [(m, k) for m, k, _, _ in s3.requests if m in ("PUT", "POST")]
    assert puts[-1][1].endswith("/big/s.idx")
    assert any(m == "POST" for m, _ in puts) and s3.count("PUT", "/big/s.bin") >= 2  # parts
    assert all(what == "refused" or n == 1600 for what, n in seen)
    assert len(MMapIndexedDataset(url)) == 1600


def test_block_local_order_fetches_each_block_once_per_epoch(s3, bucket, local, monkeypatch):
    from megatron_sft_idx.locality import BlockLocalOrder

    monkeypatch.setenv("MEGATRON_SFT_IDX_CACHE_BLOCKS", "2")
    url = f"s3://{bucket}/o/s"
    upload_shard(local, url)
    remote, ref = MMapIndexedDataset(url), MMapIndexedDataset(local)
    n = len(remote)
    blocks = len(np.unique(ref.sequence_pointers // BLOCK))  # blocks where packs start
    fetched = {}
    for name, order in (("block_local", BlockLocalOrder(window=2)(remote, np.arange(n), np.random.RandomState(0))),
                        ("shuffle", np.random.RandomState(0).permutation(n))):
        remote.clear_block_cache()
        s3.clear()
        for i in order.tolist():
            assert same(remote[i], ref[i])
        fetched[name] = s3.count("GET", "/o/s.bin")
    assert fetched["block_local"] == blocks  # each block once per epoch
    assert fetched["shuffle"] >= 3 * fetched["block_local"]


# --------------------------------------------------------------------------- the gate and promotion


def _put_raw(client, bucket, prefix, key):
    for suffix in (".bin", ".loss.bin", ".seq.bin", ".seq.idx", ".idx"):
        with open(prefix + suffix, "rb") as f:
            client.put_object(Bucket=bucket, Key=key + suffix, Body=f.read())


def _codes(report):
    return sorted((f.code, f.pack) for f in report.shards[0].findings if f.severity == "error")


@pytest.mark.parametrize("case", ["clean", "loss_two", "loss_on_last_sealed", "start_decreasing", "bin_flip",
                                  "stats_edit"])
def test_remote_gate_finds_what_the_local_gate_finds(s3, bucket, tmp_path, case, monkeypatch):
    from support import corrupt
    from megatron_sft_idx.gate import check
    from megatron_sft_idx.gate import remote as gate_remote

    monkeypatch.setattr(gate_remote, "CHUNK_TOKENS", 1500)  # many chunks: findings across chunk edges
    prefix = make_shard(tmp_path / case / "s", n=120, seed=4)
    edit = {"loss_two": corrupt.loss_two, "loss_on_last_sealed": corrupt.sealed(corrupt.loss_on_last),
            "start_decreasing": corrupt.start_decreasing,
            "bin_flip": lambda p, d: corrupt.flip(p + ".bin", 4001),
            "stats_edit": lambda p, d: corrupt.reseal(p, edit=lambda m: m["stats"].update(dataset_max_seqlen=1)),
            }.get(case)
    if edit:
        edit(prefix, str(tmp_path / case))
    _put_raw(s3.client(), bucket, prefix, f"gate/{case}")
    s3.clear()
    local, remote = check(prefix, level="deep"), check(f"s3://{bucket}/gate/{case}", level="deep")
    assert remote.passed == local.passed == (case == "clean")
    assert _codes(remote) == _codes(local) and (case == "clean" or _codes(local))
    assert "packs+checksums (streamed)" in remote.shards[0].checks
    assert s3.count("GET", f"/gate/{case}.bin") >= 2  # streamed in chunks, never one whole download


def test_check_idx_promotes_into_a_bucket(s3, bucket, tmp_path):
    from megatron_sft_idx.gate.cli import main

    staging = tmp_path / "staging"
    make_shard(staging / "train_000", n=50, seed=1)
    ref = [np.array(p.input_ids) for p in MMapIndexedDataset(str(staging / "train_000"))]
    assert main([str(staging), "--promote", f"s3://{bucket}/train", "--quiet"]) == 0
    assert not os.path.exists(staging / "train_000.idx")  # moved, as a local promotion moves
    promoted = MMapIndexedDataset(f"s3://{bucket}/train/train_000")
    assert all(np.array_equal(promoted[i].input_ids, ref[i]) for i in range(50))
    assert main([f"s3://{bucket}/train/train_000", "--quiet"]) == 0  # the gate reads it in place
    make_shard(staging / "train_000", n=20, seed=2)
    assert main([str(staging), "--promote", f"s3://{bucket}/train", "--quiet"]) == 1  # exists: refused
    assert len(MMapIndexedDataset(f"s3://{bucket}/train/train_000")) == 50
