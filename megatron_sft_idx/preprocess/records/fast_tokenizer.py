"""Batched tokenization through gigatoken, with token positions that reproduce HF offsets.

``gigatoken`` (optional extra ``[fast]``) loads the same ``tokenizer.json`` as Hugging Face
``tokenizers`` and encodes a whole batch in one call, but returns no offsets. For a
byte-level BPE (no normalizer, or NFC on text that is already NFC) the tokens' bytes
concatenate to the text's UTF-8 bytes, so each token's byte start is a running sum of
token byte lengths; a span boundary that is also a token boundary then splits the
tokens exactly as the reference's "token start offset inside the span" rule does, and so
does one inside a token whose offset start is its byte start (offsets not trimmed, its
first byte ASCII). :func:`trained_flags` proves this per text (bytes compared in full,
boundaries on token starts or inside such tokens, and -- for post-processors that trim
offsets -- on token starts only, with no whitespace-only token ending on a boundary, whose
trimmed start would cross it); a text it cannot prove is re-encoded by ``tokenizers`` with
offsets, as the reference does.

The ids themselves are checked against ``tokenizers`` at load (fixed probe texts)
and on a deterministic sample of every batch (:mod:`.encode`); a difference stops
the run and names ``--tokenizer-backend hf``.
"""

from __future__ import annotations

import os
import unicodedata
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..._numba import numba
from ...errors import ShardError
from ...jsondoc import TOKENIZER_MAX_BYTES, parse_json

BACKENDS = ("auto", "gigatoken", "hf")
_SPLITTERS = {"Split", "ByteLevel", "Digits", "Punctuation"}
_PROCESSORS = {"ByteLevel", "TemplateProcessing", "RobertaProcessing", "BertProcessing"}
# char::is_whitespace in Rust (Unicode White_Space), which tokenizers' offset trimming uses
_RUST_WHITESPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                             + "".join(chr(c) for c in range(0x2000, 0x200B)))
_PROBES = ("Hello, world!", "  two  spaces\n\nand\ttabs\r\n", "ünïcødé 日本語 😀👍🏽 e\u0301 ﬁ İ",
           "<|im_start|>user\nhi<|im_end|>\n", "x = [i ** 2 for i in range(10)]  # code\n",
           "1234567890 3.14159 $100 ~/path/to_file.py", "\u00a0\u200b\x1c\x00 ",
           "DON'T you'll we've I'm they'd", "a" * 300, " leading and trailing ")


def _component(obj) -> Optional[dict]:
    return None if obj is None else parse_json(obj.__getstate__(), max_length=TOKENIZER_MAX_BYTES, int64=False,
                                               what="tokenizer component")


def backend_spec(backend) -> dict:
    """The parts of a ``tokenizers.Tokenizer``'s configuration that decide byte positions (no vocab)."""
    return {"model": {"type": type(backend.model).__name__, "byte_fallback": getattr(backend.model, "byte_fallback", None)},
            "normalizer": _component(backend.normalizer), "pre_tokenizer": _component(backend.pre_tokenizer),
            "post_processor": _component(backend.post_processor)}


def _spec_ok(spec: dict) -> Tuple[bool, bool, bool]:
    """(byte-level positions usable, text must be NFC, offsets are trimmed), from :func:`backend_spec`."""
    model = spec.get("model") or {}
    norm = spec.get("normalizer")
    norms = norm.get("normalizers", []) if norm and norm.get("type") == "Sequence" else [norm] if norm else []
    if any(n.get("type") != "NFC" for n in norms):
        return False, False, False
    pre = spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    byte_level = [p for p in pres if p.get("type") == "ByteLevel"]
    if (model.get("type") != "BPE" or model.get("byte_fallback") or not byte_level
            or any(p.get("type") not in _SPLITTERS for p in pres) or any(p.get("add_prefix_space") for p in byte_level)):
        return False, False, False
    post = spec.get("post_processor")
    posts = post.get("processors", []) if post and post.get("type") == "Sequence" else [post] if post else []
    if any(p.get("type") not in _PROCESSORS for p in posts):
        return False, False, False
    return True, bool(norms), any(p.get("trim_offsets") for p in posts)


