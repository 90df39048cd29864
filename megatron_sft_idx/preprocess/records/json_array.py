"""JSON arrays (``[{...}, {...}]``, how most public SFT sets ship) indexed and read with bounded memory.

A compiled scanner (:func:`_scan`) follows the array's structure byte by byte -- nesting depth,
strings and escapes -- and reports where each top-level element starts and ends. The index pass
uses it to cut an uncompressed array into partitions at element starts (as JSON Lines files are
cut at line starts), so a multi-GB array is tokenized by every worker; the reader uses it to hand
each element's bytes to the same bounded parser the JSON Lines path uses. Nothing holds more than
one block plus ``--max-record-bytes``: a longer element is skipped to its end and reported as an
:class:`~.inputs.OversizedRecord`. A record's number is its 1-based position in the array.

``ijson`` would stream the elements too, but gives no byte offsets (so no partitions: one worker
per file) and builds each element whole before it could be refused by size.
"""

from __future__ import annotations

from typing import Iterator, List, Tuple

import numpy as np

from ..._numba import numba
from .inputs import BLOCK, OversizedRecord, read_blocks

_BLOCK = BLOCK  # (the element buffers below are sized for one block)
# scanner state, carried across blocks: depth, in a string, after a backslash, expecting an element,
# inside an element, the array is closed, an error position (-1: none)
_DEPTH, _STRING, _ESCAPE, _EXPECT, _INSIDE, _CLOSED, _ERROR = range(7)


def new_state(inside_array: bool) -> np.ndarray:
    """State at the file's start, or (``inside_array``) at an element start of a partition."""
    state = np.zeros(7, dtype=np.int64)
    state[_ERROR] = -1
    if inside_array:
        state[_DEPTH], state[_EXPECT] = 1, 1
    return state


@numba.njit(cache=True, nogil=True)
def _scan(block, base, state, starts, ends):
    """Element starts and ends (absolute offsets: ``base`` + position) in ``block``; returns their
    counts. ``state`` is updated in place; a structural error sets ``state[_ERROR]``."""
    depth, string, escape, expect, inside, closed = state[0], state[1], state[2], state[3], state[4], state[5]
    ns = ne = 0
    for i in range(block.shape[0]):
        c = block[i]
        if string:
            if escape:
                escape = 0
            elif c == 92:  # backslash
                escape = 1
            elif c == 34:  # quote
                string = 0
            continue
        if c == 32 or c == 10 or c == 13 or c == 9:
            continue
        if closed:
            state[6] = base + i  # something after the closing bracket
            break
        if depth == 0:
            if c != 91:  # not '['
                state[6] = base + i
                break
            depth, expect = 1, 1
            continue
        if depth == 1 and c == 125:  # '}' closing nothing inside the array: '[{A}}', not one array
            state[6] = base + i
            break
        if depth == 1 and (c == 44 or c == 93):  # ',' or ']' between elements
            if inside:
                ends[ne] = base + i
                ne += 1
                inside = 0
            elif c == 44 or expect != 1:
                state[6] = base + i  # an empty element: ',,' or '[,' or ',]'
                break
            if c == 93:
                depth, closed, expect = 0, 1, 0
            else:
                expect = 2  # after a comma an element must follow (1: after '[', where ']' may)
            continue
        if depth == 1 and expect:
            starts[ns] = base + i
            ns += 1
            expect, inside = 0, 1
        elif depth == 1 and not inside:
            state[6] = base + i  # two elements without a comma
            break
        if c == 34:
            string = 1
        elif c == 91 or c == 123:
            depth += 1
        elif c == 93 or c == 125:
            depth -= 1
    state[0], state[1], state[2], state[3], state[4], state[5] = depth, string, escape, expect, inside, closed
    return ns, ne


class ArrayError(ValueError):
    """The bytes are not a JSON array (the caller names the file)."""


