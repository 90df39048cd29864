"""The Megatron-Bridge provider, its snippet in docs/TRAINING.md and ``examples/bridge_sft.py`` in
this environment, where Megatron-Bridge is not installed: the provider must build the same
datasets and batches as :func:`bridge_datasets` with the same options. Against the installed
Bridge (its ``DatasetProvider``, its loader, its own reader over the same packs):
``tests/compat/test_bridge_example.py``."""

import copy
import dataclasses
import os
import pickle
import subprocess
import sys

import numpy as np

import pytest

from support.bridge_doc import DOC_BATCH_KEYS, doc_provider_snippet
from support.shardgen import random_packs, write_shard

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.locality import BlockLocalOrder
from megatron_sft_idx.training import bridge_provider
from megatron_sft_idx.training.bridge import bridge_datasets, build_samples_mapping
from megatron_sft_idx.training.bridge_provider import PackedSFTDatasetProvider, build_context
from megatron_sft_idx.training.collate import installed_bridge_semantics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "bridge_sft.py")


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("provider") / "out" / "demo" / "training" / "example")
    os.makedirs(os.path.dirname(prefix))
    write_shard(prefix, random_packs(np.random.default_rng(5), 30, pack_size=256, max_seqs=5), pack_size=256)
    return prefix


def assert_batches_equal(a, b):
    assert set(a) == set(b)
    for key in a:
        if hasattr(a[key], "dtype"):
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
            assert (a[key] == b[key]).all(), key
        else:
            assert a[key] == b[key], key


class Tokenizer:
    eos_id = 3


@pytest.mark.parametrize("options", [dict(), dict(pad_to_max_length=True, pad_cu_seqlens=True, seed=7),
                                     dict(pad_to_max_length=True, dataset_kwargs={"answer_only_loss": False}),
                                     dict(dataset_kwargs={"bridge_semantics": "pr5610"})])
def test_provider_builds_what_bridge_datasets_builds(shard, options):
    provider = PackedSFTDatasetProvider(train_path=shard, valid_path=shard, seq_length=256, **options)
    context = build_context(train_samples=50, valid_samples=12, test_samples=0, tokenizer=Tokenizer())
    got = provider.build_datasets(context)
    extra = dict(options.pop("dataset_kwargs", {}))
    want = bridge_datasets(context, train=shard, valid=shard, max_seq_length=256, **options, **extra)
    assert got[2] is None and want[2] is None
    for ours, ref in zip(got[:2], want[:2]):
        assert len(ours) == len(ref) and ours.collate_fn.eos_id == Tokenizer.eos_id
        assert ours.collate_fn.bridge_semantics == extra.get("bridge_semantics", installed_bridge_semantics())
        assert np.array_equal(ours.samples_mapping, ref.samples_mapping)
        for rows in ([0], [1, 4, 2], [-1, 3]):
            assert_batches_equal(ours.collate_fn([ours[i] for i in rows]), ref.collate_fn([ref[i] for i in rows]))
    assert np.array_equal(got[0].samples_mapping,
                          build_samples_mapping(30, 50, options.get("seed", 1234)))
    assert ("pad_between_seqs" in got[0].collate_fn([got[0][0]])) == (extra.get("bridge_semantics") == "pr5610")


def test_provider_options_reach_the_dataset(shard):
    provider = PackedSFTDatasetProvider(train_path=shard, seq_length=512, eos_id=9, block_local_window=2)
    train, valid, test = provider.build_datasets(build_context(40, tokenizer=Tokenizer()))
    assert valid is None and test is None
    assert train.collate_fn.eos_id == 9 and train.max_seq_length == 512  # the field wins over the tokenizer
    order = BlockLocalOrder(window=2)
    assert np.array_equal(train.samples_mapping, build_samples_mapping(30, 40, 1234, order, train.source))


def test_provider_refuses_a_seq_length_that_is_not_a_positive_int(shard):
    for bad in (0, -4, True, "4096", None, 4096.0):
        with pytest.raises(ShardError, match="seq_length must be a positive integer") as info:
            PackedSFTDatasetProvider(train_path=shard, seq_length=bad)
        assert info.value.field == "seq_length"


def test_offline_packing_specs_follow_the_fields(shard):
    provider = PackedSFTDatasetProvider(train_path=shard, seq_length=256)
    assert provider.enable_offline_packing is True
    assert (provider.offline_packing_specs.packed_sequence_size, provider.offline_packing_specs.pad_cu_seqlens,
            provider.offline_packing_specs.pad_seq_to_mult) == (256, False, 1)
    provider.pad_cu_seqlens, provider.pad_seq_to_mult, provider.seq_length = True, 4, 1024  # a recipe edits fields
    assert (provider.offline_packing_specs.packed_sequence_size, provider.offline_packing_specs.pad_cu_seqlens,
            provider.offline_packing_specs.pad_seq_to_mult) == (1024, True, 4)


def test_provider_is_a_config_bridge_can_copy_and_finalize(shard):
    provider = PackedSFTDatasetProvider(train_path=[shard, shard], seq_length=256, num_workers=0)
    assert provider.dataloader_type == "batch" and provider.persistent_workers is True
    provider.finalize()
    assert provider.persistent_workers is False  # no workers, nothing to persist
    for twin in (copy.deepcopy(provider), pickle.loads(pickle.dumps(provider)),
                 dataclasses.replace(provider)):
        assert twin == provider and type(twin) is PackedSFTDatasetProvider


def demo_root(shard):
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(shard))))  # out/demo/training/example


@pytest.mark.subprocess
def test_the_docs_provider_example_runs_as_written(shard):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", doc_provider_snippet()], cwd=demo_root(shard), env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == f"64 {DOC_BATCH_KEYS}"


def run_example(cwd, *args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, EXAMPLE, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.subprocess
def test_example_runs_as_written_after_the_demo(shard):
    proc = run_example(demo_root(shard), "--seq-length", "256")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    if bridge_provider.BRIDGE_IMPORT_ERROR is None:
        assert lines[0].startswith("Megatron-Bridge ") and lines[0].endswith("a Bridge DatasetProvider")
    else:
        assert lines[0] == f"without Megatron-Bridge ({bridge_provider.BRIDGE_IMPORT_ERROR}): a torch DataLoader"
    assert lines[1] == "samples: train 64, valid 0, test 0"
    keys = [line.split()[0] for line in lines[2:-1]]
    assert keys == ["tokens", "labels", "loss_mask", "position_ids", "token_count", "attention_mask",
                    "cu_seqlens_q", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_kv"]
    assert lines[-1].startswith("first batch: ")


@pytest.mark.subprocess
def test_a_bridge_that_does_not_import_is_named_and_the_example_still_runs(shard, tmp_path):
    """Megatron-Bridge installed but failing on import, as on a CPU machine (its package imports
    every model; megatron-core 0.19 imports Triton kernels): a warning with the reason, then
    the provider works on its own base. The real case: tests/compat/test_bridge_example.py."""
    package = tmp_path / "site" / "megatron" / "bridge"  # "megatron" is a namespace package
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import triton_kernels_for_the_gpu  # noqa\n")
    proc = run_example(demo_root(shard), "--seq-length", "256", env_extra={
        "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reason = ("megatron.bridge is installed but does not import here "
              "(ModuleNotFoundError: No module named 'triton_kernels_for_the_gpu')")
    assert proc.stdout.splitlines()[0] == f"without Megatron-Bridge ({reason}): a torch DataLoader"
    assert f"RuntimeWarning: {reason}: PackedSFTDatasetProvider builds datasets" in proc.stderr
