"""The sample order every training adapter serves: which pack each sample position reads.

Megatron-LM's ``SFTIndexedDataset`` (its sample index), Megatron-Bridge's ``PackedSFTDataset``
and TRL's ``PaddingFreeDataset`` (their samples mapping) all serve ``num_samples`` positions
from the packs of one epoch (a split's pack indices, or every pack) by :func:`sample_index`:

* **a balanced order** (docs/BATCHING.md; found and checked by :func:`.serve.served_order`):
  its first ``num_samples`` positions, epochs from 0 concatenated; an order holding fewer
  epochs than the samples need is refused;
* **else whole epochs of the packs**, concatenated and cut at ``num_samples``. Epoch ``e`` is
  the ``(e+1)``-th draw of one ``numpy.random.RandomState(seed)``: ``rng.permutation(packs)``
  (:func:`.layout.base_permutation` draws the same for ``packs = range(n)``), or
  ``order(source, packs, rng)`` when a pack order is given (the block-local order of
  :mod:`megatron_sft_idx.locality`, which reads object storage a block at a time), or the
  packs as they are (``shuffle=False``).

The order is a function of its arguments alone, so it is the same in every rank, every worker
and after a restart. Imports nothing but numpy: the adapters import it at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np

from ..errors import ShardError

if TYPE_CHECKING:   # (.order imports the numba kernels: an adapter without a balanced order never needs them)
    from .order import Order

__all__ = ["sample_index", "PackOrder", "sources_of", "token_sources"]

#: ``order(source, packs, rng) -> packs permuted``: one epoch's order in place of
#: ``rng.permutation(packs)`` (e.g. :class:`~megatron_sft_idx.locality.BlockLocalOrder`).
PackOrder = Callable[[object, np.ndarray, np.random.RandomState], np.ndarray]


def sample_index(num_samples: int, packs: Union[int, np.ndarray], *, seed: int, shuffle: bool = True,
                 order: Optional[PackOrder] = None, source=None, balanced: Optional["Order"] = None,
                 path: Optional[str] = None, field: str = "balanced_order") -> np.ndarray:
    """The pack each of ``num_samples`` sample positions serves (module doc).

    Args:
        num_samples: positions to serve (>= 0): several epochs, the last one cut short.
        packs: one epoch's packs: ``n`` (packs ``0..n-1``) or their indices (a split's, int).
        seed: the run's data seed (the ``RandomState`` of the shuffle).
        shuffle: False serves each epoch's packs as given.
        order: a :data:`PackOrder` drawing each epoch instead of ``rng.permutation``, called
            with ``source``.
        balanced: a checked :class:`~.order.Order` of all ``n`` packs: served instead of the
            shuffle (so neither ``order`` nor ``shuffle=False`` may come with it).
        path, field: the data and the option a refusal names.

    Returns:
        Read-only pack indices, ``num_samples`` of them: int32 while every pack index fits,
        else int64.

    Raises:
        ShardError: a negative count, samples asked of no packs, a balanced order of another
            pack count, holding fewer epochs than asked, or given with ``order`` or
            ``shuffle=False``.
    """
    count = int(num_samples)
    packs = np.arange(packs, dtype=np.int64) if np.isscalar(packs) else np.asarray(packs)
    n = int(packs.shape[0])
    if count < 0 or (count and not n):
        raise ShardError("a sample order needs packs and a non-negative sample count", path=path,
                         field="max_num_samples", actual=(n, count))
    dtype = np.int32 if n == 0 or int(packs.max()) <= np.iinfo(np.int32).max else np.int64
    if balanced is not None:
        out = _balanced(balanced, count, n, shuffle, order, path, field).astype(dtype)
    else:
        out = np.empty(-(-count // n) * n if n else 0, dtype=dtype)
        rng = np.random.RandomState(seed)
        for e in range(len(out) // max(n, 1)):   # one vectorised draw per epoch: O(epochs) Python steps
            out[e * n:(e + 1) * n] = (packs if not shuffle else rng.permutation(packs) if order is None
                                      else order(source, packs, rng))
        out = out[:count]
    out.flags.writeable = False
    return out


def sources_of(source, path: Optional[str] = None) -> tuple:
    """The source names of a packed ``source`` whose shards record each sequence's source (format
    1.2: a mixture's; :attr:`~megatron_sft_idx.reader.MMapIndexedDataset.sources`): what the
    adapters' ``source_ids`` index.

    Raises:
        ShardError: the data records no sources.
    """
    names = getattr(source, "sources", None)
    if not names:
        raise ShardError("return_source_ids needs data that records each sequence's source", path=path,
                         field="return_source_ids",
                         hint="write it with preprocess-sft/repack-sft --mix (docs/PREPROCESSING.md, Mixtures)")
    return tuple(names)


def token_sources(sequence_sources, lengths, size: int) -> np.ndarray:
    """Each position's source id (int64[size]): sequence ``k``'s id over its ``lengths[k]``
    positions, in order, then -1 (padding)."""
    out = np.full(int(size), -1, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    n = int(lengths.sum())
    out[:n] = np.repeat(np.asarray(sequence_sources, dtype=np.int64), lengths)
    return out


def _balanced(balanced: "Order", count: int, n: int, shuffle: bool, order, path: Optional[str],
              field: str) -> np.ndarray:
    if order is not None or not shuffle:
        raise ShardError("a balanced order replaces the shuffle: give it without a pack order and with the "
                         "shuffle on", path=path, field=field)
    if balanced.num_packs != n:
        raise ShardError("the balanced order permutes another number of packs than the data holds", path=path,
                         field=field, expected=balanced.num_packs, actual=n, hint="re-plan the order for this data")
    if count > balanced.epochs * n:
        need = -(-count // max(1, n))
        raise ShardError(f"{count} samples need {need} epochs of the balanced order; it holds {balanced.epochs}",
                         path=path, field=field, expected=f">= {need} epochs", actual=balanced.epochs,
                         hint="plan more epochs (--balance-epochs, plan-batches --epochs)")
    return balanced.sample_index(count)
