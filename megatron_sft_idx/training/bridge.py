"""A dataset with Megatron-Bridge's packed interface, over any packed source.

``PackedSFTDataset(path_or_source)[i]`` returns Bridge's packed sample
``{"input_ids", "seq_boundaries", "loss_mask"}`` (read-only numpy views;
``seq_boundaries = seq_start_id + [packed_len]``), and ``dataset.collate_fn``
turns a list of them into Bridge's packed batch (:mod:`.collate`). Example::

    ds = PackedSFTDataset("/data/sft/train_000", eos_id=tok.eos_id, max_num_samples=100_000,
                          pad_to_max_length=True, pad_cu_seqlens=True)
    loader = DataLoader(ds, batch_size=1, collate_fn=ds.collate_fn, num_workers=4,
                        persistent_workers=True)

Semantics kept from Bridge's ``GPTSFTPackedDataset`` (tested against the installed
Megatron-Bridge 0.6.2 over its own ``.npy``/Parquet and over our shards of the same packs;
the collate follows the installed Bridge's version or ``bridge_semantics``, :mod:`.collate`):

* a negative index is a *padding sample*: the pack at that (Python-negative)
  position, with an all-zero loss mask, so padding a global batch never adds loss;
* with ``max_num_samples`` the dataset has that many samples, drawn through a
  ``samples_mapping``: one independent permutation of all packs per epoch,
  concatenated and cut to ``max_num_samples`` (sampling without replacement
  within an epoch). The permutations come from a private ``RandomState(seed)``,
  so the mapping is the same in every process and after every restart.
"""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np

from .._extras import require_extra

require_extra("train", "torch")
import torch  # noqa: E402

from ..batching.denominators import STEP_TOKENS_KEY, served_counts
from ..batching.samples import sample_index, sources_of
from ..batching.trained import BRIDGE_06 as RULE_BRIDGE_06
from ..batching.trained import STORED
from ..errors import ShardError
from ..format import PAD_LAYOUT_RUNTIME
from ..jsondoc import load_json
from ..legacy import LOSS_BRIDGE_06, converted_loss_state
from ..multi import MultiShardDataset, identities_of
from ..open import open_packed
from ..packed import PackSummary, runtime_min_packed, summarize
from ..sets import parallelism_words, require_compatible
from .collate import BRIDGE_06, BridgePackingStats, PackedCollator, resolve_bridge_semantics

__all__ = ["PackedSFTDataset", "build_samples_mapping", "bridge_datasets", "bridge_stats",
           "bridge_metadata_stats", "ConvertedLossWarning"]

#: Bytes of a Megatron-Bridge packing-metadata JSON (a few entries per packed dataset).
BRIDGE_METADATA_MAX_BYTES = 64 << 20


def build_samples_mapping(num_packs: int, max_num_samples: int, seed: int, order=None,
                          source=None) -> np.ndarray:
    """Bridge's epoch-level shuffled pack indices: ``max_num_samples`` entries, each epoch a
    permutation (:func:`megatron_sft_idx.batching.samples.sample_index`, read-only).

    ``order(source, indices, rng)`` replaces ``rng.permutation`` (e.g.
    :class:`~megatron_sft_idx.locality.BlockLocalOrder` for object storage).

    Raises:
        ShardError: no packs, or a negative sample count.
    """
    if num_packs <= 0:
        raise ShardError("samples mapping needs packs and a non-negative sample count",
                         field="max_num_samples", actual=(num_packs, max_num_samples))
    return sample_index(max_num_samples, num_packs, seed=seed, order=order, source=source)


