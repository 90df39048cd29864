"""Input files: expansion of files/globs/directories, streaming readers, record parsing.

Records are read (:mod:`.partitions`) as raw lines (JSONL, ``.jsonl.gz``, ``.jsonl.zst``)
or rows (Parquet); each keeps its 1-based line (row) number so that every
error names ``file:line``. Parsing happens in the tokenizer workers, and refuses
what would otherwise reach the tokenizer as a traceback or a memory blow-up: a
line longer than ``--max-record-bytes`` (never buffered whole), JSON nested
deeper than Python's recursion limit, and text holding a lone UTF-16 surrogate
(``"\ud800"`` escapes, or CESU-8 bytes, which JSON decoding lets through).

Record kinds (``--input-format auto`` tells them apart by their keys):

============  =====================================================================
chat          ``{"messages": [{"role", "content"}, ...]}`` (OpenAI / Hugging Face)
sharegpt      ``{"conversations": [{"from", "value"}, ...]}``
tokens        ``{"input_ids": [...], "loss_mask": [...]}`` or ``"answer_start_idx"``
prompt        ``{"prompt": str, "completion": str}`` (keys set by --prompt-key/--completion-key)
============  =====================================================================
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
from typing import List, NamedTuple, Sequence

from .._extras import require_extra
from .errors import InputError, input_error

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
INPUT_FORMATS = ("auto", "chat", "sharegpt", "tokens", "prompt")


class OversizedRecord(NamedTuple):
    """Stands for a record longer than the limit; only its size in bytes is kept."""

    size: int


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
                  "tool": "tool", "function": "tool"}


def _is_input_file(path: str) -> bool:
    return path.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)


def expand_inputs(specs: Sequence[str]) -> List[str]:
    """Files named by ``specs`` (files, globs, directories searched recursively), sorted within
    each glob or directory, first occurrence kept. Directories contribute only
    ``.jsonl[.gz|.zst]`` and ``.parquet`` files; a file named directly may have any name.

    Raises:
        InputError: a spec matches no input file.
    """
    out: List[str] = []
    seen = set()
    for spec in specs:
        if os.path.isdir(spec):
            found = sorted(p for p in glob.glob(os.path.join(spec, "**", "*"), recursive=True)
                           if os.path.isfile(p) and _is_input_file(p))
        elif os.path.isfile(spec):
            found = [spec]
        else:
            found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not found:
            raise InputError("no input files match", path=spec,
                             hint="give files, globs or directories holding .jsonl[.gz|.zst] or .parquet")
        for path in found:
            key = os.path.abspath(path)
            if key not in seen:
                seen.add(key)
                out.append(path)
    return out


def file_digest(path: str) -> str:
    """sha256 of the file's bytes as stored (compressed files are hashed compressed)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def open_text_bytes(path: str):
    """A binary stream of the file's (decompressed) bytes."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        require_extra("preprocess", "zstandard")
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def parse_record(raw, path: str, line: int, input_format: str, prompt_key: str, completion_key: str):
    """Decode one raw record into ``(kind, payload)``.

    ``kind`` is ``chat`` (payload: list of ``{"role", "content"}``), ``tokens``
    (payload: ``(input_ids, loss_mask or None, answer_start_idx or None)``) or
    ``prompt`` (payload: ``(prompt, completion)``).

    Raises:
        InputError: malformed JSON, missing or ill-typed keys, an empty conversation.
    """
    if isinstance(raw, OversizedRecord):
        raise input_error(f"record of {raw.size} bytes exceeds --max-record-bytes", path, line,
                          reason="record_too_large",
                          hint="raise --max-record-bytes (a worker's memory grows with it), or --skip-bad")
    if isinstance(raw, (bytes, str)):
        try:
            record = json.loads(raw)
        except ValueError as exc:
            raise input_error(f"malformed JSON ({exc})", path, line, reason="malformed_json") from None
        except RecursionError:
            raise input_error("JSON nested too deeply to parse", path, line, reason="json_too_deep",
                              hint="no conversation needs this nesting; fix the record or pass --skip-bad") from None
    else:
        record = raw
    if not isinstance(record, dict):
        raise input_error("record is not a JSON object", path, line, reason="malformed_json")
    kind = input_format if input_format != "auto" else _detect(record, prompt_key)
    if kind is None:
        raise input_error(f"record has none of the keys 'messages', 'conversations', 'input_ids', "
                          f"'{prompt_key}'", path, line, reason="missing_key",
                          hint="set --input-format/--prompt-key to match the data, or --skip-bad")
    if kind == "chat":
        return "chat", _chat_messages(record, path, line)
    if kind == "sharegpt":
        return "chat", _sharegpt_messages(record, path, line)
    if kind == "tokens":
        return "tokens", _token_record(record, path, line)
    return "prompt", _prompt_record(record, path, line, prompt_key, completion_key)


def _detect(record: dict, prompt_key: str):
    for key, kind in (("messages", "chat"), ("conversations", "sharegpt"), ("input_ids", "tokens"),
                      (prompt_key, "prompt")):
        if key in record:
            return kind
    return None


def _need(record: dict, key: str, path: str, line: int):
    if key not in record:
        raise input_error(f"missing key '{key}'", path, line, field=key, reason="missing_key")
    return record[key]


def _turns(value, path, line, key):
    if not isinstance(value, list):
        raise input_error(f"'{key}' must be a list of turns", path, line, field=key, reason="missing_key")
    if not value:
        raise input_error("empty conversation", path, line, field=key, reason="empty_conversation")
    return value


def _text(value: str, path: str, line: int, field: str) -> str:
    """``value``, refused if it holds a lone surrogate (not encodable as UTF-8, so a tokenizer
    would raise on it)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise input_error(f"'{field}' holds a lone UTF-16 surrogate {value[exc.start]!r} at character "
                              f"{exc.start}", path, line, field=field, reason="invalid_unicode",
                              hint="the text is not valid Unicode; fix the producer or pass --skip-bad") from None
    return value


