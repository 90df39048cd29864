"""The source check's own reading of a record's bytes for one thing: a key named twice in an object.

JSON leaves duplicate keys to the reader (RFC 8259: names "SHOULD be unique"), so a record whose
object names a key twice has no one meaning. The mapping's decoder refuses it
(:func:`megatron_sft_idx.jsondoc.parse_record_json`); the source check (:mod:`.source_check`)
must not share that decoder with the mapping it checks, so it reads the bytes again here, by a
scan of their strings and brackets (:func:`duplicate_key`). Imported by the source check alone.
"""

from __future__ import annotations

import json
import re
from typing import List, Optional

__all__ = ["duplicate_key"]

#: a JSON string token, or a structural character (whitespace, numbers and literals are skipped)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]')
_ESCAPE = re.compile(r'\\(u[0-9a-fA-F]{4}|.)')
_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _key_text(token: str) -> str:
    """A string token's text, its escapes resolved (``"\\u0072ole"`` is ``role``)."""
    body = token[1:-1]
    if "\\" not in body:
        return body
    text = _ESCAPE.sub(lambda m: chr(int(m.group(1)[1:], 16)) if len(m.group(1)) == 5
                       else _SIMPLE.get(m.group(1), m.group(1)), body)
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")   # (pairs joined)


def duplicate_key(raw) -> Optional[str]:
    """The first key an object of the JSON text ``raw`` (bytes or text) names twice, or None: this
    module's own reading of the bytes (a scan of its strings and brackets), independent of the
    decoder the mapping reads with."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = bytes(raw)
        raw = raw.decode(json.detect_encoding(raw), "surrogatepass")
    frames: List[Optional[set]] = []   # per open container: the keys of an object, None for an array
    pending = None
    for m in _TOKEN.finditer(raw):
        token = m.group()
        if token[0] == '"':
            pending = token
            continue
        if token == ":" and pending is not None and frames and frames[-1] is not None:
            key = _key_text(pending)
            if key in frames[-1]:
                return key
            frames[-1].add(key)
        elif token == "{":
            frames.append(set())
        elif token == "[":
            frames.append(None)
        elif token in "]}" and frames:
            frames.pop()
        pending = None
    return None
