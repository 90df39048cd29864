"""Packed shards as the JSONL rows NeMo-RL's ``MegatronSFTPackedDataset`` reads (PR #3380).

That dataset (``nemo_rl/data/datasets/response_datasets/megatron_sft_packed.py`` and
``nemo_rl/data/megatron_sft_packed.py``, open at ``a944f7c8``) takes one JSONL row per pack:
``{"messages": [...]}``, text messages, the row starting with a ``system`` message and ending
with an ``assistant`` one. It splits a row into sequences at every ``system`` message and
tokenizes each again with a fixed template; under ``megatron_sft_prompt_format: identity``
a sequence's tokens are the tokenizer's ids of its messages' contents concatenated (no special
tokens added). No mask travels: identity trains every label but padding and the first token of
each later sequence. docs/TRAINING.md ("NeMo-RL #3380") says what it then trains differently.

Written, one row per pack of the shard, in pack order; per stored sequence two messages:

* ``system``: the text of the tokens before the sequence's first trained token (the prompt),
* ``assistant``: the text of the rest (empty for a sequence that trains nothing),

each the tokenizer's decoding of those ids with special tokens kept. Every sequence is
re-encoded before it is written and must give back exactly its ids (``rule``
:data:`ROUND_TRIP`): when the split text does not, the whole text goes into ``assistant``
(``system`` empty); when that does not either (a decoding that loses bytes, a literal
special-token string that was tokenized as text, a normalizer), nothing is written and the
error names the pack and sequence. Shards padded for context parallelism are refused: #3380
pads each sequence itself (``megatron_sft_context_parallel_size``), and padding written as
text would come back as content.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .._atomic import write_file_atomically
from ..errors import ShardError
from ..reader import MMapIndexedDataset

#: The consumer named by ``repack-sft --for``.
NEMO_RL_3380 = "nemo-rl-3380"
#: The rule a sequence's text must keep.
ROUND_TRIP = "identity re-tokenization of the written text gives back the stored ids"
#: The file written beside each shard: ``P`` + this.
JSONL_SUFFIX = ".nemo_rl.jsonl"


def load_text_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from a directory holding ``tokenizer.json`` (or that file)."""
    from tokenizers import Tokenizer   # (start-up: the tokenizers package, only for this writer)

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ShardError("no tokenizer.json to decode the shard's tokens", path=path, field="tokenizer",
                         hint="give --tokenizer the directory of the tokenizer the store was made with")
    return Tokenizer.from_file(file)


def sequence_messages(tokenizer, ids: Sequence[int], loss_mask: np.ndarray) -> Optional[Tuple[str, str]]:
    """``(system, assistant)`` texts whose concatenation re-encodes to ``ids``, or None.

    ``loss_mask`` is label-aligned (``loss_mask[j]`` trains token ``j + 1``): the split is
    before token ``j + 1`` of the first trained ``j``.
    """
    ids = [int(x) for x in ids]
    trained = np.flatnonzero(np.asarray(loss_mask))
    cut = int(trained[0]) + 1 if trained.size else len(ids)
    whole = tokenizer.decode(ids, skip_special_tokens=False)
    candidates = [(tokenizer.decode(ids[:cut], skip_special_tokens=False),
                   tokenizer.decode(ids[cut:], skip_special_tokens=False)), ("", whole)]
    for system, assistant in candidates:
        if tokenizer.encode(system + assistant, add_special_tokens=False).ids == ids:
            return system, assistant
    return None


def _first_difference(tokenizer, ids: List[int]) -> Tuple[int, list, list]:
    back = tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False), add_special_tokens=False).ids
    j = next((j for j in range(min(len(ids), len(back))) if ids[j] != back[j]), min(len(ids), len(back)))
    return j, ids[j:j + 4], back[j:j + 4]


def _row(shard: MMapIndexedDataset, shard_prefix: str, i: int, tokenizer, counts: dict) -> str:
    """Pack ``i``'s JSONL line (counted into ``counts``)."""
    pack = shard[i]
    bounds = pack.seq_boundaries
    messages = []
    for k in range(len(bounds) - 1):
        ids = np.asarray(pack.input_ids[bounds[k]:bounds[k + 1]]).tolist()
        texts = sequence_messages(tokenizer, ids, pack.loss_mask[bounds[k]:bounds[k + 1]])
        if texts is None:
            j, stored, back = _first_difference(tokenizer, ids)
            raise ShardError(f"sequence {k} does not survive decoding and re-encoding (from token {j}: "
                             f"stored {stored}, re-encoded {back})", path=shard_prefix, pack=i,
                             field="input_ids", rule=ROUND_TRIP,
                             hint="train from the shards with megatron_sft_idx.training.nemo_rl."
                                  "NemoRLPackedDataset, which needs no text")
        counts["split_at_reply" if texts[0] else "whole_in_assistant"] += 1
        messages += [{"role": "system", "content": texts[0]}, {"role": "assistant", "content": texts[1]}]
        counts["sequences"] += 1
        counts["tokens"] += len(ids)
    counts["rows"] += 1
    return json.dumps({"messages": messages}, ensure_ascii=False) + "\n"


def write_nemo_rl_jsonl(shard_prefix: str, tokenizer_path: str, output_path: Optional[str] = None, *,
                        overwrite: bool = False) -> dict:
    """Write ``output_path`` (default ``shard_prefix`` + :data:`JSONL_SUFFIX`) from one shard.

    Returns:
        ``{"rows", "sequences", "tokens", "split_at_reply", "whole_in_assistant", "max_seq_length",
        "pad_id", "pad_token", "path"}``: ``max_seq_length`` is the shard's pack size (give it
        to #3380 as ``max_input_seq_length``; a row longer than it is truncated there),
        ``pad_token`` the token to give as ``megatron_sft_pad_token`` (its identity default
        ``<unk>`` is no token of most tokenizers).

    Raises:
        ShardError: an existing output without ``overwrite``; a shard padded for context
            parallelism; a sequence whose text does not re-encode to its ids (naming the pack,
            the sequence and the first differing position).
    """
    shard = MMapIndexedDataset(shard_prefix)
    meta = shard.metadata
    path = output_path or shard_prefix + JSONL_SUFFIX
    if os.path.exists(path) and not overwrite:
        raise ShardError("the output exists", path=path, hint="give another --output-prefix, or --overwrite")
    if meta.pad_seq_to_mult > 1:
        raise ShardError(f"the shard's sequences are padded to multiples of {meta.pad_seq_to_mult}; #3380 pads "
                         "them itself and would read the padding as text", path=shard_prefix,
                         field="pad_seq_to_mult", expected=1, actual=meta.pad_seq_to_mult,
                         hint="repack without --cp/--tp/--sp/--fp8 and set megatron_sft_context_parallel_size "
                              "in NeMo-RL instead")
    tokenizer = load_text_tokenizer(tokenizer_path)
    pad_id = (meta.tokenizer or {}).get("pad_id")
    counts = {"rows": 0, "sequences": 0, "tokens": 0, "split_at_reply": 0, "whole_in_assistant": 0}

    def write(f) -> None:   # streamed: one pack's row at a time
        for i in range(len(shard)):
            f.write(_row(shard, shard_prefix, i, tokenizer, counts).encode("utf-8"))

    write_file_atomically(path, write)
    counts.update(path=path, max_seq_length=meta.pack_size, pad_id=pad_id,
                  pad_token=None if pad_id is None else tokenizer.id_to_token(int(pad_id)))
    return counts
