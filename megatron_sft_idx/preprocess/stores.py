"""Several sequence stores read as one: the stores of a mixture's sources (:mod:`.mixture`).

A :class:`StoreSet` lists the stores in the mixture's source order and numbers their sequences
and partitions one after another: store ``j``'s sequence ``g`` is the set's sequence
``offsets[j] + g``, its partition ``k`` the set's partition ``part_offsets[j] + k``. That global
numbering is what a mixture's pack plan records (:mod:`.mixplan`) and what the materialize step
gathers by (:class:`~.materialize.Gatherer` reads partitions through :meth:`StoreSet.part`), so
the stages that make packs from one store make them from several unchanged. The source of a
sequence is the store it is in.

The stores must agree on what training sees (:func:`check_agreement`): one tokenizer (its files
and chat template), one vocabulary, loss mode and loss policy, the same template switches. What
may differ per source is how its records were read (input format, keys, ignored fields, the
record limit) and, for a template that reads the clock, the date it was rendered on.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import IncompatibleShardsError
from ..jsondoc import normal_json
from ..sets import tokenizer_difference
from .files import LOCAL, Files
from .receipts import settings_key
from .store import SequenceStore

#: The keys of a store's ``identity.encode`` every source of a mixture shares: what is trained,
#: and how the conversations are rendered (the others say how each source's records were read).
SHARED_ENCODE_KEYS = ("vocab_size", "loss_on", "loss_policy", "chat_template", "template_args")


def check_agreement(stores: Sequence[SequenceStore], names: Sequence[str]) -> None:
    """Refuse stores that cannot be trained as one mixture, naming both sources and what differs.

    Raises:
        IncompatibleShardsError: another tokenizer (files or chat template), or another
            vocabulary size, loss mode, loss policy, chat template or template switches.
    """
    first, name0 = stores[0], names[0]
    for store, name in zip(stores[1:], names[1:]):
        a, b = first.tokenizer, store.tokenizer
        if (a is None) != (b is None):
            raise IncompatibleShardsError(
                f"sources {name0!r} and {name!r} cannot be mixed: only {name0 if a else name!r} was tokenized with a "
                "tokenizer (the other holds pre-tokenized records)", path=store.directory, field="tokenizer",
                hint="tokenize every source with the same --tokenizer")
        if a is not None:
            diff = tokenizer_difference(a, b)
            if diff is not None:
                raise IncompatibleShardsError(f"sources {name0!r} and {name!r} cannot be mixed: {diff.words}",
                                              path=store.directory, field=diff.field, expected=diff.mine,
                                              actual=diff.theirs,
                                              hint="tokenize every source with the same tokenizer and template")
        ea, eb = first.identity["encode"], store.identity["encode"]
        for key in SHARED_ENCODE_KEYS:
            if normal_json(ea.get(key)) != normal_json(eb.get(key)):
                raise IncompatibleShardsError(
                    f"sources {name0!r} and {name!r} cannot be mixed: their stores were made with other {key} "
                    f"({_short(ea.get(key))} and {_short(eb.get(key))})", path=store.directory,
                    field=f"identity.encode.{key}", expected=_short(ea.get(key)), actual=_short(eb.get(key)),
                    hint="tokenize every source with the same --loss-on, loss policies, --chat-template and "
                         "--template-arg")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 48 else text[:45] + "..."


class StoreSet:
    """The stores of a mixture, in source order, read as one (module doc).

    Attributes besides a :class:`~.store.SequenceStore`'s (``inputs``, ``partitions`` and
    ``receipts`` are the stores', one after another, each partition naming its input in
    ``inputs``): ``stores``, ``names``, ``offsets`` (int64[S+1]: each store's first global
    sequence, then the total) and ``part_offsets`` (int64[S+1], partitions likewise).

    Raises:
        IncompatibleShardsError: see :func:`check_agreement`.
    """

    def __init__(self, stores: Sequence[SequenceStore], names: Sequence[str]) -> None:
        if not stores or len(stores) != len(names):
            raise ValueError("a store set needs one name per store, and a store")
        check_agreement(stores, names)
        self.stores: List[SequenceStore] = list(stores)
        self.names: List[str] = list(names)
        counts = [s.sequence_count for s in stores]
        self.offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self.part_offsets = np.concatenate(([0], np.cumsum([len(s.partitions) for s in stores]))).astype(np.int64)
        self.store_id = settings_key({"stores": [[n, s.store_id] for n, s in zip(names, stores)]})
        self.inputs: List[dict] = [i for s in stores for i in s.inputs]
        files = np.concatenate(([0], np.cumsum([len(s.inputs) for s in stores]))).astype(np.int64)
        self.partitions = [dataclasses.replace(p, file=p.file + int(files[j]))
                           for j, s in enumerate(stores) for p in s.partitions]
        self._input_offsets = files
        first = stores[0]
        self.identity = first.identity
        self.files = first.files
        self.body = first.body

    @property
    def directories(self) -> List[str]:
        return [s.directory for s in self.stores]

    @property
    def sequence_count(self) -> int:
        return int(self.offsets[-1])

    @property
    def receipts(self) -> List[dict]:
        return [r for s in self.stores for r in s.receipts]

    def counts(self) -> np.ndarray:
        return np.concatenate([s.counts() for s in self.stores]).astype(np.int64)

    def starts(self) -> np.ndarray:
        """First global sequence of each global partition, plus the total (int64[K+1])."""
        return np.concatenate(([0], np.cumsum(self.counts()))).astype(np.int64)

    def _locate(self, unit: int):
        j = int(np.searchsorted(self.part_offsets, unit, side="right")) - 1
        return self.stores[j], unit - int(self.part_offsets[j])

    def part(self, unit: int):
        store, k = self._locate(unit)
        return store.part(k)

    def part_prefix(self, unit: int) -> str:
        store, k = self._locate(unit)
        return store.part_prefix(k)

    def rows(self, unit: int) -> np.ndarray:
        store, k = self._locate(unit)
        return store.rows(k)

    def source_of(self, sequences) -> np.ndarray:
        """The source (store index) of global sequence ids (int64)."""
        return np.searchsorted(self.offsets, np.asarray(sequences, dtype=np.int64), side="right") - 1

    @property
    def vocab_size(self) -> Optional[int]:
        return self.stores[0].vocab_size

    @property
    def tokenizer(self) -> Optional[dict]:
        return self.stores[0].tokenizer

    @property
    def tokenizer_path(self) -> Optional[str]:
        return self.stores[0].tokenizer_path

    def input_path(self, file: int) -> str:
        j = int(np.searchsorted(self._input_offsets, file, side="right")) - 1
        return self.stores[j].input_path(file - int(self._input_offsets[j]))

    def __getstate__(self):
        return {"stores": self.stores, "names": self.names}

    def __setstate__(self, state) -> None:
        self.__init__(state["stores"], state["names"])


def open_stores(store_dir: Union[str, Tuple[str, ...]], names: Tuple[str, ...] = (), files: Files = LOCAL):
    """The store a run packs: one :class:`~.store.SequenceStore`, or -- ``store_dir`` a tuple of
    directories with their source ``names`` (a mixture) -- their :class:`StoreSet`.

    Raises:
        ShardError: see :class:`~.store.SequenceStore` and :class:`StoreSet`.
    """
    if isinstance(store_dir, str):
        return SequenceStore(store_dir, files=files)
    return StoreSet([SequenceStore(d, files=files) for d in store_dir], names)


def store_argument(store) -> Tuple[Union[str, Tuple[str, ...]], Tuple[str, ...]]:
    """``(store_dir, names)`` a step carries to open ``store`` where it runs (:func:`open_stores`)."""
    if isinstance(store, StoreSet):
        return tuple(store.directories), tuple(store.names)
    return store.directory, ()


__all__ = ["StoreSet", "check_agreement", "open_stores", "store_argument", "SHARED_ENCODE_KEYS"]