class PackedSFTDataset(torch.utils.data.Dataset):
    """Bridge-style packed SFT dataset over a shard, a multi-shard view, a ``.npy`` or Parquet.

    Args:
        source: a packed source or anything :func:`open_packed` opens.
        max_seq_length: Bridge's ``max_seq_length`` = its ``packed_sequence_size`` (default:
            the source's pack size).
        eos_id: the tokenizer's EOS id (Bridge pads with it and zeroes loss on it);
            ``pad_id`` is accepted as an alias.
        max_num_samples: build a ``samples_mapping`` of this length (None: one pass, in order).
        seed: seed of the samples mapping (Bridge's default 1234).
        pad_to_max_length, pad_seq_length_to_mult, pad_cu_seqlens, return_cu_seqlen,
            answer_only_loss: Bridge's options (see :class:`PackedCollator`).
        pad_seq_to_mult: Bridge's option; defaults to the multiple the source records.
            Above 1 it turns on Bridge's context-parallel boundaries, which need sequences
            padded in the ``"runtime"`` layout.
        pad_layout: layout of ``.npy``/Parquet sources (Bridge's packer: ``"runtime"``).
        pack_metadata_file_path: Bridge's packing-metadata JSON; with ``pad_cu_seqlens`` its
            entries (max/min over all, as Bridge) replace the source's own statistics.
        order: index order of each epoch of the samples mapping (default: a full shuffle;
            :class:`~megatron_sft_idx.locality.BlockLocalOrder` reads a bucket block by block).
        balanced_order: a balanced order (docs/BATCHING.md) as the samples mapping: an
            :class:`~megatron_sft_idx.batching.Order`, an order file's path, or ``"auto"`` (the
            ``P.order`` / ``BASE.order`` beside a one-path ``source``). Checked: its seed is
            ``seed``, its pack costs are this data's; ``topology`` (a
            :class:`~megatron_sft_idx.batching.Topology`), when given, warns on a mismatch. It
            reaches the ranks only through ``dataloader_type="single"``.
        bridge_semantics: the Megatron-Bridge collate to reproduce: ``"0.6"``, ``"next"`` (its
            main branch) or ``"pr5610"`` (main with PR #5610 as its 2026-08-17 head had it; only
            when asked); :mod:`.collate`. Default: the installed Bridge's.
        return_source_ids: add each sequence's source to the items (``source_ids``) and every
            runtime position's to the batch (``source_ids``, -1 on padding): data written from a
            mixture (``--mix``); :attr:`sources` names them.

    Raises:
        ShardError: the source does not open; options contradict its statistics; a
            ``pad_seq_to_mult`` the recorded padding is not a multiple of; or it is
            padded for context parallelism in Megatron-LM's ``"stored"`` layout, which
            Bridge's runtime segments would break; a balanced order of another seed or other
            packs, or given with ``order``.
    """

    def __init__(self, source, *, max_seq_length: Optional[int] = None, eos_id: Optional[int] = None,
                 pad_id: Optional[int] = None, max_num_samples: Optional[int] = None, seed: int = 1234,
                 pad_to_max_length: bool = False, pad_seq_length_to_mult: int = 16,
                 pad_seq_to_mult: Optional[int] = None, pad_layout: str = PAD_LAYOUT_RUNTIME,
                 pad_cu_seqlens: bool = False, pack_metadata_file_path: Optional[str] = None,
                 return_cu_seqlen: bool = True, answer_only_loss: bool = True,
                 stats: Optional[BridgePackingStats] = None, order=None, balanced_order=None,
                 topology=None, bridge_semantics: Optional[str] = None, return_source_ids: bool = False) -> None:
        eos = eos_id if eos_id is not None else (pad_id if pad_id is not None else 0)
        data_path = source if isinstance(source, str) else None
        if isinstance(source, (str, list, tuple)) or hasattr(source, "__fspath__"):
            source = open_packed(source, pad_seq_to_mult=pad_seq_to_mult, pad_layout=pad_layout)
        self.source = source
        self.return_source_ids = bool(return_source_ids)
        if self.return_source_ids:
            sources_of(source, data_path)   # (refused now, not at the first sample)
        self.summary: PackSummary = summarize(source)
        self.max_seq_length = int(max_seq_length or self.summary.capacity)
        mult = int(pad_seq_to_mult or self.summary.pad_seq_to_mult)
        if mult > 1 and self.summary.pad_seq_to_mult % mult:
            raise ShardError(
                f"this data is padded to multiples of {self.summary.pad_seq_to_mult} (for "
                f"{parallelism_words(_recorded_parallelism(source))}); this run's pad_seq_to_mult is {mult}, "
                "so its context-parallel segments would not split evenly",
                path=getattr(source, "path", None) or getattr(source, "prefix", None), field="pad_seq_to_mult",
                expected=f"a divisor of {self.summary.pad_seq_to_mult}", actual=mult,
                hint="re-pack the data (repack-sft --pad-layout runtime) with this run's --cp/--tp/--sp/--fp8")
        if mult > 1 and self.summary.pad_seq_to_mult > 1 and self.summary.pad_layout != PAD_LAYOUT_RUNTIME:
            raise ShardError(
                "this data is padded for context parallelism in the 'stored' layout (Megatron-LM's): "
                "Megatron-Bridge's runtime segments (each sequence minus its last token) would not be "
                "multiples of pad_seq_to_mult", path=getattr(source, "path", None) or getattr(source, "prefix", None),
                field="pad_layout", expected=PAD_LAYOUT_RUNTIME, actual=self.summary.pad_layout,
                hint="re-run preprocess_sft with --pad-layout runtime for Megatron-Bridge, or pass "
                     "pad_seq_to_mult=1 to train without context parallelism")
        balanced = None
        if balanced_order is not None:
            from ..batching.serve import served_order   # (start-up: numba, only with a balanced order)

            balanced = served_order(balanced_order, source, seed=seed, data_path=data_path, topology=topology)
            max_num_samples = balanced.num_packs if max_num_samples is None else max_num_samples
        self.samples_mapping = (None if max_num_samples is None else
                                sample_index(int(max_num_samples), len(source), seed=seed, order=order,
                                             source=source, balanced=balanced, path=data_path))
        semantics = resolve_bridge_semantics(bridge_semantics)
        self._served = None if balanced is None else served_counts(
            balanced, self.samples_mapping, _bridge_rule(semantics, answer_only_loss), eos_id=eos, path=data_path,
            global_batch_size=getattr(topology, "global_batch_size", None))
        if pad_cu_seqlens and stats is None:
            stats = (bridge_metadata_stats(pack_metadata_file_path) if pack_metadata_file_path
                     else bridge_stats(source))
        self.stats = stats
        if semantics != BRIDGE_06:
            _warn_if_normalised_for_06(source, semantics)
        self.collate_fn = PackedCollator(
            self.max_seq_length, eos_id=eos, pad_to_max_length=pad_to_max_length,
            pad_seq_length_to_mult=pad_seq_length_to_mult, pad_seq_to_mult=mult,
            pad_cu_seqlens=pad_cu_seqlens, stats=stats, return_cu_seqlen=return_cu_seqlen,
            answer_only_loss=answer_only_loss, bridge_semantics=semantics)

    def __len__(self) -> int:
        return len(self.samples_mapping) if self.samples_mapping is not None else len(self.source)

    def __getitem__(self, idx) -> dict:
        """Bridge's packed sample; with a balanced order that records counts also
        ``step_trained_tokens`` (int: the global trained positions of the sample's step under this
        Bridge's rule, 0 for a padding sample), the pack checked against the order first."""
        position = idx = int(idx)
        is_padding = idx < 0
        if self.samples_mapping is not None:
            idx = int(self.samples_mapping[idx])
        pack = self.source[idx]
        loss = pack.loss_mask
        if is_padding:
            loss = np.zeros_like(loss)
        item = {"input_ids": pack.input_ids, "seq_boundaries": pack.seq_boundaries, "loss_mask": loss}
        if self.return_source_ids:
            item["source_ids"] = np.asarray(self.source.source_ids(idx), dtype=np.int64)
        if self._served is not None:
            if not is_padding:
                self._served.check(idx, pack.input_ids, pack.loss_mask, pack.seq_start_id)
            item[STEP_TOKENS_KEY] = 0 if is_padding else self._served.at(position)
        return item

    @property
    def sources(self) -> tuple:
        """The names ``source_ids`` index (data written from a mixture).

        Raises:
            ShardError: the data records no sources."""
        return sources_of(self.source)


