"""Another name of :mod:`megatron_sft_idx.manifest` (the manifest format), with
:func:`~megatron_sft_idx.publishing.write_manifest`, kept so that code importing them from here keeps
working."""

from ..manifest import (MANIFEST_FORMAT, MANIFEST_SUFFIX, MANIFEST_VERSION, MAX_MANIFEST_BYTES, Manifest,
                        check_manifest_set, is_manifest, load_manifest, parse_manifest, read_manifest)
from ..publishing import write_manifest

__all__ = ["Manifest", "load_manifest", "read_manifest", "write_manifest", "is_manifest", "MANIFEST_FORMAT",
           "MANIFEST_VERSION", "MAX_MANIFEST_BYTES", "MANIFEST_SUFFIX", "check_manifest_set", "parse_manifest"]
