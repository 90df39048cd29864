"""docs/FORMAT.md is the spec: its tables must agree with format.py and the golden bytes."""

import os
import re
import struct

import pytest

from megatron_sft_idx import format as fmt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = open(os.path.join(ROOT, "docs", "FORMAT.md"), encoding="utf-8").read()
GOLDEN = os.path.join(ROOT, "tests", "golden", "v1_1", "tiny")


def section(title: str) -> str:
    start = DOC.index(title)
    nxt = DOC.find("\n## ", start + 1)
    nxt_sub = DOC.find("\n### ", start + 1)
    ends = [e for e in (nxt, nxt_sub) if e != -1]
    return DOC[start:min(ends) if ends else len(DOC)]


def table_rows(text: str):
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append(cells)
    return rows[1:]  # drop the header row


def struct_fields(st: struct.Struct):
    """(offset, size) of each field of a little-endian struct with no padding."""
    codes = re.findall(r"(\d*)([a-zA-Z])", st.format.lstrip("<"))
    out, offset = [], 0
    for count, code in codes:
        if code == "s":
            size = int(count)
            out.append((offset, size))
            offset += size
            continue
        for _ in range(int(count or 1)):
            size = struct.calcsize("<" + code)
            out.append((offset, size))
            offset += size
    return out


def test_idx_header_table_matches_struct():
    rows = table_rows(section("## `P.idx`"))[:5]
    assert [r[3] for r in rows] == ["magic", "version", "dtype_code", "sequence_count", "document_count"]
    assert [(int(r[0]), int(r[1])) for r in rows] == struct_fields(fmt.IDX_HEADER)
    assert rows[0][4] == "`MMIDIDX\\x00\\x00`"
    assert fmt.IDX_MAGIC == b"MMIDIDX\x00\x00"
    assert int(rows[1][4]) == fmt.IDX_VERSION
    assert fmt.IDX_HEADER_SIZE == 34


def test_seq_idx_header_table_matches_struct():
    rows = table_rows(section("## `P.seq.idx`"))[:14]
    names = ["magic", "version_major", "version_minor", "token_dtype_code", "seq_dtype_code",
             "loss_dtype_code", "flags", "pack_count", "sequence_count", "token_count",
             "metadata_length", "csr_offset", "body_crc32", "header_crc32"]
    assert [r[3] for r in rows] == names
    assert [(int(r[0]), int(r[1])) for r in rows] == struct_fields(fmt.SEQ_IDX_HEADER)
    assert rows[0][4] == "`MSFTSEQ\\x00`" and fmt.SEQ_IDX_MAGIC == b"MSFTSEQ\x00"
    assert rows[1][4].startswith(str(fmt.SEQ_IDX_VERSION[0]))
    assert rows[4][4].startswith(f"{int(fmt.SEQ_DTYPE)} (int32)")
    assert rows[5][4].startswith(f"{int(fmt.LOSS_DTYPE)} (uint8)")
    assert fmt.SEQ_IDX_HEADER_SIZE == fmt.METADATA_OFFSET == 64 == fmt.ALIGNMENT
    assert "16 MiB" in rows[10][4] and fmt.MAX_METADATA_LENGTH == 16 << 20


def test_dtype_table_matches_enum():
    rows = table_rows(section("## Dtype codes"))
    assert {int(code): name for code, name in rows} == {int(d): d.name for d in fmt.DType}


def test_rule_table_matches_enum():
    rows = table_rows(section("## Pack invariants"))
    documented = {int(code): text.split(":")[0] for code, text in rows}
    assert documented == {int(r): r.name for r in fmt.Rule if r != fmt.Rule.OK}


def test_file_table_lists_the_suffixes():
    rows = table_rows(section("## The five files"))
    assert [r[0].strip("`").replace("P", "", 1) for r in rows] == [
        fmt.BIN_SUFFIX, fmt.IDX_SUFFIX, fmt.LOSS_SUFFIX, fmt.SEQ_IDX_SUFFIX, fmt.SEQ_BIN_SUFFIX]


def test_metadata_table_lists_required_keys():
    from megatron_sft_idx.metadata import RESERVED_KEYS

    rows = table_rows(section("## Metadata"))
    required = {r[0] for r in rows if r[1] == "yes"}
    assert required == set(RESERVED_KEYS) | {"pad_seq_to_mult"}


def _doc_block(marker_line: str) -> bytes:
    """The hex bytes of the code block that follows ``marker_line`` in the worked example."""
    text = section("## Worked example")
    start = text.index(marker_line)
    block = text[text.index("```", start) + 3:]
    block = block[:block.index("```")]
    return bytes.fromhex("".join(line.split("|")[0] for line in block.strip().splitlines()))


@pytest.mark.parametrize("suffix,size,marker", [
    (".idx", fmt.IDX_HEADER_SIZE, "`tiny.idx` header"),
    (".seq.idx", fmt.SEQ_IDX_HEADER_SIZE, "`tiny.seq.idx` header"),
])
def test_worked_example_matches_golden_bytes(suffix, size, marker):
    with open(GOLDEN + suffix, "rb") as f:
        head = f.read(size)
    assert _doc_block(marker) == head


def test_golden_headers_decode_as_documented():
    with open(GOLDEN + ".idx", "rb") as f:
        raw = f.read()
    h = fmt.IdxHeader.parse(raw, GOLDEN + ".idx", len(raw))
    assert (h.dtype_code, h.sequence_count, h.document_count) == (int(fmt.DType.uint16), 3, 4)
    with open(GOLDEN + ".seq.idx", "rb") as f:
        raw = f.read()
    s = fmt.SeqIdxHeader.parse(raw, GOLDEN + ".seq.idx", len(raw))
    assert s.pack_count == 3 and s.csr_offset % fmt.ALIGNMENT == 0