def _bridge_rule(semantics: str, answer_only_loss: bool) -> Optional[str]:
    """The positions a Bridge version trains, as a counting rule (:mod:`megatron_sft_idx.batching.trained`):
    0.6 zeroes EOS inputs; ``main`` keeps the stored mask under ``answer_only_loss``; without it
    every non-EOS input trains, which no recorded rule counts (None)."""
    if not answer_only_loss:
        return None
    return RULE_BRIDGE_06 if semantics == BRIDGE_06 else STORED


class ConvertedLossWarning(UserWarning):
    """A shard converted with Bridge 0.6's loss normalisation is trained under the next release's rules."""


def _warn_if_normalised_for_06(source, semantics: str) -> None:
    """Warn (once per call) for shards converted before conversions kept Bridge's stored mask."""
    old = [prefix for prefix, _ in identities_of(source)
           if converted_loss_state(_shard_metadata(source, prefix)) == LOSS_BRIDGE_06]
    if old:
        warnings.warn(f"{old[0]}{f' (and {len(old) - 1} more)' if len(old) > 1 else ''}: converted from "
                      "Megatron-Bridge's .npy/Parquet with Bridge 0.6's loss normalisation (loss 0 at EOS inputs "
                      f"with --eos-id): under Bridge main's rules (bridge_semantics={semantics!r}) it trains fewer "
                      "positions than Bridge trains on the original file; re-convert from the original with this "
                      "version, or pass bridge_semantics='0.6'", ConvertedLossWarning, stacklevel=3)


