"""Input files: expansion of files/globs/directories, streaming readers, record parsing.

Records are read in batches of raw lines (JSONL, ``.jsonl.gz``, ``.jsonl.zst``)
or rows (Parquet); each keeps its 1-based line (row) number so that every
error names ``file:line``. Parsing happens in the tokenizer workers.

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
from typing import Iterator, List, Sequence, Tuple

from .._extras import require_extra
from .errors import InputError, input_error

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
INPUT_FORMATS = ("auto", "chat", "sharegpt", "tokens", "prompt")
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


def _open_text_bytes(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        require_extra("preprocess", "zstandard")
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def iter_batches(path: str, batch_size: int) -> Iterator[Tuple[int, list]]:
    """Yield ``(first_line_number, records)`` with up to ``batch_size`` raw records each.

    JSONL records are ``bytes`` lines (blank lines are skipped but counted);
    Parquet records are dicts. Line and row numbers are 1-based.

    Raises:
        InputError: the file cannot be opened or decompressed.
    """
    try:
        if path.endswith(PARQUET_SUFFIXES):
            yield from _parquet_batches(path, batch_size)
            return
        with _open_text_bytes(path) as f:
            batch: list = []
            first = 1
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if not batch:
                    first = number
                batch.append((number, line))
                if len(batch) >= batch_size:
                    yield first, batch
                    batch = []
            if batch:
                yield first, batch
    except (OSError, EOFError, ValueError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"cannot read input ({exc.__class__.__name__}: {exc})", path=path,
                         hint="check the file is complete and its compression matches its suffix") from None


def _parquet_batches(path: str, batch_size: int):
    require_extra("preprocess", "pyarrow")
    import pyarrow.parquet as pq

    row = 1
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        rows = batch.to_pylist()
        yield row, [(row + i, r) for i, r in enumerate(rows)]
        row += len(rows)


def parse_record(raw, path: str, line: int, input_format: str, prompt_key: str, completion_key: str):
    """Decode one raw record into ``(kind, payload)``.

    ``kind`` is ``chat`` (payload: list of ``{"role", "content"}``), ``tokens``
    (payload: ``(input_ids, loss_mask or None, answer_start_idx or None)``) or
    ``prompt`` (payload: ``(prompt, completion)``).

    Raises:
        InputError: malformed JSON, missing or ill-typed keys, an empty conversation.
    """
    if isinstance(raw, (bytes, str)):
        try:
            record = json.loads(raw)
        except ValueError as exc:
            raise input_error(f"malformed JSON ({exc})", path, line, reason="malformed_json") from None
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


def _chat_messages(record, path, line):
    out = []
    for i, m in enumerate(_turns(_need(record, "messages", path, line), path, line, "messages")):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise input_error(f"messages[{i}] needs string 'role' and 'content'", path, line,
                              field=f"messages[{i}]", reason="missing_key")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _sharegpt_messages(record, path, line):
    out = []
    for i, m in enumerate(_turns(_need(record, "conversations", path, line), path, line, "conversations")):
        if not isinstance(m, dict) or not isinstance(m.get("from"), str) or not isinstance(m.get("value"), str):
            raise input_error(f"conversations[{i}] needs string 'from' and 'value'", path, line,
                              field=f"conversations[{i}]", reason="missing_key")
        out.append({"role": SHAREGPT_ROLES.get(m["from"].lower(), m["from"]), "content": m["value"]})
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
    if not completion:
        raise input_error("empty completion", path, line, field=completion_key, reason="empty_conversation")
    return prompt, completion
