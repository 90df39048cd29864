"""What a mixture run (``--mix``, :func:`~.driver.run` and :func:`~.driver.repack`) resolves of its
sources before the stages: the inputs of each source that names some (the run's tokenizer and
encoding settings, the source's own inputs and partition size), each kept store opened where
the workspace makes it readable, and what of a source's tokenizing the run key digests.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional

from ..errors import ShardError
from .records.partitions import auto_partition_bytes
from .store import SequenceStore
from .tokenize import Inputs, resolve_inputs
from .workspace import Workspace


def source_inputs(cfg, mixture) -> Dict[int, tuple]:
    """``{source: (its configuration, its resolved Inputs)}`` of the sources with inputs: the run's
    tokenizer and encoding settings, each source's own inputs and partition size."""
    out = {}
    for i, src in enumerate(mixture.sources):
        if src.inputs:
            mine = replace(cfg, inputs=list(src.inputs), mix=None)
            inputs = resolve_inputs(mine)
            if mine.tokenize.partition_bytes is None:   # auto: from this source's inputs
                mine = replace(mine, tokenize=replace(mine.tokenize, partition_bytes=auto_partition_bytes(
                    sum(size for _, size, _ in inputs.stat()))))
            out[i] = (mine, inputs)
    return out


def kept_store(ws: Optional[Workspace], mixture, index: int, tokenize: bool) -> SequenceStore:
    """A source's kept store, opened (its description and receipts; verified by the run); without
    a workspace (``--plan-only``) read here whole.

    Raises:
        ShardError: none there (naming the source and what to do), or an incomplete one.
    """
    src = mixture.sources[index]
    try:
        if ws is None:
            return SequenceStore(src.store)
        return SequenceStore(ws.open_kept_store(index), files=ws.files)
    except ShardError as exc:
        hint = ("tokenize it with preprocess-sft --mix (the source names inputs)" if src.inputs and not tokenize
                else "give the store of a preprocess-sft run, or inputs to tokenize into it")
        raise ShardError(f"source {src.name!r}: {exc.message}", path=src.store, field=f"sources[{index}].store",
                         hint=hint) from None


def tokenize_key(cfg, inputs: Inputs) -> dict:
    """What of a source's tokenizing the run key digests (as :func:`~.driver.run`'s key does)."""
    return {"tokenizer": inputs.tokenizer, "encode": inputs.options.to_dict(), "inputs": inputs.paths,
            "partition_bytes": cfg.tokenize.partition_bytes, "max_record_bytes": cfg.tokenize.max_record_bytes}


__all__ = ["source_inputs", "kept_store", "tokenize_key"]
