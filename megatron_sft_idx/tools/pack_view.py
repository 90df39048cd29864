"""One pack, as a person checks it: its sequences, their boundaries and trained spans,
detokenized when the shard's recorded tokenizer is on this machine.

Label alignment (FORMAT.md): ``loss_mask[j] == 1`` trains predicting token ``j+1``, so the
*trained tokens* of a sequence are the positions ``j+1`` after each 1; spans are reported
as ``[start, end)`` in pack positions. The tokenizer is found by
:func:`find_tokenizer` (where the run that wrote the shard found it -- its record beside the
shard says --, ``$MEGATRON_SFT_IDX_TOKENIZER_PATH``, the Hugging Face cache by name) and used
only if its files hash to the recorded
``tokenizer.files_sha256``; ``tokenizer_path`` overrides it (a mismatch is then a warning).
"""

from __future__ import annotations

import glob
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ShardError
from ..jsondoc import load_json
from ..preprocess.records.chat import tokenizer_files_sha256
from ..preprocess.records.tokenizer_source import local_tokenizer
from ..preprocess.workdir import RECORD
from ..reader import MMapIndexedDataset

_OPEN, _CLOSE = "[[", "]]"


def locate(prefixes: Sequence[str], index: int) -> Tuple[MMapIndexedDataset, int]:
    """The shard holding global pack ``index`` of ``prefixes`` (read in order; negative counts
    from the end) and the pack's index in it. Opens headers only.

    Raises:
        ShardError: ``index`` is out of range.
    """
    shards = [MMapIndexedDataset(p) for p in prefixes]
    total = sum(len(s) for s in shards)
    i = index + total if index < 0 else index
    if not 0 <= i < total:
        raise ShardError(f"pack {index} is out of range: the shard(s) hold {total:,} packs", field="pack",
                         expected=f"{-total} <= N < {total}", actual=index)
    for shard in shards:
        if i < len(shard):
            return shard, i
        i -= len(shard)
    raise AssertionError("unreachable")  # pragma: no cover


def trained_spans(loss_mask: np.ndarray, begin: int, end: int) -> List[List[int]]:
    """``[start, end)`` runs of trained tokens of the sequence ``[begin, end)`` (pack positions)."""
    trained = np.zeros(end - begin, dtype=np.int8)
    trained[1:] = loss_mask[begin:end - 1] != 0
    edges = np.flatnonzero(np.diff(np.concatenate(([0], trained, [0]))))
    return [[begin + int(a), begin + int(b)] for a, b in zip(edges[::2], edges[1::2])]


#: Directories searched for the recorded tokenizer (os.pathsep-separated): tokenizer
#: directories, or directories holding them.
TOKENIZER_PATH_ENV = "MEGATRON_SFT_IDX_TOKENIZER_PATH"


#: The example tokenizer of a checkout (``examples/tokenizer``), which the demo shard records.
EXAMPLE_TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                 "examples", "tokenizer")


#: Sibling directories searched for the record of a run whose shards were promoted (bounded).
MAX_SIBLINGS = 64


def run_recorded(prefix: Optional[str]) -> List[str]:
    """Where the runs that published the shard ``prefix`` found their tokenizer: the
    ``tokenizer_path`` of each finished run's record beside it (``preprocess-sft`` /
    ``repack-sft`` keep ``.<name>.preprocess/receipts/done/000000.json`` next to their outputs,
    its summary listing them), else beside a sibling directory (``check-idx out/staging
    --promote out/sft`` moves the shards and leaves the record in ``out/staging``; at most
    :data:`MAX_SIBLINGS` of them). A record that does not read or does not list a shard of this
    name is passed over; a path is a candidate only, used if its files hash to the shard's record."""
    if not prefix or "://" in prefix:
        return []
    parent, name = os.path.split(os.path.abspath(prefix))
    found = _recorded_in(parent, name)
    if found:
        return found
    grand = os.path.dirname(parent)
    try:
        siblings = sorted(e.path for e in os.scandir(grand) if e.is_dir() and e.path != parent)
    except OSError:
        return []
    return [p for d in siblings[:MAX_SIBLINGS] for p in _recorded_in(d, name)]


def _recorded_in(parent: str, name: str) -> List[str]:
    """The ``tokenizer_path`` of each run record in ``parent`` whose outputs list a shard ``name``."""
    out = []
    for record in sorted(glob.glob(os.path.join(glob.escape(parent), ".*.preprocess", RECORD))):
        try:
            summary = load_json(record).get("summary")
        except (OSError, ShardError, AttributeError):
            continue
        if not isinstance(summary, dict):
            continue
        path, outputs = summary.get("tokenizer_path"), summary.get("outputs")
        if (isinstance(path, str) and path and isinstance(outputs, list)
                and any(isinstance(o, str) and os.path.basename(o) == name for o in outputs)):
            out.append(path)
    return out


