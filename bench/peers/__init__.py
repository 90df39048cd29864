"""One module per storage system, each with the same small surface.

Every module defines:

- ``NAME`` / ``LABEL`` / ``TOUCHES`` (which digest columns its records carry: the
  upstream pretrain format holds tokens only);
- ``write(corpus, out_dir) -> dict``: write the corpus the way that system's writer
  does; returns ``{"write_s": seconds}`` (from creating the writer to the final file);
- optionally ``prepare_writer()``: imports a writer needs, done before the RSS baseline;
- ``files(out_dir) -> list[path]``: what it wrote (for bytes on disk);
- ``open_reader(out_dir)``: what that system's dataset constructor does, returning an
  object with ``__len__`` and ``__getitem__`` giving the system's own record;
- ``touch(record) -> tuple``: ``(length, sum ids, sum loss, sum starts)`` reading every
  value of the record, so lazy views are really read;
- ``as_arrays(record) -> (ids, loss, starts)`` numpy copies (correctness checks only);
- optionally ``get(reader, i)`` (a reader's own ``get`` method, fetch only) and
  ``get_many(reader, indices) -> records`` (a batched fetch), measured where offered.
"""

from importlib import import_module

SYSTEMS = ("ours", "upstream", "option_a", "parquet", "legacy_npy")
PEERS = tuple(s for s in SYSTEMS if s != "ours")
#: Loadable, not in the default comparison: upstream's format carrying SFT data as three datasets
#: (``bench.hotpath``'s like-for-like peer for reading all three arrays).
EXTRA = ("upstream_sft",)


def load(name: str):
    """The module of system ``name``.

    Raises:
        KeyError: an unknown system name.
    """
    if name not in SYSTEMS + EXTRA:
        raise KeyError(f"unknown system {name!r}; known: {', '.join(SYSTEMS + EXTRA)}")
    return import_module(f"{__name__}.{name}")
