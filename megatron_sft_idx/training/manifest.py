"""Deprecated: the old name of :mod:`megatron_sft_idx.manifest` (the manifest format), with
:func:`~megatron_sft_idx.publishing.write_manifest`. Importing this module warns once
(``FutureWarning``, :mod:`megatron_sft_idx._moved`); the names below keep working until the
version that table names."""

from .._moved import warn_moved

warn_moved(__name__)

from ..manifest import (  # noqa: E402
    MANIFEST_FORMAT, MANIFEST_SUFFIX, MANIFEST_VERSION, MAX_MANIFEST_BYTES, Manifest,
    check_manifest_set, is_manifest, load_manifest, parse_manifest, read_manifest)
from ..publishing import write_manifest  # noqa: E402

__all__ = ["Manifest", "load_manifest", "read_manifest", "write_manifest", "is_manifest", "MANIFEST_FORMAT",
           "MANIFEST_VERSION", "MAX_MANIFEST_BYTES", "MANIFEST_SUFFIX", "check_manifest_set", "parse_manifest"]