def _chat_messages(record, path, line):
    out = []
    for i, m in enumerate(_turns(_need(record, "messages", path, line), path, line, "messages")):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise input_error(f"messages[{i}] needs string 'role' and 'content'", path, line,
                              field=f"messages[{i}]", reason="missing_key")
        out.append({"role": _text(m["role"], path, line, f"messages[{i}].role"),
                    "content": _text(m["content"], path, line, f"messages[{i}].content")})
    return out


def _sharegpt_messages(record, path, line):
    out = []
    for i, m in enumerate(_turns(_need(record, "conversations", path, line), path, line, "conversations")):
        if not isinstance(m, dict) or not isinstance(m.get("from"), str) or not isinstance(m.get("value"), str):
            raise input_error(f"conversations[{i}] needs string 'from' and 'value'", path, line,
                              field=f"conversations[{i}]", reason="missing_key")
        role = _text(m["from"], path, line, f"conversations[{i}].from")
        out.append({"role": SHAREGPT_ROLES.get(role.lower(), role),
                    "content": _text(m["value"], path, line, f"conversations[{i}].value")})
    return out


def _token_record(record, path, line):
    ids = _need(record, "input_ids", path, line)
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


def _prompt_record(record, path, line, prompt_key, completion_key):
    prompt = _need(record, prompt_key, path, line)
    completion = _need(record, completion_key, path, line)
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise input_error(f"'{prompt_key}' and '{completion_key}' must be strings", path, line,
                          field=prompt_key, reason="missing_key")
    _text(prompt, path, line, prompt_key)
    _text(completion, path, line, completion_key)
    if not completion:
        raise input_error("empty completion", path, line, field=completion_key, reason="empty_conversation")
    return prompt, completion
