"""Input files: expansion of files/globs/directories, streaming readers, record parsing.

Records are read (:mod:`.partitions`) as raw lines (JSONL, ``.jsonl.gz``, ``.jsonl.zst``)
or rows (Parquet); each keeps its 1-based line (row) number so that every
error names ``file:line``. Parsing happens in the tokenizer workers, and refuses
what would otherwise reach the tokenizer as a traceback or a memory blow-up: a
line longer than ``--max-record-bytes`` (never buffered whole), JSON nested
deeper than :data:`~megatron_sft_idx.jsondoc.RECORD_MAX_DEPTH` (the record, or a JSON string
inside it: the project's one bounded reader, :func:`~megatron_sft_idx.jsondoc.parse_record_json`),
and text holding a lone UTF-16 surrogate
(``"\ud800"`` escapes, or CESU-8 bytes, which JSON decoding lets through).

Record kinds (``--input-format auto`` tells them apart by their keys) and how each is mapped
to the chat template's vocabulary: :mod:`.shapes`.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
import sys
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ..._extras import require_extra
from ...errors import MetadataError, MetadataLimitError
from ...jsondoc import load_json, parse_record_json
from .errors import InputError, input_error
from .shapes import KINDS, SchemaOptions, detect, map_record

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
JSON_SUFFIXES = (".json", ".json.gz", ".json.zst")   # a JSON array, or JSON Lines (by the first character)
COMPRESSED_SUFFIXES = (".gz", ".zst")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
INPUT_FORMATS = ("auto",) + KINDS


class OversizedRecord(NamedTuple):
    """Stands for a record longer than the limit; only its size in bytes is kept."""

    size: int


def _is_input_file(path: str) -> bool:
    return path.endswith(JSONL_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES + ARROW_SUFFIXES)


def left_reason(path: str) -> str:
    """Why a directory's ``path`` (one :func:`expand_inputs` left) was not read."""
    name = os.path.basename(path)
    if os.path.isdir(path):
        return "hidden directory, not searched"
    if name.startswith("."):
        return "hidden file"
    ext = os.path.splitext(name)[1]
    return f"not a kind the run reads ({ext or 'no extension'})"


def expand_inputs(specs: Sequence[str], left: Optional[List[str]] = None) -> List[str]:
    """Files named by ``specs`` (files, globs, directories searched recursively), sorted within
    each glob or directory, first occurrence kept. A directory contributes every file of a kind the
    run reads -- ``.jsonl``, ``.json`` (a JSON array or JSON Lines), either ``.gz`` / ``.zst``,
    ``.parquet``, ``.arrow`` -- and every dataset saved by Hugging Face ``datasets.save_to_disk``
    under it (``state.json`` beside its Arrow files: its data files in its own order); a file named
    directly may have any name. ``left`` (when given) receives the files a directory holds that
    are not read, and the hidden directories it does not search, so the caller can say so
    (:func:`left_reason` says why).

    Raises:
        InputError: a spec matches no input file; a saved ``DatasetDict`` (which split?); a
            saved dataset whose ``state.json`` does not list its files.
    """
    out: List[str] = []
    seen = set()
    for spec in specs:
        if os.path.isdir(spec):
            found = _directory_files(spec, left)
        elif os.path.isfile(spec):
            found = [spec]
        else:
            found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not found:
            raise InputError("no input files match", path=spec,
                             hint="give files (.jsonl, .json, .parquet, .arrow, [.gz|.zst]), globs, or directories "
                                  "holding them or a saved Hugging Face dataset")
        for path in found:
            key = os.path.abspath(path)
            if key not in seen:
                seen.add(key)
                out.append(path)
    return out


def _directory_files(directory: str, left: Optional[List[str]]) -> List[str]:
    """The input files under ``directory``, sorted by path; a saved dataset's in its own order.

    Raises:
        InputError: a saved ``DatasetDict`` (naming its splits), or a saved dataset's bad ``state.json``.
    """
    found: List[Tuple[str, List[str]]] = []
    for root, dirs, files in os.walk(directory):
        if "dataset_dict.json" in files:
            raise InputError("a saved Hugging Face DatasetDict holds several splits", path=root,
                             hint=f"give the directory of the split to train on, e.g. {os.path.join(root, 'train')}")
        if "state.json" in files:
            found.append((root, hf_dataset_files(root)))
            dirs[:] = []
            continue
        if left is not None:   # (a hidden directory is not searched: said, with the files it holds)
            left.extend(os.path.join(root, d) for d in sorted(dirs) if d.startswith("."))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = os.path.join(root, name)
            if _is_input_file(path) and not name.startswith("."):
                found.append((path, [path]))
            elif left is not None:
                left.append(path)
    return [p for _, paths in sorted(found) for p in paths]