def searched(recorded: dict, run_paths: Sequence[str] = ()) -> str:
    """The places :func:`find_tokenizer` looks, in words, for a message."""
    places = [f"the path its run recorded, {p} ({'its files hash otherwise' if os.path.exists(p) else 'not there'})"
              for p in run_paths]
    places += (["its recorded path"] if recorded.get("path") else [])
    places.append(f"${TOKENIZER_PATH_ENV}" + ("" if os.environ.get(TOKENIZER_PATH_ENV) else " (unset)"))
    if recorded.get("name"):
        places.append(f"the Hugging Face cache under the name {recorded['name']}")
    if os.path.isdir(EXAMPLE_TOKENIZER):
        places.append("this checkout's examples/tokenizer")
    return ", ".join(places)


def _candidates(recorded: dict, run_paths: Sequence[str] = ()) -> List[str]:
    """Where the tokenizer a shard records may be on this machine, most specific first: where
    the run that wrote it found it (``run_paths``, :func:`run_recorded`: a path is not part of a
    tokenizer's identity, so the shard holds none), a path in the metadata (other producers'),
    ``$MEGATRON_SFT_IDX_TOKENIZER_PATH``, the Hugging Face cache by name, then the example
    tokenizer of a checkout (the demo's). Each is used only if its files hash to the record."""
    out = list(run_paths) + ([recorded["path"]] if recorded.get("path") else [])
    for root in filter(None, os.environ.get(TOKENIZER_PATH_ENV, "").split(os.pathsep)):
        out.append(root)
        if os.path.isdir(root):
            out += sorted(os.path.join(root, n) for n in os.listdir(root))
    name = recorded.get("name")
    if isinstance(name, str) and name:
        hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
            os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
        snapshots = os.path.join(hub, "models--" + name.replace("/", "--"), "snapshots")
        if os.path.isdir(snapshots):
            out += sorted(os.path.join(snapshots, n) for n in os.listdir(snapshots))
    out.append(EXAMPLE_TOKENIZER)
    return [p for p in out if os.path.isfile(os.path.join(p, "tokenizer.json") if os.path.isdir(p) else p)]


def find_tokenizer(recorded: Optional[dict], run_paths: Sequence[str] = ()) -> Optional[str]:
    """The first candidate (:func:`_candidates`) whose files hash to the recorded
    ``files_sha256`` (None if none does)."""
    expected = (recorded or {}).get("files_sha256")
    if not expected:
        return None
    for path in _candidates(recorded, run_paths):
        if tokenizer_files_sha256(path)[0] == expected:
            return path
    return None


def load_tokenizer(recorded: Optional[dict], override: Optional[str] = None, prefix: Optional[str] = None):
    """``(tokenizer or None, note)``: a ``tokenizers.Tokenizer`` for detokenizing, and why not if None.

    ``override`` (``--tokenizer``: a local path, a URL or a Hugging Face name) is used even if it
    is not the recorded one (with a warning);
    otherwise only a local copy whose files hash to the recorded ``files_sha256`` is used, looked
    for first where the run that wrote the shard ``prefix`` found it (:func:`run_recorded`).
    """
    note = None
    if override:
        path = local_tokenizer(override)   # (a URL's or a hub name's files: this machine's copy)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            return None, f"no tokenizer.json at {override}"
        expected = (recorded or {}).get("files_sha256")
        if expected:
            if tokenizer_files_sha256(path)[0] != expected:
                note = f"warning: {override} is not the tokenizer the shard records (its files hash differs)"
    else:
        if not recorded:
            return None, "no tokenizer recorded in the metadata (pass --tokenizer PATH to detokenize)"
        run_paths = run_recorded(prefix)
        path = find_tokenizer(recorded, run_paths)
        if path is None:
            return None, (f"tokenizer {recorded.get('name', '?')} not found on this machine (searched "
                          f"{searched(recorded, run_paths)}; put its directory in ${TOKENIZER_PATH_ENV} or pass "
                          "--tokenizer PATH)")
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(file), note
    except ImportError:
        return None, "the 'tokenizers' package is not installed: pip install 'megatron_sft_idx[preprocess]'"
    except Exception as exc:  # the tokenizers library raises its own exception type for a bad file
        words = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"cannot load the tokenizer {file} ({words}): showing token ids"