def _recorded_parallelism(source) -> Optional[dict]:
    """The parallelism the (first) shard of ``source`` records its padding for (None: none recorded)."""
    found = identities_of(source)
    return found[0][1].parallelism if found else None


def _shard_metadata(source, prefix):
    if isinstance(source, MultiShardDataset):
        return source.shard(source.prefixes.index(prefix)).metadata
    return getattr(source, "metadata", None)


def bridge_stats(source) -> BridgePackingStats:
    """Bridge's ``pad_cu_seqlens`` statistics of a packed source, in Bridge's runtime units."""
    s = summarize(source)
    return BridgePackingStats(max_samples_per_bin=s.max_samples_per_bin,
                              dataset_max_seqlen=s.dataset_max_seqlen - 1,
                              min_packed_seqlen=runtime_min_packed(source))


def bridge_metadata_stats(path) -> BridgePackingStats:
    """The statistics in a Megatron-Bridge packing-metadata JSON (max/min over its entries).

    Raises:
        ShardError: the file cannot be read or is not Bridge's list of entries.
    """
    try:
        entries = load_json(str(path), ShardError, max_length=BRIDGE_METADATA_MAX_BYTES,
                            what="Bridge packing metadata")
    except OSError as exc:
        raise ShardError(f"cannot read Bridge packing metadata ({exc})", path=str(path), field="metadata") from None
    return BridgePackingStats.from_bridge_metadata(entries, path=str(path))


def bridge_datasets(context, train=None, valid=None, test=None, **options):
    """``(train, valid, test)`` datasets for a Megatron-Bridge ``DatasetProvider.build_datasets``.

    ``context`` is Bridge's ``DatasetBuildContext`` (``train_samples``,
    ``valid_samples``, ``test_samples``, ``tokenizer``); each split with a path
    gets ``max_num_samples`` from it and ``eos_id`` from the tokenizer. ``balanced_order``
    (and ``topology``), when given, apply to the train split alone. With
    ``pad_cu_seqlens`` the statistics are combined over every split given, as Bridge's
    one metadata file for its train and validation packs combines them.

    Raises:
        IncompatibleShardsError: the splits' shards disagree (tokenizer, chat template,
            vocabulary, loss convention, padding: :mod:`megatron_sft_idx.sets`), as within one
            split; ShardSetError, ShardError: a split does not open.
    """
    tokenizer = getattr(context, "tokenizer", None)
    if "eos_id" not in options and "pad_id" not in options and tokenizer is not None:
        for name in ("eos_id", "eod", "eos"):
            value = getattr(tokenizer, name, None)
            if isinstance(value, int):
                options["eos_id"] = value
                break
    splits = [(path, samples) for path, samples in ((train, getattr(context, "train_samples", None)),
                                                    (valid, getattr(context, "valid_samples", None)),
                                                    (test, getattr(context, "test_samples", None)))]
    train_only = {k: options.pop(k) for k in ("balanced_order", "topology") if k in options}
    out = [None if path is None or not samples else
           PackedSFTDataset(path, max_num_samples=samples, **options, **(train_only if k == 0 else {}))
           for k, (path, samples) in enumerate(splits)]
    require_compatible([m for ds in out if ds is not None for m in identities_of(ds.source)],
                       doing="used with the other splits")
    if options.get("pad_cu_seqlens") and "stats" not in options and not options.get("pack_metadata_file_path"):
        built = [ds for ds in out if ds is not None]
        shared = BridgePackingStats.combine(ds.stats for ds in built) if built else None
        for ds in built:
            ds.stats = ds.collate_fn.stats = shared
    return tuple(out)
