"""Shards as Megatron ``data_path``: a megatron-core ``MegatronDataset`` for packed SFT.

``BlendedMegatronDatasetBuilder(SFTIndexedDataset, sizes, is_built_on_rank, config).build()``
builds train/valid/test from a blend such as ``"0.7 /d/a 0.3 /d/b"`` (see
:func:`parse_data_path`) and a ``split`` such as ``"98,1,1"``, or from per-split
blends, exactly as it builds ``GPTDataset``s: each entry of the blend is a shard
prefix, a manifest ``.json``, a directory or glob of shards, a legacy ``.npy``
or packed Parquet (anything :func:`~megatron_sft_idx.open.open_packed` opens).
Every sample is one pack, laid out as Megatron-LM's own packed ``SFTDataset``
lays out a pack, at ``config.sequence_length = S``:

* ``tokens[j] = input_ids[j]`` for ``j < packed_len``, then the pad token;
* ``labels[j] = input_ids[j+1]``, the pad token at and after ``packed_len - 1``;
* ``loss_mask`` (float32) is the stored label-aligned mask, 0 on padding. The last
  position of every sequence is 0 in every shard (a format invariant), so no
  loss is taken on a label from the next sequence, nor on padding;
* ``position_ids`` restart at 0 at every sequence start;
* ``cu_seqlens`` (int32, ``S + 1`` entries): the sequence starts, then ``S``,
  then ``S`` repeated (zero-length segments) to the fixed length, as upstream pads
  it so ``default_collate`` can stack samples. The padding after the last sequence
  belongs to the last segment, and its positions continue that sequence's, as
  upstream does; being after the sequence, it is never attended to by it;
* ``max_seqlen``: 0-d int32, the longest segment.

Build-time refusals (:class:`ShardError`, naming the shard): datasets of one blend
(every entry of ``blend`` and of ``blend_per_split``, whatever its weight) that disagree
-- tokenizer, chat template, vocabulary, loss convention, pad multiple or layout
(:mod:`megatron_sft_idx.sets`; ``IncompatibleShardsError`` naming both entries and what
differs in words); a directory, glob or manifest entry that holds part of a set or
several sets (``ShardSetError``); a shard whose pack size exceeds ``sequence_length``; a shard whose recorded ``pad_seq_to_mult`` is
not a multiple of the run's padding divisor (``2*CP`` when CP > 1, times the
sequence-parallel size; with ``fp8_recipe`` also the recipe's block times those: docs/FORMAT.md
"FP8 alignment"), so sequence lengths would not split evenly across the ranks -- the error names
the shard's recorded topology and the run's; a ``sequence_length`` that is not a multiple of that divisor.

The sample order is a deterministic function of the config: each epoch of the
split's packs is a permutation drawn from ``RandomState(random_seed)`` (or the
split in order with ``shuffle=False``), cached under ``path_to_cache`` as
upstream caches its indices, so samples after ``consumed_samples = k`` are the
same in a restarted run. With ``pack_order_file`` (a balanced order, docs/BATCHING.md)
the train split's samples are the order's positions instead: each step keeps the packs
this shuffle gives it, dealt so that the data-parallel ranks' shares cost the same
(:func:`balanced_order` says what is refused first); an order that records trained-token
counts adds ``step_trained_tokens`` to every sample: the global trained positions of its
step (:mod:`megatron_sft_idx.batching.denominators`), the divisor of the exact token mean.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .._extras import require_extra

require_extra("megatron", "torch", "megatron.core")
import torch  # noqa: E402
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split

from .._atomic import write_file_atomically
from ..batching.denominators import STEP_TOKENS_KEY, served_counts
from ..batching.layout import Topology
from ..batching.samples import sample_index, sources_of, token_sources
from ..batching.trained import STORED
from ..errors import ShardError
from ..format import PAD_LAYOUT_STORED
from ..multi import MultiShardDataset, identities_of
from ..open import open_packed, records_no_identity
from ..packed import PackSummary, summarize
from ..packing import FP8_BLOCK
from ..sets import parallelism_words, require_compatible

__all__ = [
    "SFTIndexedDataset",
    "SFTIndexedDatasetConfig",
    "parse_data_path",
    "parse_per_split_data_path",
    "padding_divisor",
    "config_from_args",
    "build_train_valid_test_datasets",
    "train_valid_test_datasets_provider",
]

logger = logging.getLogger(__name__)
Blend = Tuple[List[str], Optional[List[float]]]


# --------------------------------------------------------------------------- data_path parsing


def parse_data_path(spec: Union[str, Sequence[str], None]) -> Optional[Blend]:
    """A megatron-core blend ``(prefixes, weights or None)`` from a ``data_path``.

    ``spec`` is a string (``"0.7 /d/a 0.3 /d/b"``, ``"/d/a /d/b"``) or Megatron-LM's
    ``--data-path`` list (``["0.7", "/d/a", "0.3", "/d/b"]``). Weights, when given,
    precede every path and must be positive numbers; they need not sum to 1.

    Raises:
        ShardError: weights on some paths but not others, a non-positive weight, or no paths.
    """
    if spec is None:
        return None
    tokens = spec.split() if isinstance(spec, str) else [t for part in spec for t in str(part).split()]
    if not tokens:
        raise ShardError("data_path names no dataset", field="data_path", actual=spec)
    numeric = [_as_weight(t) is not None for t in tokens]
    if not any(numeric):
        return tokens, None
    pairs_ok = len(tokens) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2])
    if not pairs_ok:
        raise ShardError("data_path mixes weighted and unweighted entries", field="data_path",
                         actual=spec, expected="'W1 P1 W2 P2 ...' or 'P1 P2 ...'",
                         hint="give a weight before every path, or none at all")
    weights = [_as_weight(t) for t in tokens[0::2]]
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ShardError("blend weights must be positive finite numbers", field="data_path",
                         actual=weights)
    return tokens[1::2], weights


def _as_weight(token: str) -> Optional[float]:
    try:
        return float(token)
    except ValueError:
        return None


def parse_per_split_data_path(train=None, valid=None, test=None) -> List[Optional[Blend]]:
    """``blend_per_split`` (train, valid, test) from three ``data_path``-style specs."""
    return [parse_data_path(spec) for spec in (train, valid, test)]


# --------------------------------------------------------------------------- config


@dataclass
class SFTIndexedDatasetConfig(BlendedMegatronDatasetConfig):
    """megatron-core dataset config plus what packed SFT needs.

    ``SFTIndexedDataset`` also accepts a ``GPTDatasetConfig`` (Megatron-LM's),
    reading these fields with the defaults below when absent.
    """

    context_parallel_size: int = 1
    """CP size; with CP > 1 every sequence must be a multiple of 2*CP tokens."""

    sequence_parallel_size: int = 0
    """TP size when sequence parallelism is on (0: off); multiplies the divisor."""

    hybrid_context_parallel: bool = False
    """Megatron's hybrid CP: the divisor becomes data_parallel_size * CP * 2."""

    data_parallel_size: int = 1

    fp8_recipe: Optional[str] = None
    """Megatron's ``--fp8-recipe`` when FP8 is on (None: off): the divisor also takes its block
    (:data:`~megatron_sft_idx.packing.FP8_BLOCK`; docs/FORMAT.md "FP8 alignment")."""

    pad_token_id: Optional[int] = None
    """Token for padding positions (default: the tokenizer's pad, else its EOD, else 0)."""

    shuffle: bool = True
    """Permute each epoch of packs (False: packs in stored order)."""

    check_packs: bool = False
    """Check each pack's invariants as it is read."""

    pack_order: Optional[object] = None
    """Order of each epoch's packs: None is a full shuffle; ``BlockLocalOrder(window)``
    (:mod:`megatron_sft_idx.locality`) fetches each object-storage block once per epoch."""

    pack_order_file: Optional[object] = None
    """A balanced order for the train split (docs/BATCHING.md): an order file's path, an
    ``Order``, or ``"auto"``: the ``P.order`` / ``BASE.order`` that ``--balance-for`` wrote beside
    the data path. The train blend must be that one path, its split the whole dataset."""

    micro_batch_size: Optional[int] = None
    """With ``global_batch_size`` (and ``data_parallel_size``): the topology a balanced order is
    checked against (a mismatch warns). Megatron-LM's ``--micro-batch-size``."""

    global_batch_size: Optional[int] = None
    """Megatron-LM's ``--global-batch-size`` (see ``micro_batch_size``)."""

    return_source_ids: bool = False
    """Add ``source_ids`` to each sample: every position's source (an index into the dataset's
    ``sources``; -1 on padding), for data written from a mixture (``--mix``), so a trainer can
    log the loss per source."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sequence_length < 2:
            raise ShardError("sequence_length must be at least 2", field="sequence_length",
                             actual=self.sequence_length)


def padding_divisor(config) -> int:
    """The token multiple CP/SP need every sequence to be (upstream SFT's rule), and with
    ``fp8_recipe`` also the recipe's block times that CP/SP split (docs/FORMAT.md "FP8 alignment").

    Raises:
        ShardError: an ``fp8_recipe`` that is not a key of :data:`~megatron_sft_idx.packing.FP8_BLOCK`.
    """
    cp = getattr(config, "context_parallel_size", None) or 1
    sp = getattr(config, "sequence_parallel_size", None) or 1
    if getattr(config, "hybrid_context_parallel", False):
        cp_pad = (getattr(config, "data_parallel_size", None) or 1) * cp * 2
    else:
        cp_pad = cp * 2 if cp > 1 else 1
    fp8 = getattr(config, "fp8_recipe", None)
    if fp8 is None:
        return cp_pad * sp
    if fp8 not in FP8_BLOCK:
        raise ShardError("unknown FP8 recipe", field="fp8_recipe", expected=sorted(FP8_BLOCK), actual=fp8,
                         hint="give Megatron's --fp8-recipe name, or None without FP8")
    return math.lcm(cp_pad * sp, FP8_BLOCK[fp8] * cp_pad * sp)


def _run_words(config) -> str:
    """The run's padding topology in words, for a refusal that names it beside the shard's."""
    parts = [f"CP {getattr(config, 'context_parallel_size', None) or 1}"]
    if getattr(config, "sequence_parallel_size", None):
        parts.append(f"SP over TP {config.sequence_parallel_size}")
    if getattr(config, "hybrid_context_parallel", False):
        parts.append(f"hybrid CP over DP {getattr(config, 'data_parallel_size', None) or 1}")
    if getattr(config, "fp8_recipe", None):
        parts.append(f"FP8 {config.fp8_recipe}")
    return ", ".join(parts)


def _pad_token(config) -> int:
    explicit = getattr(config, "pad_token_id", None)
    if explicit is not None:
        return int(explicit)
    tokenizer = getattr(config, "tokenizer", None)
    vocab = getattr(tokenizer, "vocab_size", None)
    for name in ("pad", "pad_id", "eod"):
        try:
            value = getattr(tokenizer, name, None)
        except (AttributeError, NotImplementedError):
            value = None
        if isinstance(value, int) and value >= 0 and (vocab is None or value < vocab):
            return value
    return 0


def check_compatible(source, config, path: str) -> None:
    """Refuse a source whose packs do not fit ``config`` (pack size, CP alignment).

    Raises:
        ShardError: naming the shard, the field and what to change.
    """
    seq_len = int(config.sequence_length)
    divisor = padding_divisor(config)
    if divisor > 1 and seq_len % divisor:
        raise ShardError(f"sequence_length is not a multiple of the padding divisor of this run ({_run_words(config)})",
                         path=path, field="sequence_length", expected=f"multiple of {divisor}",
                         actual=seq_len, hint="choose a seq-length divisible by 2*CP (times SP, times the FP8 block)")
    if isinstance(source, MultiShardDataset):
        parts = list(zip(source.prefixes, source.summaries))
    else:
        parts = [(path, summarize(source))]
    recorded = {p: i.parallelism for p, i in identities_of(source)}
    for k, (where, summary) in enumerate(parts):
        shard = source.prefixes[k] if isinstance(source, MultiShardDataset) else getattr(source, "prefix", None)
        _check_summary(where, summary, seq_len, divisor, _run_words(config), recorded.get(shard))


def blend_paths(config) -> List[str]:
    """Every dataset path of ``config``'s blends (``blend`` and ``blend_per_split``), once each."""
    blends = [getattr(config, "blend", None)] + list(getattr(config, "blend_per_split", None) or [])
    out: List[str] = []
    for blend in blends:
        for path in (blend[0] if blend else []):
            if path not in out:
                out.append(path)
    return out


def check_blend(config) -> None:
    """Refuse a blend whose datasets could not be trained as one: every shard of every entry
    of every split must agree with the others (:func:`megatron_sft_idx.sets.require_compatible`).

    Called by each ``build_low_level_dataset`` of the build; the verdict for this config's
    blend is kept on the config, so the entries' headers are read once per build.

    Raises:
        IncompatibleShardsError: naming the two shards (their blend entries) and what differs.
        ShardSetError, ShardError: an entry does not open (see :func:`open_packed`).
    """
    paths = blend_paths(config)
    if len(paths) < 2 or config.__dict__.get("_sft_idx_blend_checked") == paths:
        return
    members = []
    for path in paths:
        if records_no_identity(path):  # legacy .npy / Parquet: nothing recorded to compare (nor loaded twice)
            continue
        source = open_packed(path, check_packs=False)
        members.extend((f"{prefix} (data_path entry {path})" if prefix != path else prefix, identity)
                       for prefix, identity in identities_of(source))
    require_compatible(members, doing="blended")
    config.__dict__["_sft_idx_blend_checked"] = paths


def _check_summary(path: str, summary: PackSummary, seq_len: int, divisor: int, run: str = "",
                   parallelism: Optional[dict] = None) -> None:
    if divisor > 1 and summary.pad_seq_to_mult > 1 and summary.pad_layout != PAD_LAYOUT_STORED:
        raise ShardError("shard is padded for Megatron-Bridge's runtime segments (pad_layout "
                         f"{summary.pad_layout!r}): with context parallelism Megatron-LM needs every stored "
                         "sequence length to be the multiple", path=path, field="pad_layout",
                         expected=PAD_LAYOUT_STORED, actual=summary.pad_layout,
                         hint="re-run preprocess_sft with --pad-layout stored for Megatron-LM")
    if summary.capacity > seq_len:
        raise ShardError("shard pack size exceeds the run's sequence length", path=path,
                         field="pack_size", expected=f"<= {seq_len}", actual=summary.capacity,
                         hint="raise --seq-length to the pack size or re-pack the data for this length")
    if divisor > 1 and summary.pad_seq_to_mult % divisor:
        raise ShardError(f"shard sequences are padded to multiples of {summary.pad_seq_to_mult} (for "
                         f"{parallelism_words(parallelism)}); this run ({run or 'its CP/SP'}) needs multiples "
                         f"of {divisor}", path=path, field="pad_seq_to_mult",
                         expected=f"a multiple of {divisor} (2*CP*SP, times the FP8 block)",
                         actual=summary.pad_seq_to_mult,
                         hint="re-pack the data (repack-sft) with this run's --cp/--tp/--sp/--fp8")


# --------------------------------------------------------------------------- dataset


class SFTIndexedDataset(MegatronDataset):
    """One packed SFT sample per pack, Megatron-LM's SFT sample layout (see module doc).

    Constructed by ``BlendedMegatronDatasetBuilder`` with the low-level source from
    :meth:`build_low_level_dataset`, the split's pack indices and ``num_samples``.
    """

    def __init__(self, dataset, dataset_path: Optional[str], indices: np.ndarray,
                 num_samples: Optional[int], index_split: Split, config) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        # Sample order depends on `shuffle`, which Megatron-LM's GPTDatasetConfig lacks: add it to
        # the identity (and so to the cache file names) here rather than in _key_config_attributes.
        self.unique_identifiers["shuffle"] = bool(getattr(config, "shuffle", True))
        if getattr(config, "pack_order", None) is not None:
            self.unique_identifiers["pack_order"] = repr(config.pack_order)
        self._balanced = balanced_order(self, config)
        if self._balanced is not None:  # another order file, other cache files
            self.unique_identifiers["pack_order_file"] = self._balanced.file_crc32
        self.unique_description = json.dumps(self.unique_identifiers, indent=4,
                                             default=lambda obj: obj.unique_identifiers)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8"),
                                                   usedforsecurity=False).hexdigest()
        self.pad_token_id = _pad_token(config)
        self.return_source_ids = bool(getattr(config, "return_source_ids", False))
        if self.return_source_ids:
            sources_of(self.dataset, self.dataset_path)   # (refused now, not at the first sample)
        self._sample_index_path: Optional[str] = None
        self.sample_index = self._build_sample_index()
        self._served = _served_counts(self._balanced, self.sample_index, config, self.dataset_path)
        self._balanced = None   # (served through the sample index; workers need not pickle it)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config) -> object:
        check_blend(config)
        source = open_packed(dataset_path, check_packs=getattr(config, "check_packs", False))
        check_compatible(source, config, dataset_path)
        return source

    @staticmethod
    def numel_low_level_dataset(low_level_dataset) -> int:
        return len(low_level_dataset)

    # ------------------------------------------------------------------ sample index

    def _sample_count(self) -> int:
        if self.num_samples is not None:
            return int(self.num_samples)
        return int(len(self.indices))

    def _compute_sample_index(self) -> np.ndarray:
        """Pack index of every sample: whole epochs of the split, each permuted, cut to length
        (:func:`~megatron_sft_idx.batching.samples.sample_index`; the balanced order's positions
        with ``pack_order_file``: the split is then the whole dataset)."""
        return sample_index(self._sample_count(), self.indices, seed=self.config.random_seed,
                            shuffle=getattr(self.config, "shuffle", True),
                            order=getattr(self.config, "pack_order", None), source=self.dataset,
                            balanced=self._balanced, path=self.dataset_path, field="pack_order_file")

    def _cache_path(self) -> Optional[str]:
        cache = getattr(self.config, "path_to_cache", None)
        if not cache:
            return None
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        return os.path.join(cache, base)

    def _refuse_empty_split(self) -> None:
        """A split with no packs cannot give samples: say so before anything is cached.

        Megatron's blend would otherwise draw from a dataset of size 0 (its own
        ``BlendedDataset`` check names that as oversampling); caching an empty index for
        a non-zero sample count would poison every later run.
        """
        count = self._sample_count()
        if count > 0 and len(self.indices) == 0:
            raise ShardError(
                f"the {self.index_split.name} split of this dataset holds no packs, yet {count} samples "
                "are requested from it: the blend oversamples it in excess of its size 0",
                path=self.dataset_path, field="split", expected="at least one pack in the split",
                actual=f"split {getattr(self.config, 'split', None)!r} of {len(self.dataset)} packs",
                hint="give this split more data (a larger shard or another --split), or drop the shard "
                     "from this split's blend; nothing was cached")

    def _build_sample_index(self) -> np.ndarray:
        self._refuse_empty_split()
        base = self._cache_path()
        if base is None:
            return self._compute_sample_index()
        index_path, description_path = base + "-sample_index.npy", base + "-description.txt"
        if not (os.path.isfile(index_path) and os.path.isfile(description_path)):
            index = self._compute_sample_index()
            os.makedirs(os.path.dirname(index_path), exist_ok=True)
            description = self.unique_description.encode("utf-8")
            write_file_atomically(description_path, lambda f: f.write(description))
            write_file_atomically(index_path, lambda f: np.save(f, index, allow_pickle=False))
            logger.info("built and cached %s %s sample index (%d samples)", type(self).__name__,
                        self.index_split.name, len(index))
        self._sample_index_path = index_path
        index = np.load(index_path, mmap_mode="r", allow_pickle=False)
        if index.ndim != 1 or index.shape[0] != self._sample_count():
            raise ShardError("cached sample index has the wrong length", path=index_path,
                             field="sample_index", expected=self._sample_count(), actual=index.shape,
                             hint="delete the cache directory's stale files and rebuild")
        return index

    # ------------------------------------------------------------------ access

    def __len__(self) -> int:
        return int(self.sample_index.shape[0])

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """Sample ``idx`` (``None``: a padding sample with zero loss, as ``GPTDataset``). With a
        balanced order that records counts, ``step_trained_tokens`` too (0-d int64: the global
        trained positions of the sample's step; 0 for a padding sample), its pack checked first."""
        i = int(self.sample_index[0 if idx is None else idx])
        pack = self.dataset[i]
        seq_len = int(self.config.sequence_length)
        sample = _layout_pack(pack, seq_len, self.pad_token_id, self.dataset_path)
        if idx is None:
            sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
        if self.return_source_ids:
            sample["source_ids"] = torch.from_numpy(token_sources(self.dataset.source_ids(i), pack.seq_lengths,
                                                                  seq_len))
        if self._served is not None:
            if idx is not None:
                self._served.check(i, pack.input_ids, pack.loss_mask, pack.seq_start_id)
            sample[STEP_TOKENS_KEY] = torch.tensor(0 if idx is None else self._served.at(idx), dtype=torch.int64)
        return sample

    @property
    def sources(self) -> tuple:
        """The names ``source_ids`` index (data written from a mixture).

        Raises:
            ShardError: the data records no sources."""
        return sources_of(self.dataset, self.dataset_path)

    def __getstate__(self):
        state = self.__dict__.copy()
        if self._sample_index_path is not None:  # workers re-map the cached file, not a copy
            state["sample_index"] = None
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        if self.sample_index is None:
            self.sample_index = np.load(self._sample_index_path, mmap_mode="r", allow_pickle=False)


def balanced_order(dataset: "SFTIndexedDataset", config):
    """The balanced order ``config.pack_order_file`` names for ``dataset``'s train split, checked
    (:func:`megatron_sft_idx.batching.serve.checked_order`); None without one or for another split.

    Raises:
        ShardError: a blend, a split that is not the whole dataset, a pack order or ``shuffle=False``
            besides it, another seed, an order of other packs; TopologyMismatchWarning (a warning):
            the order was balanced for another DP, micro-batch or global batch size.
    """
    spec = getattr(config, "pack_order_file", None)
    if spec is None or dataset.index_split != Split.train:
        return None
    from ..batching.serve import served_order   # (start-up: numba, only with a balanced order)

    path = dataset.dataset_path
    train = (config.blend_per_split or [None])[0] if getattr(config, "blend_per_split", None) else config.blend
    if train is None or len(train[0]) != 1:
        raise ShardError("a balanced pack order serves one dataset: the train data_path is a blend", path=path,
                         field="pack_order_file", actual=None if train is None else train[0],
                         hint="give the train split one shard or manifest (balance a blend's packs as one set: "
                              "write them with one preprocess run, or plan-batches over the manifest)")
    n = len(dataset.dataset)
    if len(dataset.indices) != n or not np.array_equal(dataset.indices, np.arange(n)):
        raise ShardError("a balanced pack order permutes every pack of the data: the train split must be all of it",
                         path=path, field="split", actual=getattr(config, "split", None),
                         hint="use split \"100,0,0\" (or train_data_path), with separate validation data")
    if getattr(config, "pack_order", None) is not None or not getattr(config, "shuffle", True):
        raise ShardError("pack_order_file replaces the shuffle: leave pack_order unset and shuffle on", path=path,
                         field="pack_order_file")
    sizes = (getattr(config, "data_parallel_size", None), getattr(config, "micro_batch_size", None),
             getattr(config, "global_batch_size", None))
    topology = Topology(*sizes) if all(sizes) else None
    order = served_order(spec, dataset.dataset, seed=config.random_seed, data_path=path, topology=topology,
                         path=path if spec == "auto" else os.fspath(spec) if isinstance(spec, (str, os.PathLike))
                         else path)
    if order.file_crc32 is None:
        order.to_bytes()
    return order


def _served_counts(order, sample_index, config, path: Optional[str]):
    """The step counts served with a balanced order (the stored mask's: what this dataset trains),
    for the run's global batch size; None without an order (or counts)."""
    if order is None:
        return None
    return served_counts(order, sample_index, STORED, path=path,
                         global_batch_size=getattr(config, "global_batch_size", None))


def _layout_pack(pack, seq_len: int, pad: int, path: Optional[str]) -> Dict[str, torch.Tensor]:
    """One pack as Megatron-LM's packed SFT sample at ``seq_len`` (vectorised)."""
    n = pack.input_ids.shape[0]
    if n > seq_len:
        raise ShardError("pack is longer than sequence_length", path=path, field="input_ids",
                         expected=f"<= {seq_len}", actual=n)
    starts = np.asarray(pack.seq_start_id, dtype=np.int64)
    tokens = np.full(seq_len, pad, dtype=np.int64)
    tokens[:n] = pack.input_ids
    labels = np.full(seq_len, pad, dtype=np.int64)
    labels[: n - 1] = pack.input_ids[1:]
    loss = np.zeros(seq_len, dtype=np.float32)
    loss[:n] = pack.loss_mask
    loss[n - 1] = 0.0  # its label would be padding (matters for pretrain data: all-ones masks)
    seg = np.searchsorted(starts, np.arange(seq_len), side="right") - 1
    positions = np.arange(seq_len, dtype=np.int64) - starts[seg]
    cu = np.full(seq_len + 1, seq_len, dtype=np.int32)
    cu[: starts.shape[0]] = starts
    bounds = np.append(starts, seq_len)
    return {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(loss),
        "position_ids": torch.from_numpy(positions),
        "cu_seqlens": torch.from_numpy(cu),
        "max_seqlen": torch.tensor(int(np.diff(bounds).max()), dtype=torch.int32),
    }


# --------------------------------------------------------------------------- Megatron-LM provider


def config_from_args(args, tokenizer=None) -> SFTIndexedDatasetConfig:
    """The dataset config from Megatron-LM's parsed arguments.

    Reads ``--data-path`` or ``--train/valid/test-data-path``, ``--split``,
    ``--seq-length``, ``--seed``, ``--data-cache-path``, ``--num-dataset-builder-threads``,
    ``--context-parallel-size``, ``--sequence-parallel`` (with TP size), ``--fp8-recipe`` (with ``--fp8-format``),
    ``--micro-batch-size``, ``--global-batch-size``, ``--mid-level-dataset-surplus`` and
    ``pack_order_file`` (an argument a training script adds: a balanced order) when present.
    """
    per_split = [getattr(args, name, None) for name in ("train_data_path", "valid_data_path",
                                                       "test_data_path")]
    blend_per_split = parse_per_split_data_path(*per_split) if any(per_split) else None
    blend = None if blend_per_split else parse_data_path(getattr(args, "data_path", None))
    sp = getattr(args, "tensor_model_parallel_size", 1) if getattr(args, "sequence_parallel", False) else 0
    extra = {}
    if getattr(args, "fp8", None):   # (Megatron-LM: --fp8-format sets args.fp8, --fp8-recipe the recipe)
        extra["fp8_recipe"] = getattr(args, "fp8_recipe", None) or "delayed"
    if getattr(args, "mid_level_dataset_surplus", None) is not None:
        extra["mid_level_dataset_surplus"] = args.mid_level_dataset_surplus
    return SFTIndexedDatasetConfig(
        random_seed=getattr(args, "seed", 1234),
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=None if blend_per_split else getattr(args, "split", None) or "969,30,1",
        path_to_cache=getattr(args, "data_cache_path", None),
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        tokenizer=tokenizer,
        context_parallel_size=getattr(args, "context_parallel_size", 1) or 1,
        sequence_parallel_size=sp,
        hybrid_context_parallel=getattr(args, "hybrid_context_parallel", False),
        data_parallel_size=getattr(args, "data_parallel_size", 1) or 1,
        micro_batch_size=getattr(args, "micro_batch_size", None),
        global_batch_size=getattr(args, "global_batch_size", None),
        pack_order_file=getattr(args, "pack_order_file", None),
        **extra,
    )


def build_train_valid_test_datasets(args, train_val_test_num_samples, is_built_on_rank,
                                    tokenizer=None):
    """Build the three splits with megatron-core's builder (every rank calls it)."""
    config = config_from_args(args, tokenizer)
    return BlendedMegatronDatasetBuilder(SFTIndexedDataset, train_val_test_num_samples,
                                         is_built_on_rank, config).build()


def _is_dataset_built_on_rank() -> bool:
    return parallel_state.get_tensor_model_parallel_rank() == 0 and (
        parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        or parallel_state.is_pipeline_last_stage(ignore_virtual=True))


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron-LM ``pretrain(...)`` dataset provider for packed SFT shards.

    Pass it as ``train_valid_test_datasets_provider`` to ``megatron.training.pretrain``
    (e.g. in a copy of ``pretrain_gpt.py``); it reads the run's arguments and tokenizer.
    """
    from megatron.training import get_args, get_tokenizer   # (Megatron-LM's, not megatron-core's: only in its runs)

    return build_train_valid_test_datasets(get_args(), train_val_test_num_samples,
                                           _is_dataset_built_on_rank, get_tokenizer())


train_valid_test_datasets_provider.is_distributed = True