def _gigatoken_for(gigatoken, tok):
    """gigatoken from the directory's tokenizer.json when it holds the tokenizer as loaded (same
    size, same added tokens), else from the loaded tokenizer serialised (slower for a large vocab)."""
    path = os.path.join(tok.directory, "tokenizer.json")
    if os.path.isfile(path):
        gt = gigatoken.Tokenizer(path)
        added = tok.backend.get_added_tokens_decoder()
        vocab = gt.vocab
        if (gt.vocab_size == tok.backend.get_vocab_size(with_added_tokens=True)
                and all(vocab.get(i) == t.content.encode("utf-8") for i, t in added.items())):
            return gt
    return gigatoken.Tokenizer.from_json(tok.backend.to_str())


class FastTokenizer:
    """gigatoken for one ChatTokenizer, plus the tables that turn ids into byte positions."""

    def __init__(self, tok, gt) -> None:
        self.tok = tok
        self.gt = gt
        ok, self.needs_nfc, trims = _spec_ok(backend_spec(tok.backend))
        self.byte_positions = ok
        self.trims = trims
        vocab = gt.vocab
        n = max(max(vocab) + 1, tok.vocab_size)
        self.byte_len = np.zeros(n, dtype=np.int64)
        pieces = [b""] * n
        for i, b in vocab.items():
            pieces[i] = b
            self.byte_len[i] = len(b)
        self.byte_off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.byte_len, out=self.byte_off[1:])
        self.vocab_bytes = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        # tokens whose offsets, once trimmed, collapse to their end (whitespace only)
        self.all_trim = np.zeros(n, dtype=np.uint8)
        if trims:
            for i in range(tok.vocab_size):
                t = tok.backend.id_to_token(i)
                if t and all(c == "\u0120" or c in _RUST_WHITESPACE for c in t):
                    self.all_trim[i] = 1

    @classmethod
    def load(cls, tok, backend: str) -> Optional["FastTokenizer"]:
        """The fast tokenizer, or None to use ``tokenizers`` (``hf``, or ``auto`` when gigatoken is
        missing or disagrees with ``tokenizers`` on the probe texts).

        Raises:
            ShardError: ``gigatoken`` was asked for and is missing or disagrees.
        """
        if backend == "hf":
            return None
        try:
            import gigatoken
        except ImportError:
            if backend == "gigatoken":
                raise ShardError("--tokenizer-backend gigatoken needs the gigatoken package",
                                 field="tokenizer_backend",
                                 hint="pip install 'megatron_sft_idx[fast]' (or gigatoken)") from None
            return None
        try:
            fast = cls(tok, _gigatoken_for(gigatoken, tok))
        except Exception as exc:  # a tokenizer gigatoken cannot load
            if backend == "gigatoken":
                raise ShardError(f"gigatoken cannot load this tokenizer ({exc})", path=tok.path,
                                 field="tokenizer_backend", hint="use --tokenizer-backend hf") from None
            return None
        bad = fast.first_disagreement(list(_PROBES))
        if bad is not None:
            if backend == "gigatoken":
                raise ShardError(f"gigatoken and tokenizers give different ids for {bad!r}", path=tok.path,
                                 field="tokenizer_backend", hint="use --tokenizer-backend hf")
            return None
        return fast

    def encode(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        """Flat ids (int64) and per-text offsets into them (int64[len(texts)+1])."""
        # One call per text: ``encode_batch`` returns an awkward Array, and importing awkward
        # (which imports pyarrow) costs more resident memory than the tokenizer's vocabulary,
        # while the per-call overhead is under a microsecond next to the text's encoding.
        parts = [self.gt.encode(text) for text in texts]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([p.size for p in parts], out=offsets[1:])
        ids = np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
        return ids, offsets

    def first_disagreement(self, texts: List[str]) -> Optional[str]:
        """The first text whose ids differ from ``tokenizers``', or None."""
        ids, off = self.encode(texts)
        for i, enc in enumerate(self.tok.backend.encode_batch(texts, add_special_tokens=False)):
            if enc.ids != ids[off[i]:off[i + 1]].tolist():
                return texts[i]
        return None

    def trained_flags(self, texts: Sequence[str], spans: Sequence[Sequence[Tuple[int, int]]],
                      ids: np.ndarray, offsets: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Token-aligned trained flags for every text, and a per-text ``proven`` flag (uint8).

        ``spans`` are character spans; a text whose flags could not be proven equal to the
        reference rule has proven 0 (its flags are then meaningless)."""
        n = len(texts)
        # Each text encoded on its own, then the bytes joined: the same bytes as the joined text's
        # (UTF-8, surrogates one by one), where joining first widens every ASCII text to the
        # widest text's kind and encodes the whole batch from it (6x slower with one non-ASCII text)
        encoded = [t.encode("utf-8", "surrogatepass") for t in texts]
        text_bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        sizes = [len(b) for b in encoded]
        del encoded
        text_off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(sizes, out=text_off[1:])
        bounds: List[int] = []
        span_off = np.zeros(n + 1, dtype=np.int64)
        for i, (text, sp) in enumerate(zip(texts, spans)):
            if sizes[i] == len(text):   # (ASCII: characters are bytes)
                for a, b in sp:
                    bounds += (a, b)
            else:
                for a, b in sp:
                    bounds += (len(text[:a].encode("utf-8", "surrogatepass")),
                               len(text[:b].encode("utf-8", "surrogatepass")))
            span_off[i + 1] = len(bounds)
        eligible = np.full(n, 1 if self.byte_positions else 0, dtype=np.uint8)
        if self.byte_positions and self.needs_nfc:
            eligible[:] = [unicodedata.is_normalized("NFC", t) for t in texts]
        trained = np.zeros(ids.size, dtype=np.uint8)
        proven = _trained_kernel(ids, offsets, text_bytes, text_off, np.asarray(bounds, dtype=np.int64), span_off,
                                 eligible, self.byte_len, self.byte_off, self.vocab_bytes, self.all_trim, self.trims,
                                 trained)
        return trained, proven


@numba.njit(cache=True, nogil=True)
def _trained_kernel(ids, offsets, text_bytes, text_off, bounds, span_off, eligible, byte_len, byte_off,
                    vocab_bytes, all_trim, trims, trained):
    n = offsets.size - 1
    proven = np.zeros(n, dtype=np.uint8)
    starts = np.empty(ids.size + 1, dtype=np.int64)  # byte start of every token, relative to its text
    vmax = byte_len.size
    for t in range(n):
        if eligible[t] == 0:
            continue
        t0, t1 = offsets[t], offsets[t + 1]
        pos = text_off[t]
        end = text_off[t + 1]
        ok = True
        for j in range(t0, t1):  # the tokens' bytes must be the text's bytes, exactly
            tid = ids[j]
            if tid < 0 or tid >= vmax:
                ok = False
                break
            length = byte_len[tid]
            if pos + length > end:
                ok = False
                break
            src = byte_off[tid]
            for q in range(length):
                if vocab_bytes[src + q] != text_bytes[pos + q]:
                    ok = False
                    break
            if not ok:
                break
            starts[j] = pos - text_off[t]
            pos += length
        if not ok or pos != end:
            continue
        starts[t1] = end - text_off[t]
        mine = starts[t0:t1 + 1]
        for s in range(span_off[t], span_off[t + 1], 2):
            ja = t0 + np.searchsorted(mine, bounds[s])
            jb = t0 + np.searchsorted(mine, bounds[s + 1])
            # a boundary falls on a token start (or the end of the text), or inside a token whose
            # reference start is its byte start: no offset trimming, and its first byte is ASCII (a
            # token starting inside a character has a character offset of its own); the reference
            # rule, "trained when its start lies in the span", then reads the same from byte starts
            # (MiniMax-M2's call turn starts inside "\n\n": the generation prompt's "\n", then its own)
            for jx, bound in ((ja, bounds[s]), (jb, bounds[s + 1])):
                if starts[jx] != bound and (trims or jx == t0 or text_bytes[text_off[t] + starts[jx - 1]] >= 128):
                    ok = False
            if not ok:
                break
            # a whitespace-only token ending on a boundary: its trimmed start would be the boundary
            if (ja > t0 and all_trim[ids[ja - 1]] != 0) or (jb > t0 and all_trim[ids[jb - 1]] != 0):
                ok = False
                break
            for j in range(ja, jb):
                trained[j] = 1
        if ok:
            proven[t] = 1
        else:
            for j in range(t0, t1):
                trained[j] = 0
    return proven