def hf_dataset_files(directory: str) -> List[str]:
    """The Arrow data files of a dataset saved by ``datasets.save_to_disk``, in ``state.json``'s order.

    Raises:
        InputError: ``state.json`` is unreadable, or does not list existing ``.arrow`` files.
    """
    path = os.path.join(directory, "state.json")
    hint = "give a directory written by datasets' save_to_disk"
    try:
        state = load_json(path, InputError, hint=hint)   # within the metadata limits
    except OSError as exc:
        raise InputError(f"cannot read a saved dataset's state ({exc.__class__.__name__}: {exc})", path=path,
                         hint=hint) from None
    files = state.get("_data_files") if isinstance(state, dict) else None
    names = [f.get("filename") for f in files] if isinstance(files, list) and all(isinstance(f, dict) for f in files) \
        else None
    if not names or not all(isinstance(n, str) and n.endswith(ARROW_SUFFIXES) and os.sep not in n for n in names):
        raise InputError("state.json does not list the dataset's Arrow files ('_data_files')", path=path,
                         field="_data_files", hint=hint)
    found = [os.path.join(directory, n) for n in names]
    missing = [p for p in found if not os.path.isfile(p)]
    if missing:
        raise InputError("a data file state.json lists is missing", path=missing[0], field="_data_files",
                         hint="the saved dataset is incomplete; save it again")
    return found


#: Bytes read at a time from an input stream.
BLOCK = 1 << 20


def read_blocks(stream, limit: int) -> Iterator[bytes]:
    """Blocks of ``stream`` (:data:`BLOCK` bytes at most each), at most ``limit`` bytes in all
    (all of it when ``limit < 0``)."""
    while limit != 0:
        block = stream.read(BLOCK if limit < 0 else min(BLOCK, limit))
        if not block:
            return
        if limit > 0:
            limit -= len(block)
        yield block


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
                 schema: Optional[SchemaOptions] = None, ignored: Optional[Dict[str, int]] = None):
    """Decode one raw record into ``(kind, payload)`` (:func:`.schemas.map_record`).

    ``kind`` is ``chat`` (payload: a :class:`~.schemas.Conversation`), ``tokens``
    (payload: ``(input_ids, loss_mask or None, answer_start_idx or None)``) or
    ``prompt`` (payload: ``(prompt, completion)``, under ``--prompt-format raw``). ``ignored``
    counts the record-level keys ignored by a rule, as ``rule:key`` (:func:`.shapes.account_keys`).

    Raises:
        InputError: malformed JSON, a record of no known shape, or what :mod:`.schemas` refuses.
    """
    if isinstance(raw, OversizedRecord):
        raise input_error(f"record of {raw.size} bytes exceeds --max-record-bytes", path, line,
                          reason="record_too_large",
                          hint="raise --max-record-bytes (a worker's memory grows with it), or --skip-bad")
    if isinstance(raw, (bytes, str)):
        # The reader bounds the line's size (--max-record-bytes); the parser its depth.
        try:
            record = parse_record_json(raw, max_length=sys.maxsize)
        except MetadataLimitError as exc:
            if exc.limit != "depth":
                raise input_error(f"malformed JSON ({exc.detail})", path, line,
                                  reason="malformed_json") from None
            raise input_error(f"JSON nested too deeply to parse ({exc.detail})", path, line,
                              reason="json_too_deep",
                              hint="no conversation needs this nesting; fix the record or pass --skip-bad") from None
        except MetadataError as exc:
            raise input_error(f"malformed JSON ({exc.detail})", path, line, reason="malformed_json") from None
    else:
        record = raw
    if not isinstance(record, dict):
        raise input_error("record is not a JSON object", path, line, reason="malformed_json")
    if schema is None:
        schema = SchemaOptions(prompt_key, completion_key)
    kind = input_format if input_format != "auto" else detect(record, prompt_key)
    if kind is None:
        raise input_error(f"record has none of the keys 'messages', 'conversations', 'instruction', "
                          f"'input_ids', '{prompt_key}', 'query'+'answers', 'input'+'output'", path, line,
                          reason="missing_key", hint="set --input-format/--prompt-key to match the data, or --skip-bad")
    nulls = not isinstance(raw, (bytes, str)) or ("null" in raw if isinstance(raw, str) else b"null" in raw)
    return map_record(kind, record, path, line, schema, detected=input_format == "auto", ignored=ignored,
                      nulls=nulls)
