"""``inspect-idx --consumers``: how many positions each supported consumer trains on a shard.

The stored mask is label-aligned; consumers differ in which stored positions they train
(:data:`megatron_sft_idx.legacy.CONSUMER_LOSS_RULES`): Megatron-LM's dataset, Megatron-Bridge
``main`` (the next release) under ``answer_only_loss`` and the TRL / transformers padding-free
adapter train the stored mask; Megatron-Bridge 0.6's collate zeroes it at EOS inputs. The audit
reads ``.bin`` and ``.loss.bin`` a chunk of packs at a time (bounded memory) and counts, per
consumer, the positions trained, plus the EOS inputs the two Bridge versions disagree on and,
for context-parallel data, the trained EOS alignment padding. The EOS id comes from
``--eos-id``, else from a conversion's record (``source.converted_from.bridge_eos_id``), else
from the tokenizer the shard records (``tokenizer.eos_id``: the id Bridge's tokenizer gives as
``eos_id``); each shard's ``eos_from`` says which. Without any, Bridge 0.6's count is unknown
and says so.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..legacy import (CONSUMER_LOSS_RULES, LOSS_BRIDGE_06, consumer_loss_counts, converted_eos_id,
                      converted_loss_state)
from ..reader import MMapIndexedDataset

__all__ = ["consumer_audit", "format_consumer_audit", "CHUNK_TOKENS"]

#: Tokens read per chunk (whole packs; at least one pack).
CHUNK_TOKENS = 1 << 20
_SUMMED = ("megatron-lm", "megatron-bridge-0.6", "megatron-bridge-next", "trl-padding-free",
           "eos_inputs_trained", "alignment_padding_trained")
_FROM = {"--eos-id": "--eos-id", "conversion": "the conversion's record", "tokenizer": "the recorded tokenizer"}


def _shard_counts(shard: MMapIndexedDataset, eos_id: Optional[int]) -> Dict[str, Any]:
    arrays = shard.arrays()
    lengths = np.asarray(arrays.sequence_lengths, dtype=np.int64)
    offsets = np.asarray(arrays.seq_offsets, dtype=np.int64)
    token_off = np.concatenate(([0], np.cumsum(lengths)))
    mult = int(shard.metadata.pad_seq_to_mult or 1)
    total: Dict[str, Any] = {k: 0 for k in _SUMMED}
    first = None
    a = 0
    while a < len(shard):
        b = max(a + 1, int(np.searchsorted(token_off, token_off[a] + CHUNK_TOKENS, side="right")) - 1)
        b = min(b, len(shard))
        lo, hi = int(token_off[a]), int(token_off[b])
        part = consumer_loss_counts(np.asarray(arrays.tokens[lo:hi]), np.asarray(arrays.loss_mask[lo:hi]),
                                    np.asarray(arrays.seq_starts[offsets[a]:offsets[b]]), offsets[a:b + 1] - offsets[a],
                                    lengths[a:b], eos_id=eos_id, pad_seq_to_mult=mult)
        for key in _SUMMED:
            total[key] = None if part[key] is None or total[key] is None else total[key] + part[key]
        if first is None and part["first_alignment_pack"] is not None:
            first = a + part["first_alignment_pack"]
        shard.release_pages()
        a = b
    total["first_alignment_pack"] = first
    return total


def _eos_of(metadata, given: Optional[int]) -> Tuple[Optional[int], Optional[str]]:
    """``(EOS id, where it came from)``: ``--eos-id``, a conversion's record, the recorded tokenizer."""
    if given is not None:
        return given, "--eos-id"
    converted = converted_eos_id(metadata)
    if converted is not None:
        return converted, "conversion"
    recorded = (metadata.tokenizer or {}).get("eos_id")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 0:
        return recorded, "tokenizer"
    return None, None


def consumer_audit(prefixes: Sequence[str], eos_id: Optional[int] = None) -> Dict[str, Any]:
    """Per shard and in total: positions each consumer trains (module doc); JSON-ready.

    Raises:
        ShardError (any subclass): a shard is missing or unreadable.
    """
    shards = []
    for prefix in prefixes:
        shard = MMapIndexedDataset(prefix)
        eos, origin = _eos_of(shard.metadata, eos_id)
        counts = _shard_counts(shard, eos)
        shards.append({"shard": shard.prefix, "eos_id": eos, "eos_from": origin, "tokens": int(shard.num_tokens),
                       "pad_seq_to_mult": int(shard.metadata.pad_seq_to_mult or 1),
                       "converted_loss": converted_loss_state(shard.metadata), **counts})
    total = {k: (None if any(s[k] is None for s in shards) else sum(s[k] for s in shards)) for k in _SUMMED}
    return {"rules": dict(CONSUMER_LOSS_RULES), "total": total, "shards": shards}


def format_consumer_audit(audit: Dict[str, Any]) -> str:
    """The audit as text: one line per consumer, then what to know."""
    total, shards = audit["total"], audit["shards"]
    where = shards[0]["shard"] if len(shards) == 1 else f"{len(shards)} shards ({shards[0]['shard']}, ...)"
    origins = sorted({f"{s['eos_id']} from {_FROM[s['eos_from']]}" for s in shards if s["eos_id"] is not None})
    lines: List[str] = [f"{where}: positions each consumer trains"
                        + (f" (EOS id {', '.join(origins)})" if origins else "")]
    for name, rule in audit["rules"].items():
        value = total[name]
        count = f"{value:,}" if value is not None else "unknown (pass --eos-id)"
        lines.append(f"  {name:<22} {count:>14}   {rule}")
    if total["eos_inputs_trained"]:
        lines.append(f"  EOS inputs with stored loss 1: {total['eos_inputs_trained']:,} (Bridge main trains them, "
                     "0.6 does not)")
    if total["alignment_padding_trained"]:
        first = next(s for s in shards if s["first_alignment_pack"] is not None)
        lines.append(f"  of which EOS alignment padding: {total['alignment_padding_trained']:,} "
                     f"(first: {first['shard']}, pack {first['first_alignment_pack']})")
    for s in shards:
        if s["converted_loss"] == LOSS_BRIDGE_06:
            lines.append(f"  {s['shard']}: converted with Bridge 0.6's normalisation (EOS inputs zeroed when "
                         "--eos-id was given): Bridge main trains more on the original; re-convert it")
    return "\n".join(lines)
