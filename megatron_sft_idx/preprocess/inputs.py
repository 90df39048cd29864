"""Input files: expansion of files/globs/directories, streaming readers, record parsing.

Records are read (:mod:`.partitions`) as raw lines (JSONL, ``.jsonl.gz``, ``.jsonl.zst``)
or rows (Parquet); each keeps its 1-based line (row) number so that every
error names ``file:line``. Parsing happens in the tokenizer workers, and refuses
what would otherwise reach the tokenizer as a traceback or a memory blow-up: a
line longer than ``--max-record-bytes`` (never buffered whole), JSON nested
deeper than Python's recursion limit, and text holding a lone UTF-16 surrogate
(``"\ud800"`` escapes, or CESU-8 bytes, which JSON decoding lets through).

Record kinds (``--input-format auto`` tells them apart by their keys) and how each is mapped
to the chat template's vocabulary: :mod:`.schemas`.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
from typing import List, NamedTuple, Optional, Sequence

from .._extras import require_extra
from .errors import InputError, input_error
from .schemas import KINDS, SchemaOptions, detect, map_record

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
INPUT_FORMATS = ("auto",) + KINDS


class OversizedRecord(NamedTuple):
    """Stands for a record longer than the limit; only its size in bytes is kept."""

    size: int


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


def parse_record(raw, path: str, line: int, input_format: str, prompt_key: str, completion_key: str,
                 schema: Optional[SchemaOptions] = None):
    """Decode one raw record into ``(kind, payload)`` (:func:`.schemas.map_record`).

    ``kind`` is ``chat`` (payload: a :class:`~.schemas.Conversation`), ``tokens``
    (payload: ``(input_ids, loss_mask or None, answer_start_idx or None)``) or
    ``prompt`` (payload: ``(prompt, completion)``, under ``--prompt-format raw``).

    Raises:
        InputError: malformed JSON, a record of no known shape, or what :mod:`.schemas` refuses.
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
    if schema is None:
        schema = SchemaOptions(prompt_key, completion_key)
    kind = input_format if input_format != "auto" else detect(record, prompt_key)
    if kind is None:
        raise input_error(f"record has none of the keys 'messages', 'conversations', 'instruction', "
                          f"'input_ids', '{prompt_key}'", path, line, reason="missing_key",
                          hint="set --input-format/--prompt-key to match the data, or --skip-bad")
    return map_record(kind, record, path, line, schema, detected=input_format == "auto")