def describe_pack(prefixes: Sequence[str], index: int, tokenizer_path: Optional[str] = None,
                  detokenize: bool = True) -> Dict[str, Any]:
    """Pack ``index`` as a dict: boundaries, per-sequence lengths, trained spans, ids and text."""
    shard, local = locate(prefixes, index)
    pack = shard[local]
    bounds = pack.seq_boundaries.tolist()
    tokenizer, note = (load_tokenizer(shard.metadata.tokenizer, tokenizer_path, shard.prefix) if detokenize
                       else (None, None))
    sequences = []
    for k in range(len(bounds) - 1):
        begin, end = bounds[k], bounds[k + 1]
        spans = trained_spans(pack.loss_mask, begin, end)
        seq = {"index": k, "start": begin, "end": end, "length": end - begin,
               "trained_tokens": int(sum(b - a for a, b in spans)), "trained_spans": spans,
               "input_ids": pack.input_ids[begin:end].tolist()}
        if tokenizer is not None:
            seq["text"] = marked_text(tokenizer, pack.input_ids, spans, begin, end)
        sequences.append(seq)
    size = shard.metadata.pack_size
    return {"pack": index, "shard": shard.prefix, "local_pack": local, "packed_len": pack.packed_len,
            "pack_size": size, "loss_positions": int(pack.loss_mask.sum()), "seq_boundaries": bounds,
            "sequences": sequences, "tokenizer_note": note}


def marked_text(tokenizer, ids: np.ndarray, spans: List[List[int]], begin: int, end: int) -> str:
    """The sequence's text with each trained span wrapped in ``[[...]]``."""
    pieces, cursor = [], begin
    for a, b in spans:
        if a > cursor:
            pieces.append(tokenizer.decode(ids[cursor:a].tolist(), skip_special_tokens=False))
        pieces.append(_OPEN + tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False) + _CLOSE)
        cursor = b
    if cursor < end:
        pieces.append(tokenizer.decode(ids[cursor:end].tolist(), skip_special_tokens=False))
    return "".join(pieces)


def _marked_ids(seq: dict, limit: int) -> str:
    ids, start = seq["input_ids"], seq["start"]
    trained = np.zeros(len(ids), dtype=bool)
    for a, b in seq["trained_spans"]:
        trained[a - start:b - start] = True
    out, inside = [], False
    for i, token in enumerate(ids[:limit]):
        if trained[i] != inside:
            out.append(_OPEN if trained[i] else _CLOSE)
            inside = bool(trained[i])
        out.append(str(token))
    if inside:
        out.append(_CLOSE)
    text = " ".join(out).replace(_OPEN + " ", _OPEN).replace(" " + _CLOSE, _CLOSE)
    return text + (f" ... (+{len(ids) - limit} tokens)" if len(ids) > limit else "")


def format_pack(view: Dict[str, Any], only: Optional[int] = None, max_chars: int = 1200) -> str:
    """The pack as text: a table of sequences, then each sequence (or sequence ``only``)."""
    fill = f", {view['packed_len'] / view['pack_size']:.1%} of pack size {view['pack_size']:,}" \
        if view["pack_size"] else ""
    lines = [f"pack {view['pack']:,} ({view['shard']}, local pack {view['local_pack']:,})",
             f"  {view['packed_len']:,} tokens{fill}, {len(view['sequences'])} sequences, "
             f"{view['loss_positions']:,} trained tokens",
             f"  {'seq':>4} {'tokens':>15} {'length':>7} {'trained':>8}  trained spans"]
    for seq in view["sequences"]:
        spans = " ".join(f"[{a},{b})" for a, b in seq["trained_spans"][:4])
        more = f" +{len(seq['trained_spans']) - 4}" if len(seq["trained_spans"]) > 4 else ""
        lines.append(f"  {seq['index']:>4} {seq['start']:>7,}..{seq['end']:<7,} {seq['length']:>7,} "
                     f"{seq['trained_tokens']:>8,}  {spans}{more}")
    if view.get("tokenizer_note"):
        lines.append(f"  ({view['tokenizer_note']})")
    for seq in view["sequences"]:
        if only is not None and seq["index"] != only:
            continue
        lines.append("")
        lines.append(f"sequence {seq['index']} [{seq['start']}, {seq['end']}), trained tokens in [[...]]:")
        body = seq.get("text")
        if body is None:
            body = _marked_ids(seq, max_chars // 6)
        elif len(body) > max_chars:
            body = body[:max_chars] + f" ... (+{len(body) - max_chars} characters; --max-chars)"
        lines += ["    " + line for line in body.splitlines() or [""]]
    return "\n".join(lines)
