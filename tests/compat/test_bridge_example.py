"""The Megatron-Bridge provider and ``examples/bridge_sft.py`` against the installed Megatron-Bridge.

* the provider is a subclass of Bridge's ``DatasetProvider``, takes Bridge's
  ``DatasetBuildContext``, declares Bridge's ``PackedSequenceSpecs``; the stand-ins used
  where Bridge cannot import have exactly the fields and defaults of Bridge's classes;
* through Bridge's own loader (``build_pretraining_data_loader``, global-batch sampler),
  the provider's batches equal those of Bridge's own reader (``build_gpt_sft_split`` over
  the ``.npy`` Bridge's packer wrote) on the same packs and settings;
* docs/TRAINING.md's provider example runs as written and makes Bridge's own objects;
* the example runs as written, with Bridge importable (the CPU import measures of
  megatron_cpu.py first) and without them, where Bridge's package fails to import on this
  CPU machine, as a user's would: then it warns with the reason and still runs.
"""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from megatron.bridge.data.base import DataloaderConfig, DatasetBuildContext, DatasetProvider
from megatron.bridge.data.packing.config import PackedSequenceSpecs
from megatron.bridge.data.samplers import build_pretraining_data_loader

from bridge_data import PACK_SIZE, bridge_tokenizer, write_bridge_artifacts
from test_bridge_parity import assert_same_batch, bridge_dataset
from support.bridge_doc import DOC_BATCH_KEYS, doc_provider_snippet
from test_readme_megatron import write_demo_like_shard

from megatron_sft_idx.tools.convert import ConvertOptions, convert
from megatron_sft_idx.training import bridge_provider
from megatron_sft_idx.training.bridge_provider import PackedSFTDatasetProvider, build_context

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "bridge_sft.py")


def test_the_provider_is_bridges_dataset_provider():
    assert bridge_provider.BRIDGE_IMPORT_ERROR is None and bridge_provider.BRIDGE_VERSION == "0.6.2"
    assert issubclass(PackedSFTDatasetProvider, DatasetProvider)
    provider = PackedSFTDatasetProvider(train_path="unused", seq_length=PACK_SIZE, pad_to_max_length=True,
                                        pad_cu_seqlens=True, pad_seq_to_mult=4)
    assert isinstance(provider, DataloaderConfig) and provider.enable_offline_packing
    assert provider.offline_packing_specs == PackedSequenceSpecs(packed_sequence_size=PACK_SIZE, pad_cu_seqlens=True,
                                                                 pad_seq_to_mult=4)
    context = build_context(10, 2, 1)
    assert context == DatasetBuildContext(train_samples=10, valid_samples=2, test_samples=1)


def defaults(cls):
    return {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(cls)}


def test_the_stand_ins_have_bridges_fields_and_defaults():
    """Where Bridge cannot import, the provider stands on these: they must be Bridge's, field for field."""
    assert defaults(bridge_provider._DataloaderFields) == defaults(DataloaderConfig)
    assert [f.name for f in dataclasses.fields(bridge_provider._BuildContext)] == \
        [f.name for f in dataclasses.fields(DatasetBuildContext)]
    specs = {f.name for f in dataclasses.fields(PackedSequenceSpecs)}
    assert {f.name for f in dataclasses.fields(bridge_provider._PackingSpecs)} <= specs
    for fields in ({"num_workers": 0}, {"num_workers": 3}):  # finalize: Bridge's rule
        ours, theirs = bridge_provider._DataloaderFields(**fields), DataloaderConfig(**fields)
        ours.finalize()
        theirs.finalize()
        assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)


@pytest.fixture(scope="module")
def chat_cp4(tmp_path_factory):
    tokenizer = bridge_tokenizer()
    art = write_bridge_artifacts(tmp_path_factory.mktemp("bridge_example"), tokenizer, kinds=("chat",), mults=(4,))[0]
    prefix = art.npy[:-len(".npy")] + "_shard"
    convert(art.npy, prefix, options=ConvertOptions(pad_seq_to_mult=4, eos_id=tokenizer.eos_id))
    return art, prefix, tokenizer


