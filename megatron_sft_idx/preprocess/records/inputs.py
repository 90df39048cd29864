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

Inputs may be local paths or object-storage URLs (``s3://``, ``msc://``): a URL names an object,
a "directory" (a key prefix, listed) or a glob, expanded by the same rules as a local path
(:func:`expand_inputs`). Each input is then read through its source (:mod:`.sources`: a local
file, or an object read by ranged GETs of the storage layer, pinned to one version;
docs/INPUTS.md, "Inputs in object storage").

Record kinds (``--input-format auto`` tells them apart by their keys) and how each is mapped
to the chat template's vocabulary: :mod:`.shapes`.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import io
import os
import sys
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ..._extras import require_extra
from ...errors import MetadataError, MetadataLimitError
from ...jsondoc import MAX_METADATA_LENGTH, load_json, parse_json, parse_record_json
from ...storage import ObjectURL, is_remote
from ...storage.urls import check_url
from .errors import InputError, duplicate_key, input_error
from .shapes import KINDS, SchemaOptions, detect, map_record
from .sources import InputSource, ObjectInput

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
    name = os.path.basename(path.rstrip("/"))
    if path.endswith("/"):
        return "hidden directory, not searched"
    if name.startswith("."):
        return "hidden file"
    ext = os.path.splitext(name)[1]
    return f"not a kind the run reads ({ext or 'no extension'})"


def expand_inputs(specs: Sequence[str], left: Optional[List[str]] = None,
                  sizes: Optional[Dict[str, int]] = None) -> List[str]:
    """Files named by ``specs`` (files, globs, directories searched recursively), sorted within
    each glob or directory, first occurrence kept. A directory contributes every file of a kind the
    run reads -- ``.jsonl``, ``.json`` (a JSON array or JSON Lines), either ``.gz`` / ``.zst``,
    ``.parquet``, ``.arrow`` -- and every dataset saved by Hugging Face ``datasets.save_to_disk``
    under it (``state.json`` beside its Arrow files: its data files in its own order); a file named
    directly may have any name. ``left`` (when given) receives the files a directory holds that
    are not read, and the hidden directories it does not search, so the caller can say so
    (:func:`left_reason` says why).

    A spec may be an ``s3://`` / ``msc://`` URL, expanded by listing with the same rules: an
    object's URL names that object; a URL ending in ``/``, or naming no object, is a directory
    (the keys under it, ``/`` separating levels; a level starting with ``.`` is hidden as a
    dot-directory is); a URL with ``*``, ``?`` or ``[`` is a glob (``*`` within a level, ``**``
    across levels). The inputs' names are the URLs. ``sizes`` (when given) receives the byte
    size of every object listed, so nothing is asked twice.

    Raises:
        InputError: a spec matches no input file; a saved ``DatasetDict`` (which split?); a
            saved dataset whose ``state.json`` does not list its files.
        RemoteStorageError, RemoteTimeoutError: a listing failed.
    """
    out: List[str] = []
    seen = set()
    for spec in specs:
        remote = is_remote(spec)   # (a spec is expanded by listing its store, or on this machine's disk)
        if remote:
            found = _remote_files(spec, left, sizes if sizes is not None else {})
        elif os.path.isdir(spec):
            found = _directory_files(spec, left)
        elif os.path.isfile(spec):
            found = [spec]
        else:
            found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not found:
            raise InputError("no input files match", path=spec,
                             hint="give files (.jsonl, .json, .parquet, .arrow, [.gz|.zst]), globs, or directories "
                                  "holding them or a saved Hugging Face dataset"
                                  + (" (in object storage: object URLs, key prefixes ending in / or globs)"
                                     if remote else ""))
        for path in found:
            key = path if remote else os.path.abspath(path)
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
        if _saved_dataset(root, files, os.path.join):
            found.append((root, hf_dataset_files(root)))
            dirs[:] = []
            continue
        _directory_level(root, files, os.path.join, found, left)
        if left is not None:   # (a hidden directory is not searched: said, as DIR/)
            left.extend(os.path.join(root, d) + "/" for d in sorted(dirs) if d.startswith("."))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    return [p for _, paths in sorted(found) for p in paths]


def _saved_dataset(root: str, files, join) -> bool:
    """Whether the directory ``root`` holding ``files`` is a saved dataset (``state.json``).

    Raises:
        InputError: it is a saved ``DatasetDict`` (naming the split directory to give instead).
    """
    if "dataset_dict.json" in files:
        raise InputError("a saved Hugging Face DatasetDict holds several splits", path=root,
                         hint=f"give the directory of the split to train on, e.g. {join(root, 'train')}")
    return "state.json" in files


def _directory_level(root: str, files, join, found: list, left: Optional[List[str]]) -> None:
    """One directory's files: the input files into ``found`` (as ``(path, [path])``), the others into ``left``."""
    for name in sorted(files):
        path = join(root, name)
        if _is_input_file(path) and not name.startswith("."):
            found.append((path, [path]))
        elif left is not None:
            left.append(path)


_SAVED_HINT = "give a directory written by datasets' save_to_disk"


def hf_dataset_files(directory: str) -> List[str]:
    """The Arrow data files of a dataset saved by ``datasets.save_to_disk`` in local ``directory``,
    in ``state.json``'s order.

    Raises:
        InputError: ``state.json`` is unreadable, or does not list existing ``.arrow`` files.
    """
    path = os.path.join(directory, "state.json")
    try:
        state = load_json(path, InputError, hint=_SAVED_HINT)   # within the metadata limits
    except OSError as exc:
        raise _unreadable_state(path, exc) from None
    return _present_files([os.path.join(directory, n) for n in _state_files(state, path, os.sep)], os.path.isfile)


def _state_files(state, path: str, separator: str) -> List[str]:
    """The data file names a saved dataset's ``state.json`` (``state``, read from ``path``) lists.

    Raises:
        InputError: it lists none, or a name that is not an ``.arrow`` file of its directory.
    """
    files = state.get("_data_files") if isinstance(state, dict) else None
    names = [f.get("filename") for f in files] if isinstance(files, list) and all(isinstance(f, dict) for f in files) \
        else None
    if not names or not all(isinstance(n, str) and n.endswith(ARROW_SUFFIXES) and separator not in n for n in names):
        raise InputError("state.json does not list the dataset's Arrow files ('_data_files')", path=path,
                         field="_data_files", hint=_SAVED_HINT)
    return names


def _present_files(found: List[str], exists) -> List[str]:
    """``found``, when ``exists`` says each of them is there.

    Raises:
        InputError: a data file ``state.json`` lists is missing (naming the first).
    """
    missing = [p for p in found if not exists(p)]
    if missing:
        raise InputError("a data file state.json lists is missing", path=missing[0], field="_data_files",
                         hint="the saved dataset is incomplete; save it again")
    return found


def _unreadable_state(path: str, exc: OSError) -> InputError:
    return InputError(f"cannot read a saved dataset's state ({exc.__class__.__name__}: {exc})", path=path,
                      hint=_SAVED_HINT)


# --------------------------------------------------------------------------- inputs in object storage


def _url_join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


def _remote_files(spec: str, left: Optional[List[str]], sizes: Dict[str, int]) -> List[str]:
    """The input objects ``spec`` names (see :func:`expand_inputs`); their sizes into ``sizes``."""
    # (start-up: the object-store layer loads for a URL only)
    from ...storage.objects import list_objects, stat_object

    url = ObjectURL.parse(check_url(spec, "--input"))
    if url.has_magic():
        literal = url.key[: min(url.key.find(c) for c in "*?[" if c in url.key)]
        listed = list_objects(str(ObjectURL(url.scheme, url.bucket, literal)))
        pattern = url.key.split("/")
        found = []
        for name, info in listed:
            key = ObjectURL.parse(name).key
            if not key.endswith("/") and _glob_match(key.split("/"), pattern):
                sizes[name] = info.size
                found.append(name)
        return sorted(found)
    if url.key and not url.key.endswith("/"):
        info = stat_object(spec)
        if info is not None:
            sizes[spec] = info.size
            return [spec]
    directory = spec if spec.endswith("/") else spec + "/"
    listed = list_objects(str(ObjectURL(url.scheme, url.bucket, url.key.rstrip("/") + "/" if url.key else "")))
    return _remote_directory(directory, listed, left, sizes)


def _glob_match(parts: List[str], pattern: List[str]) -> bool:
    """Whether the key levels ``parts`` match the pattern's levels as ``glob(recursive=True)``
    matches paths: ``*`` / ``?`` / ``[...]`` within one level, ``**`` any number of levels, a
    level starting with ``.`` only by a pattern level that does."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        for i in range(len(parts) + 1):
            if _glob_match(parts[i:], pattern[1:]):
                return True
            if i < len(parts) and parts[i].startswith("."):
                return False
        return False
    if not parts or (parts[0].startswith(".") and not pattern[0].startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(parts[1:], pattern[1:])


def _remote_directory(directory: str, listed, left: Optional[List[str]], sizes: Dict[str, int]) -> List[str]:
    """:func:`_directory_files` over a listing: the objects under ``directory`` (a URL ending in
    ``/``) walked level by level as ``os.walk`` walks a directory."""
    base = ObjectURL.parse(directory).key
    tree: Dict[str, Tuple[set, list]] = {"": (set(), [])}
    present: Dict[str, int] = {}
    for name, info in listed:
        rel = ObjectURL.parse(name).key[len(base):]
        if not rel or rel.endswith("/"):
            continue   # (a "folder" marker some tools write)
        levels = rel.split("/")
        for i in range(len(levels) - 1):
            parent = "/".join(levels[:i])
            tree.setdefault(parent, (set(), []))[0].add(levels[i])
            tree.setdefault("/".join(levels[: i + 1]), (set(), []))
        tree["/".join(levels[:-1])][1].append(levels[-1])
        present[name] = info.size
    found: List[Tuple[str, List[str]]] = []
    top = directory.rstrip("/")

    def walk(rel: str) -> None:
        subdirs, files = tree[rel]
        root = _url_join(top, rel) if rel else top
        if _saved_dataset(root, files, _url_join):
            found.append((root, _object_dataset_files(root, present)))
            return
        _directory_level(root, files, _url_join, found, left)
        if left is not None:   # (a hidden level is not searched: said, as a local one is)
            left.extend(_url_join(root, d) + "/" for d in sorted(subdirs) if d.startswith("."))
        for sub in sorted(d for d in subdirs if not d.startswith(".")):
            walk(f"{rel}/{sub}" if rel else sub)

    walk("")
    out = [p for _, paths in sorted(found) for p in paths]
    sizes.update((p, present[p]) for p in out)
    return out


def _object_dataset_files(directory: str, present: Dict[str, int]) -> List[str]:
    """:func:`hf_dataset_files` of a saved dataset in object storage; ``present``: the sizes of the
    objects listed under ``directory`` (a URL).

    Raises:
        InputError: as :func:`hf_dataset_files` does.
    """
    path = _url_join(directory, "state.json")
    try:
        state = parse_json(_read_small(ObjectInput(path), MAX_METADATA_LENGTH), path, what="state.json",
                           error=InputError, hint=_SAVED_HINT)
    except OSError as exc:
        raise _unreadable_state(path, exc) from None
    return _present_files([_url_join(directory, n) for n in _state_files(state, path, "/")], present.__contains__)


def _read_small(source: ObjectInput, limit: int) -> bytes:
    """The whole object of ``source`` (at most ``limit`` bytes).

    Raises:
        FileNotFoundError: there is none; InputError: it is larger than ``limit``.
    """
    with source.open() as f:
        if f.raw.size > limit:
            raise InputError(f"{f.raw.size} bytes, more than the {limit} this file may hold", path=source.name)
        return f.read()


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


def open_text_bytes(source: InputSource, version: str = "", stop: Optional[int] = None):
    """A binary stream of the input's (decompressed) bytes (``version``, ``stop``: see
    :meth:`.sources.InputSource.open`; a compressed file's ``stop`` is in its compressed bytes)."""
    if source.name.endswith(".gz"):
        return _OwningGzipFile(source.open(version, stop=stop))
    if source.name.endswith(".zst"):
        require_extra("preprocess", "zstandard")
        import zstandard   # (an optional dependency: .zst inputs only)

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(source.open(version, stop=stop),
                                                                              closefd=True))
    return source.open(version, stop=stop)


