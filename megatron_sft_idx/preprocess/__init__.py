"""Conversations (or pre-tokenized samples) in, packed shards out: ``preprocess-sft`` and ``repack-sft``.

The public face (imported on first use, so importing a submodule stays cheap)::

    from megatron_sft_idx.preprocess import Config, RepackConfig, repack, run

    run(Config(["chat.jsonl"], "/data/sft/chat", tokenizer="tok/", pack_size=8192, workers=8, store="/data/sft/store"))
    repack(RepackConfig("/data/sft/store", "/data/sft/cp4/chat", pack_size=8192, cp=4))

(``preprocess.repack`` is the function; the module of that name, an alias of :mod:`.cli`,
:mod:`.config` and :mod:`.driver`, is gone: a package attribute cannot be both. The old
``preprocess.pipeline`` warns once: docs/CONTRIBUTING.md "Moved names".)

Two wings. The run, here: :mod:`.cli` (both commands), :mod:`.config` (the settings, defined
once), :mod:`.driver` (stage order, resume, commit), :mod:`.engines` (local and Ray), the steps
(:mod:`.tokenize`, :mod:`.plan`, :mod:`.materialize`), :mod:`.checks`, :mod:`.publish`,
:mod:`.summary`, and the artifacts (:mod:`.store`, :mod:`.planfile`, :mod:`.receipts`,
:mod:`.done` (the run's done record), :mod:`.workdir`). Below it, :mod:`.records`: one input
record to tokens and mask (inputs, partitions, shapes, rendering, policies, spans, the source
check), which imports nothing of the run.
"""

from .._lazy import lazy_getattr

_PUBLIC = {
    "run": ".driver",
    "repack": ".driver",
    "Config": ".config",
    "RepackConfig": ".config",
    "PackSettings": ".config",
    "BalanceSettings": ".config",
    "RunSettings": ".config",
    "TokenizeSettings": ".config",
    "InputError": ".records.errors",
    "VirtualPackedDataset": ".virtual",
    "StoreSequences": ".sequences",
    "sequence_lengths": ".sequences",
}

__all__ = list(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC, globals())


def __dir__():
    return sorted(__all__)
