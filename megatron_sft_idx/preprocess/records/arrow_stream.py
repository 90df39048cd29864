"""Starting an Arrow IPC *stream* at its k-th record batch without reading the batches before it.

The stream format (what ``datasets.save_to_disk`` writes) has no index: pyarrow's reader reads
every batch before the one it is asked for. Over a mapped local file that costs nothing; over an
object in storage it costs their bytes. Every message is framed, though::

    offset  size        field
    0       4           continuation marker 0xFFFFFFFF (absent in streams before Arrow 0.15)
    4       4           int32 LE: metadata length M (0: end of stream)
    8       M           flatbuffer ``Message`` (padded to 8 bytes)
    8+M     bodyLength  the body (the batch's buffers)

so :func:`stream_from` reads the schema message, then only the 8-byte prefix and the metadata
of each batch before batch ``k`` (``Message.bodyLength``, field 3 of the flatbuffer table: version,
header_type, header, bodyLength), seeks past its body, and hands pyarrow the schema followed by
the stream from batch ``k`` on. The batches pyarrow then decodes are the very bytes it would
have decoded reading from the start. A stream holding dictionary batches before batch ``k``
(needed to decode it), or bytes that do not frame as expected, is read from the start instead.
"""

from __future__ import annotations

import io
import struct
from typing import Optional, Tuple

_CONTINUATION = b"\xff\xff\xff\xff"
_I32, _U32, _U16, _I64 = struct.Struct("<i"), struct.Struct("<I"), struct.Struct("<H"), struct.Struct("<q")
#: MessageHeader union tags (Arrow's Message.fbs).
SCHEMA, DICTIONARY_BATCH, RECORD_BATCH = 1, 2, 3
#: The largest metadata block a frame may claim (a schema of thousands of columns fits).
MAX_METADATA = 64 << 20


class NotFramed(ValueError):
    """The bytes are not an Arrow IPC stream as this module frames it (the caller reads from the start)."""


def _message_fields(meta: bytes) -> Tuple[int, int]:
    """``(header_type, bodyLength)`` of a flatbuffer ``Message``.

    Raises:
        NotFramed: offsets outside the buffer.
    """
    def read(fmt: struct.Struct, at: int) -> int:
        if at < 0 or at + fmt.size > len(meta):
            raise NotFramed("a Message field lies outside its metadata")
        return fmt.unpack_from(meta, at)[0]

    table = read(_U32, 0)
    vtable = table - read(_I32, table)
    vlen = read(_U16, vtable)

    def field(index: int, fmt: struct.Struct, default: int = 0) -> int:
        slot = 4 + 2 * index
        offset = read(_U16, vtable + slot) if slot + 2 <= vlen else 0
        return read(fmt, table + offset) if offset else default

    return field(1, struct.Struct("<B")), field(3, _I64)


def _frame(f) -> Optional[Tuple[int, int, bytes]]:
    """The next message's ``(header_type, bodyLength, prefix + metadata bytes)``; None at the
    end of the stream. ``f`` is left at the message's body.

    Raises:
        NotFramed: a cut or malformed frame.
    """
    head = f.read(4)
    if len(head) < 4:
        return None
    prefix = head
    if head == _CONTINUATION:
        more = f.read(4)
        if len(more) < 4:
            raise NotFramed("a frame is cut short")
        prefix += more
        length = _I32.unpack(more)[0]
    else:
        length = _I32.unpack(head)[0]
    if length == 0:
        return None
    if not 0 < length <= MAX_METADATA:
        raise NotFramed(f"a frame claims {length} bytes of metadata")
    meta = f.read(length)
    if len(meta) < length:
        raise NotFramed("a frame is cut short")
    kind, body = _message_fields(meta)
    if body < 0:
        raise NotFramed("a negative body length")
    return kind, body, prefix + meta


class _Spliced(io.RawIOBase):
    """``head`` then the rest of ``f`` from its current position: a read-only stream."""

    def __init__(self, head: bytes, f) -> None:
        super().__init__()
        self._head, self._f = memoryview(head), f

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        if len(self._head):
            n = min(len(view), len(self._head))
            view[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._f.read(len(view))
        view[: len(data)] = data
        return len(data)


#: What one read of a frame fetches (its prefix and metadata, and often the next frames' when
#: batches are small): a skipped batch costs at most about this much.
FRAME_READ = 16 << 10


def stream_from(raw, first: int, buffer_size: int = 256 << 10):
    """A pyarrow stream reader whose batches are those of the IPC stream in ``raw`` (a seekable,
    unbuffered binary file) from batch ``first`` on, read through a ``buffer_size`` buffer; None
    when ``raw`` is not such a stream (an IPC *file*, whose reader seeks by its footer) or holds
    a dictionary batch before ``first``.
    """
    import pyarrow as pa

    raw.seek(0)
    frames = io.BufferedReader(raw, FRAME_READ)
    try:
        schema = _frame(frames)
        if schema is None or schema[0] != SCHEMA or schema[1] != 0:
            return None
        for _ in range(first):
            frame = _frame(frames)
            if frame is None or frame[0] != RECORD_BATCH:
                return None
            frames.seek(frame[1], io.SEEK_CUR)
    except NotFramed:
        return None
    rest = frames.tell()
    frames.detach()   # (raw stays open: the caller closes it)
    raw.seek(rest)
    return pa.ipc.open_stream(pa.PythonFile(io.BufferedReader(_Spliced(schema[2], raw), buffer_size), mode="r"))
