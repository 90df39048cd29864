"""Megatron-Bridge's dataset provider for packed shards: ``cfg.dataset = PackedSFTDatasetProvider(...)``.

Megatron-Bridge builds a custom dataset by calling ``build_datasets(context)`` on the
``DatasetProvider`` it finds in ``cfg.dataset``. ``context`` is Bridge's
``DatasetBuildContext``: the sample counts it derived from ``cfg.train`` and
``cfg.validation`` (``train_samples``, ``valid_samples``, ``test_samples``), the tokenizer it
built from ``cfg.tokenizer`` and the process groups. The provider's other fields
(``dataloader_type``, ``num_workers``, ``pin_memory``, ...) are Bridge's ``DataloaderConfig``,
read by Bridge's data loader, which takes each dataset's ``collate_fn``. Example::

    from megatron_sft_idx.training.bridge_provider import PackedSFTDatasetProvider

    cfg.dataset = PackedSFTDatasetProvider(
        train_path="s3://bucket/sft/chat_train.json", valid_path="s3://bucket/sft/chat_valid.json",
        seq_length=cfg.model.seq_length, pad_to_max_length=True, pad_cu_seqlens=True)

Two cases, decided once when this module is imported (:data:`BRIDGE_IMPORT_ERROR` says which):

* ``megatron.bridge.data.base`` imports: the class **is** a subclass of Bridge's
  ``DatasetProvider`` (so Bridge dispatches to it), and it declares Bridge's offline packing
  (``enable_offline_packing``, ``offline_packing_specs`` as Bridge's ``PackedSequenceSpecs``),
  so Bridge checks a micro-batch of 1, ``pad_cu_seqlens`` with ``pad_to_max_length``, and
  hands the packed boundaries to middle pipeline stages;
* it does not (Bridge is not installed; or a CPU machine, where Bridge's package imports
  every model, Transformer Engine and megatron-core's Triton kernels): the class has the
  same fields, defaults and methods on a plain dataclass, and :func:`build_context` makes a
  context with the same fields, so the data part of a recipe runs anywhere (build the
  datasets, iterate batches) and its batches are the same. Bridge's training itself can
  only take the first kind; when Bridge is installed but fails to import, importing this
  module warns with the reason.

The datasets are :class:`~megatron_sft_idx.training.bridge.PackedSFTDataset` (through
:func:`~megatron_sft_idx.training.bridge.bridge_datasets`), whose collate is Bridge's own batch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from typing import Any, Literal, Optional, Union

from ..errors import ShardError
from ..locality import BlockLocalOrder

__all__ = ["PackedSFTDatasetProvider", "build_context", "BRIDGE_IMPORT_ERROR", "BRIDGE_VERSION"]

Paths = Union[str, list, None]


def _import_bridge():
    """Bridge's ``DatasetProvider``, ``DatasetBuildContext``, ``PackedSequenceSpecs`` and version,
    or the reason they do not import (None when Bridge is not installed at all)."""
    try:
        installed = importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):  # no "megatron" package at all
        installed = False
    if not installed:
        return None, "megatron.bridge is not installed"
    try:
        from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
        from megatron.bridge.data.packing.config import PackedSequenceSpecs
    except ImportError as exc:
        return None, f"megatron.bridge is installed but does not import here ({type(exc).__name__}: {exc})"
    try:
        from megatron.bridge.package_info import __version__ as version
    except ImportError:
        version = None
    else:
        version = version.split("+")[0]  # a local build tag may follow "+"
    return (DatasetProvider, DatasetBuildContext, PackedSequenceSpecs, version), None


_BRIDGE, BRIDGE_IMPORT_ERROR = _import_bridge()
"""None when Bridge's classes are the bases here; otherwise why not, in words."""

BRIDGE_VERSION: Optional[str] = _BRIDGE[3] if _BRIDGE else None