def _events(stream, limit: int, state: np.ndarray, offset: int) -> Iterator[Tuple[bytes, int, np.ndarray, np.ndarray]]:
    """``(block, block offset, element starts, element ends)`` over ``stream`` (``limit`` bytes, all when < 0)."""
    starts = np.empty(_BLOCK // 2 + 1, dtype=np.int64)  # an element and its comma take two bytes at least
    ends = np.empty(_BLOCK // 2 + 1, dtype=np.int64)
    for block in read_blocks(stream, limit):
        ns, ne = _scan(np.frombuffer(block, dtype=np.uint8), offset, state, starts, ends)
        if state[_ERROR] >= 0:
            raise ArrayError(f"not a JSON array at byte {int(state[_ERROR])}")
        yield block, offset, starts[:ns].copy(), ends[:ne].copy()
        offset += len(block)


def finish(state: np.ndarray) -> None:
    """Raises ArrayError unless the whole array was seen (closed bracket, nothing open)."""
    if not state[_CLOSED]:
        raise ArrayError("the JSON array is not closed (a truncated file?)")


def cut_points(blocks: Iterator[bytes], partition_bytes: int) -> List[Tuple[int, int]]:
    """``[(byte offset, first element number)]`` partition starts of the array made of ``blocks``,
    each at the first element start at or after ``partition_bytes`` past the previous cut, then
    ``(file size, count + 1)``.

    Raises:
        ArrayError: the bytes are not one JSON array.
    """
    state = new_state(False)
    cuts = [(0, 1)]
    count, target, size = 0, partition_bytes, 0
    for block, offset, starts, _ in _events(_Blocks(blocks), -1, state, 0):
        size = offset + len(block)
        k = int(np.searchsorted(starts, target))
        while k < starts.size:
            cuts.append((int(starts[k]), count + k + 1))
            target = int(starts[k]) + partition_bytes
            k = int(np.searchsorted(starts, target))
        count += starts.size
    finish(state)
    if cuts[-1][0] == 0 and count == 0:
        return [(0, 1), (size, 1)]
    cuts.append((size, count + 1))
    return cuts


class _Blocks:
    """A read() over an iterator of byte blocks (the index pass hashes them as it goes)."""

    def __init__(self, blocks: Iterator[bytes]) -> None:
        self.blocks = blocks

    def read(self, n: int) -> bytes:
        return next(self.blocks, b"")


def read_elements(stream, start: int, end: int, first: int, max_bytes: int) -> Iterator[tuple]:
    """``(element number, bytes | OversizedRecord)`` of the elements in ``[start, end)`` of the
    array (``end < 0``: to the end of the stream), holding at most one block plus ``max_bytes``.
    A read that reaches the end of the array checks that it is closed.

    Raises:
        ArrayError: the bytes are not a JSON array.
    """
    state = new_state(start > 0)
    number = first
    pending: List[bytes] = []
    held = 0
    oversized = False
    begin = -1     # offset where the current element started, -1 between elements
    for block, offset, starts, ends in _events(stream, end - start if end >= 0 else -1, state, start):
        pos = 0    # where the current element's bytes begin in this block
        for at, kind in sorted([(int(x), 0) for x in starts] + [(int(x), 1) for x in ends]):
            if kind == 0:
                begin, pos, pending, held, oversized = at, at - offset, [], 0, False
                continue
            piece = block[pos:at - offset]
            if oversized or held + len(piece) > max_bytes:
                yield number, OversizedRecord(at - begin)
            else:
                pending.append(piece)
                yield number, b"".join(pending)
            number += 1
            pending, held, oversized, begin = [], 0, False, -1
        if begin >= 0 and not oversized:  # the element runs on into the next block
            piece = block[pos:]
            if held + len(piece) <= max_bytes:
                pending.append(piece)
                held += len(piece)
            else:
                pending, held, oversized = [], 0, True
    if end < 0 or state[_CLOSED]:
        finish(state)
