"""Tokenizing one batch of raw records: the one call the tokenize stage makes per batch.

``RecordEncoder(options).encode_batch(records, path)`` parses, tokenizes and masks a batch
and returns every kept sequence concatenated (:class:`EncodedBatch`); bad records raise
:class:`InputError` naming ``file:line``, or are counted by reason under ``skip_bad``.
Nothing here depends on the pack size: overlong sequences are the plan stage's business, so
one sequence store serves every pack size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .chat import ChatTokenizer, encode_tokens
from .errors import InputError, input_error
from .inputs import parse_record


@dataclass(frozen=True)
class EncodeOptions:
    """What a worker needs to turn raw records into (ids, label-aligned mask)."""

    tokenizer_path: Optional[str]
    vocab_size: Optional[int]
    loss_on: str
    input_format: str
    prompt_key: str
    completion_key: str
    skip_bad: bool

    def to_dict(self) -> dict:
        return {"vocab_size": self.vocab_size, "loss_on": self.loss_on, "input_format": self.input_format,
                "prompt_key": self.prompt_key, "completion_key": self.completion_key,
                "skip_bad": self.skip_bad}


@dataclass
class EncodedBatch:
    """The kept sequences of one batch, concatenated.

    Attributes:
        ids: int64, every kept sequence's token ids back to back.
        mask: uint8, the label-aligned loss mask, aligned with ``ids``.
        lengths: int64, tokens per kept sequence.
        lines: int64, source line (row) per kept sequence.
        skipped: records skipped per reason; ``first_skipped``: the first message per reason.
    """

    ids: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    lines: np.ndarray
    skipped: Dict[str, int] = field(default_factory=dict)
    first_skipped: Dict[str, str] = field(default_factory=dict)


class RecordEncoder:
    """Encodes batches of raw records; one per worker process (the tokenizer loads once)."""

    def __init__(self, options: EncodeOptions) -> None:
        self.options = options
        self.tokenizer = ChatTokenizer(options.tokenizer_path) if options.tokenizer_path else None

    def encode_record(self, raw, path: str, line: int) -> Tuple[np.ndarray, np.ndarray]:
        """Token ids and label-aligned mask of one record.

        Raises:
            InputError: the record is unusable (reason attached for ``--skip-bad``).
        """
        o = self.options
        kind, payload = parse_record(raw, path, line, o.input_format, o.prompt_key, o.completion_key)
        if kind == "tokens":
            return encode_tokens(*payload, o.vocab_size, path, line)
        if self.tokenizer is None:
            raise input_error(f"{kind} records need --tokenizer", path, line, reason="missing_key",
                              hint="pass --tokenizer PATH (a local Hugging Face tokenizer)")
        if kind == "chat":
            return self.tokenizer.encode_chat(payload, o.loss_on, path, line)
        return self.tokenizer.encode_prompt(*payload, path, line)

    def encode_batch(self, records: Sequence[tuple], path: str) -> EncodedBatch:
        """Encode ``[(line, raw), ...]`` of file ``path``.

        Raises:
            InputError: the first bad record, unless ``skip_bad``.
        """
        ids: List[np.ndarray] = []
        masks: List[np.ndarray] = []
        lines: List[int] = []
        skipped: Dict[str, int] = {}
        first: Dict[str, str] = {}
        for line, raw in records:
            try:
                seq, mask = self.encode_record(raw, path, line)
            except InputError as err:
                if not self.options.skip_bad:
                    raise
                reason = getattr(err, "reason", "bad_record")
                skipped[reason] = skipped.get(reason, 0) + 1
                first.setdefault(reason, str(err))
                continue
            ids.append(seq)
            masks.append(mask)
            lines.append(line)
        lengths = np.array([s.size for s in ids], dtype=np.int64)
        return EncodedBatch(
            ids=np.concatenate(ids) if ids else np.empty(0, np.int64),
            mask=np.concatenate(masks) if masks else np.empty(0, np.uint8),
            lengths=lengths, lines=np.asarray(lines, dtype=np.int64), skipped=skipped, first_skipped=first)