if _BRIDGE is None and BRIDGE_IMPORT_ERROR != "megatron.bridge is not installed":
    warnings.warn(f"{BRIDGE_IMPORT_ERROR}: PackedSFTDatasetProvider builds datasets and batches as "
                  "usual, but Megatron-Bridge's training cannot take it in this process",
                  RuntimeWarning, stacklevel=2)


@dataclasses.dataclass(kw_only=True)
class _DataloaderFields:
    """Stand-in for Bridge's ``DataloaderConfig`` where Bridge does not import: the same field
    names and defaults as Megatron-Bridge 0.6.2's (``tests/compat/test_bridge_example.py``
    compares them with the installed Bridge's)."""

    dataloader_type: Optional[Literal["single", "cyclic", "batch", "external"]] = None
    num_workers: int = 2
    data_sharding: bool = True
    pin_memory: bool = True
    drop_last: bool = True
    persistent_workers: bool = True
    trust_remote_code: Optional[bool] = None
    dataloader_save: Optional[str] = None
    dataloader_load: Optional[str] = None

    def finalize(self) -> None:
        """Bridge's rule: persistent workers need workers."""
        if self.num_workers == 0 and self.persistent_workers:
            self.persistent_workers = False


@dataclasses.dataclass(frozen=True)
class _BuildContext:
    """Stand-in for Bridge's ``DatasetBuildContext`` where Bridge does not import."""

    train_samples: int
    valid_samples: int
    test_samples: int
    tokenizer: Any = None
    pg_collection: Any = None


@dataclasses.dataclass(frozen=True)
class _PackingSpecs:
    """Stand-in for the fields of Bridge's ``PackedSequenceSpecs`` this provider sets."""

    packed_sequence_size: int
    pad_cu_seqlens: bool
    pad_seq_to_mult: Optional[int]


_Base = _BRIDGE[0] if _BRIDGE else _DataloaderFields