class _OwningGzipFile(gzip.GzipFile):
    """A gzip stream that closes the file it reads (``gzip.GzipFile(fileobj=...)`` leaves it open)."""

    def __init__(self, source) -> None:
        self._source = source
        super().__init__(fileobj=source, mode="rb")

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._source.close()


def parse_record(raw, path: str, line: int, input_format: str, prompt_key: str, completion_key: str,
                 schema: Optional[SchemaOptions] = None, ignored: Optional[Dict[str, int]] = None):
    """Decode one raw record into ``(kind, payload)`` (:func:`.schemas.map_record`).

    ``kind`` is ``chat`` (payload: a :class:`~.schemas.Conversation`), ``tokens``
    (payload: ``(input_ids, loss_mask or None, answer_start_idx or None)``) or
    ``prompt`` (payload: ``(prompt, completion)``, under ``--prompt-format raw``). ``ignored``
    counts the record-level keys ignored by a rule, as ``rule:key`` (:func:`.shapes.account_keys`).

    Raises:
        InputError: malformed JSON, a key twice in one object (``duplicate_key``), a record of no
            known shape, or what :mod:`.schemas` refuses.
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
            key = getattr(exc, "duplicate", None)
            if key is not None:
                raise duplicate_key(key, path, line, None) from None
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
                      nulls=nulls, raw=raw)