@pytest.mark.parametrize("opts", [dict(pad_to_max_length=False, pad_cu_seqlens=False),
                                  dict(pad_to_max_length=True, pad_cu_seqlens=True)])
def test_bridges_loader_gives_the_provider_the_batches_of_bridges_own_reader(chat_cp4, opts):
    art, prefix, tokenizer = chat_cp4
    samples, global_batch = 40, 4
    context = DatasetBuildContext(train_samples=samples, valid_samples=0, test_samples=0, tokenizer=tokenizer)
    provider = PackedSFTDatasetProvider(train_path=prefix, seq_length=PACK_SIZE, pack_metadata_file_path=art.metadata,
                                        num_workers=0, **opts)
    ours, _, _ = provider.build_datasets(context)
    theirs = bridge_dataset(art.npy, art, tokenizer, opts, max_num_samples=samples)

    def loader(dataset):
        return build_pretraining_data_loader(
            dataset, consumed_samples=0, dataloader_type=provider.dataloader_type, micro_batch_size=1,
            num_workers=0, data_sharding=True, collate_fn=dataset.collate_fn, pin_memory=False,
            persistent_workers=False, data_parallel_rank=0, data_parallel_size=1, drop_last=True,
            global_batch_size=global_batch, seed=provider.seed)

    batches = list(zip(loader(theirs), loader(ours)))
    assert len(batches) == samples // global_batch
    for step, (ref, got) in enumerate(batches):
        assert_same_batch(ref, got, f"step {step}, {opts}")


def run_example(tmp_path, shims: bool, script=None):
    os.makedirs(tmp_path / "out" / "demo" / "training", exist_ok=True)
    write_demo_like_shard(str(tmp_path / "out" / "demo" / "training" / "example"))
    prelude = "import megatron_cpu\n" if shims else ""
    script = prelude + (script or f"import runpy\nrunpy.run_path({EXAMPLE!r}, run_name='__main__')\n")
    path = [HERE, ROOT] if shims else [ROOT]  # the stack's directory comes first in PYTHONPATH already
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ["PYTHONPATH"].split(os.pathsep)[0], *path]),
               PYTHONWARNINGS="default::RuntimeWarning")  # the suite runs with warnings ignored
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_docs_provider_example_runs_with_bridge(tmp_path):
    snippet = doc_provider_snippet()
    script = snippet + "\nfrom megatron.bridge.data.base import DatasetBuildContext, DatasetProvider\n" \
        "print(isinstance(provider, DatasetProvider), type(context) is DatasetBuildContext)\n"
    lines = run_example(tmp_path, shims=True, script=script).stdout.splitlines()
    assert lines[-2:] == [f"64 {DOC_BATCH_KEYS}", "True True"]


EXAMPLE_KEYS = ["tokens", "labels", "loss_mask", "position_ids", "token_count", "attention_mask",
                "cu_seqlens_q", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_kv"]


def test_the_example_runs_with_bridge(tmp_path):
    lines = run_example(tmp_path, shims=True).stdout.splitlines()
    assert lines[0] == "Megatron-Bridge 0.6.2: the provider is a Bridge DatasetProvider"
    assert lines[1] == "samples: train 64, valid 0, test 0"
    assert [line.split()[0] for line in lines[2:-1]] == EXAMPLE_KEYS
    assert lines[2] == "  tokens           (8, 2048)"  # Bridge's global-batch sampler: 8 packs per step
    assert lines[-1].startswith("first batch: packs 8, ")


def test_the_example_runs_where_bridges_package_cannot_import(tmp_path):
    """No CPU measures: Bridge's package fails to import here as on any CPU machine."""
    proc = run_example(tmp_path, shims=False)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("without Megatron-Bridge (megatron.bridge is installed but does not import here (")
    assert "RuntimeWarning: megatron.bridge is installed but does not import here" in proc.stderr
    assert [line.split()[0] for line in lines[2:-1]] == EXAMPLE_KEYS
    assert lines[2] == "  tokens           (1, 2048)" and lines[-1].startswith("first batch: packs 1, ")