@dataclasses.dataclass(kw_only=True)
class PackedSFTDatasetProvider(_Base):
    """Packed shards as a Megatron-Bridge dataset: train, validation and test paths and Bridge's options.

    Args:
        train_path, valid_path, test_path: anything :func:`~megatron_sft_idx.open_packed`
            opens (a shard prefix, a manifest, a directory, a glob, a list of them, Bridge's
            ``.npy`` or packed Parquet; local or ``s3://`` / ``msc://``). A split without a
            path, or for which Bridge asks no samples, is None.
        seq_length: Bridge's packed sequence size (``max_seq_length`` of its packed dataset);
            equal to ``cfg.model.seq_length`` and at least the shards' pack size.
        seed: seed of the epoch-level samples mapping and of Bridge's batch sampler (1234).
        pad_to_max_length, pad_cu_seqlens, pad_seq_to_mult, pack_metadata_file_path:
            Bridge's packed options (:class:`~megatron_sft_idx.training.bridge.PackedSFTDataset`);
            ``pad_seq_to_mult`` defaults to the multiple the shards record.
        eos_id: the EOS id (default: the context's tokenizer's).
        block_local_window: read packs block by block (:class:`~megatron_sft_idx.locality.BlockLocalOrder`
            with this window) instead of a full shuffle: for shards in object storage.
        dataset_kwargs: any other :class:`PackedSFTDataset` option (``answer_only_loss``,
            ``return_cu_seqlen``, ``pad_seq_length_to_mult``, ``pad_layout``).
        balanced_order: the train split's samples mapping from a balanced order
            (docs/BATCHING.md): an order file's path, or ``"auto"`` for the ``P.order`` /
            ``BASE.order`` that ``--balance-for`` wrote beside ``train_path``. Its seed must be
            ``seed``; needs ``dataloader_type="single"``. ``dataset_kwargs={"topology":
            Topology(dp, mbs, gbs)}`` warns when the order was balanced for another one.
        dataloader_type: Bridge's sampler; ``"batch"`` (as Bridge's own SFT config), or
            ``"single"`` for a planned batch order (docs/BATCHING.md). The other loader
            fields are Bridge's ``DataloaderConfig``'s.

    Raises:
        ShardError: ``seq_length`` is not a positive integer (at construction); a
            ``balanced_order`` with a ``dataloader_type`` other than ``"single"`` (at construction
            and at build); ``build_datasets`` raises what :func:`bridge_datasets` raises.
    """

    train_path: Paths
    valid_path: Paths = None
    test_path: Paths = None
    seq_length: int
    seed: int = 1234
    pad_to_max_length: bool = False
    pad_cu_seqlens: bool = False
    pad_seq_to_mult: Optional[int] = None
    pack_metadata_file_path: Optional[str] = None
    eos_id: Optional[int] = None
    block_local_window: Optional[int] = None
    balanced_order: Optional[str] = None
    dataset_kwargs: Optional[dict] = None
    dataloader_type: Optional[Literal["single", "cyclic", "batch", "external"]] = "batch"

    def __post_init__(self) -> None:
        if isinstance(self.seq_length, bool) or not isinstance(self.seq_length, int) or self.seq_length <= 0:
            raise ShardError("seq_length must be a positive integer: Bridge's packed sequence size",
                             field="seq_length", expected="an int > 0", actual=self.seq_length,
                             hint="give cfg.model.seq_length")
        self._check_loader()

    def _check_loader(self) -> None:
        if self.balanced_order is not None and self.dataloader_type != "single":
            raise ShardError(f"a balanced order reaches the ranks only through dataloader_type=\"single\" "
                             f"(Megatron's MegatronPretrainingSampler reads the dataset in index order); "
                             f"{self.dataloader_type!r} re-shuffles or hands batching to another sampler",
                             field="dataloader_type", expected="single", actual=self.dataloader_type,
                             hint="set dataloader_type=\"single\" and train by iterations, not num_epochs")

    @property
    def enable_offline_packing(self) -> bool:
        """Always True: the shards hold packs made offline (Bridge reads this flag)."""
        return True

    @property
    def offline_packing_specs(self):
        """Bridge's ``PackedSequenceSpecs`` for these packs, derived from the fields each time."""
        specs = _BRIDGE[2] if _BRIDGE else _PackingSpecs
        return specs(packed_sequence_size=self.seq_length, pad_cu_seqlens=self.pad_cu_seqlens,
                     pad_seq_to_mult=self.pad_seq_to_mult or 1)

    def build_datasets(self, context):
        """``(train, valid, test)`` :class:`PackedSFTDataset`\\ s for Bridge's ``context``.

        Each split gets ``max_num_samples`` from ``context`` and, unless ``eos_id`` is set,
        the EOS id of ``context.tokenizer``.
        """
        from .bridge import bridge_datasets   # (start-up: torch, once datasets are built)

        self._check_loader()
        options = dict(self.dataset_kwargs or {})
        options.update(max_seq_length=self.seq_length, seed=self.seed, pad_to_max_length=self.pad_to_max_length,
                       pad_cu_seqlens=self.pad_cu_seqlens, pad_seq_to_mult=self.pad_seq_to_mult,
                       pack_metadata_file_path=self.pack_metadata_file_path)
        if self.eos_id is not None:
            options["eos_id"] = self.eos_id
        if self.block_local_window is not None:
            options["order"] = BlockLocalOrder(window=self.block_local_window)
        if self.balanced_order is not None:
            options["balanced_order"] = self.balanced_order
        return bridge_datasets(context, train=self.train_path, valid=self.valid_path, test=self.test_path,
                               **options)


def build_context(train_samples: int, valid_samples: int = 0, test_samples: int = 0, tokenizer=None):
    """A ``DatasetBuildContext`` as Bridge's training makes one: Bridge's own class where it
    imports, else a stand-in with the same fields. For building the datasets outside
    Bridge's training (a check, a notebook); in training Bridge makes it."""
    make = _BRIDGE[1] if _BRIDGE else _BuildContext
    return make(train_samples=train_samples, valid_samples=valid_samples, test_samples=test_samples,
                tokenizer=tokenizer)
