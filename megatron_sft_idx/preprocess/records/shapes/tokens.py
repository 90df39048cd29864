"""Kind ``tokens``: pre-tokenized ``{"input_ids", "loss_mask" | "answer_start_idx"}``, taken as they are."""

from __future__ import annotations

from ..errors import input_error

KIND = "tokens"
#: the record-level keys this shape reads
FIELDS = frozenset({"input_ids", "loss_mask", "answer_start_idx"})


def token_record(record: dict, path: str, line: int):
    """Pre-tokenized record -> ``(input_ids, loss_mask or None, answer_start_idx or None)``."""
    if "input_ids" not in record:
        raise input_error("missing key 'input_ids'", path, line, field="input_ids", reason="missing_key")
    ids = record["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise input_error("'input_ids' must be a non-empty list of integers", path, line,
                          field="input_ids", reason="missing_key")
    mask = record.get("loss_mask")
    start = record.get("answer_start_idx")
    if mask is None and start is None:
        raise input_error("pre-tokenized record needs 'loss_mask' or 'answer_start_idx'", path, line,
                          field="loss_mask", reason="missing_key")
    if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids)):
        raise input_error(f"'loss_mask' must be a list as long as 'input_ids' ({len(ids)})", path, line,
                          field="loss_mask", reason="missing_key")
    if mask is None and (not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < len(ids)):
        raise input_error(f"'answer_start_idx' must be an integer in [0, {len(ids)})", path, line,
                          field="answer_start_idx", reason="missing_key")
    return ids, mask, start
