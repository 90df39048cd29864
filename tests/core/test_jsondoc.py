"""The one JSON reader (megatron_sft_idx/jsondoc.py): its named limits, per use, at their bounds.

Artifacts keep the format's limits (tests/core/test_limits.py feeds those to Python and C++);
here: the record limits, the file reader, and that nothing beyond a limit escapes as anything
but the caller's error class with ``limit`` and ``detail`` set -- however deep the document."""

import json

import pytest

from megatron_sft_idx.errors import FormatError, HeaderError, MetadataError, MetadataLimitError
from megatron_sft_idx.format import MAX_METADATA_DEPTH
from megatron_sft_idx.jsondoc import RECORD_JSON_MAX_BYTES, RECORD_MAX_DEPTH, load_json, parse_json, parse_record_json


def nested(depth, inner="1"):
    return "[" * depth + inner + "]" * depth


@pytest.mark.parametrize("depth", [MAX_METADATA_DEPTH + 1, 900, 100_000])
def test_an_artifact_deeper_than_the_format_allows_is_a_limit_error(depth):
    with pytest.raises(MetadataLimitError) as info:
        parse_json(nested(depth).encode(), "/x/store.json", what="store.json")
    assert info.value.limit == "depth" and info.value.path == "/x/store.json" and info.value.field == "store.json"
    assert parse_json(nested(MAX_METADATA_DEPTH).encode()) is not None


@pytest.mark.parametrize("depth", [RECORD_MAX_DEPTH + 1, 100_000])
def test_a_record_deeper_than_its_bound_is_a_limit_error_as_text_or_bytes(depth):
    for raw in (nested(depth), nested(depth).encode()):
        with pytest.raises(MetadataLimitError) as info:
            parse_record_json(raw, what="messages[1].tool_calls[0].function.arguments")
        assert info.value.limit == "depth" and str(RECORD_MAX_DEPTH) in info.value.detail


def test_a_record_at_its_bound_parses_with_integers_of_any_size():
    value = parse_record_json(nested(RECORD_MAX_DEPTH, str(2 ** 80)))
    for _ in range(RECORD_MAX_DEPTH):
        (value,) = value
    assert value == 2 ** 80   # (an artifact refuses it: outside int64)
    with pytest.raises(MetadataLimitError, match="outside int64"):
        parse_json(str(2 ** 80).encode())


@pytest.mark.parametrize("raw", ['{"a": NaN}', '{"a": Infinity}', '[1e999]', '{"a": ', "\ufeff[]x"])
def test_a_record_that_is_not_rfc_json_is_refused(raw):
    with pytest.raises(MetadataError):
        parse_record_json(raw)


def test_record_bytes_decode_as_json_does_and_keep_lone_surrogates_for_the_mapping():
    assert parse_record_json('{"a": 1}'.encode("utf-8-sig")) == {"a": 1}
    assert parse_record_json('{"a": "x"}'.encode("utf-16")) == {"a": "x"}
    assert parse_record_json(b'{"a": "\xed\xa0\x80"}') == {"a": "\ud800"}   # named later, by its field


def test_a_json_string_inside_a_record_is_bounded_in_size():
    with pytest.raises(MetadataLimitError) as info:
        parse_record_json("[" + " " * RECORD_JSON_MAX_BYTES + "]")
    assert info.value.limit == "bytes"
    with pytest.raises(MetadataLimitError):
        parse_record_json(b"[" + b" " * 20 + b"]", max_length=10)
    text = '{"a": "' + "\u00e9" * 10 + '"}'   # 19 characters, 29 bytes: the bytes are bounded
    with pytest.raises(MetadataLimitError) as info:
        parse_record_json(text, max_length=28)
    assert info.value.limit == "bytes"
    assert parse_record_json(text, max_length=29) == {"a": "\u00e9" * 10}


@pytest.mark.parametrize("raw", ['{"a": 1, "a": 2}', '{"a": [' * 1 + nested(RECORD_MAX_DEPTH) + ']}', '{"a": 1e999}',
                                 '{"a": NaN}', '\ufeff{"a": 1}', '{"a": 1} x', '{"a": "\\ud800"}', '{"a": [1, 2]}'])
def test_a_record_read_as_text_or_bytes_equals_the_general_reader(raw):
    """parse_record_json's common case (a text it decodes itself) and its bytes agree with
    parse_json under the record limits: the same value, or the same error, limit and detail."""
    def outcome(call):
        try:
            return ("value", call())
        except MetadataError as exc:
            return (type(exc).__name__, str(exc), getattr(exc, "limit", None), exc.detail,
                    getattr(exc, "duplicate", None))
    want = outcome(lambda: parse_json(raw, None, max_length=RECORD_JSON_MAX_BYTES, max_depth=RECORD_MAX_DEPTH,
                                      int64=False, what="record", hint="fix the record, or pass --skip-bad",
                                      unique_keys=True))
    assert outcome(lambda: parse_record_json(raw)) == want
    if not raw.startswith("\ufeff"):
        assert outcome(lambda: parse_record_json(raw.encode("utf-8", "surrogatepass"))) == want


def test_the_caller_chooses_the_error_class_and_non_text_is_a_type_error():
    with pytest.raises(HeaderError) as info:
        parse_json(nested(5000).encode(), "/o.order", error=HeaderError, limit_error=None, what="order metadata")
    assert info.value.limit == "depth" and info.value.path == "/o.order"
    with pytest.raises(FormatError):
        parse_json(b"{", "/m.json", error=FormatError)
    with pytest.raises(TypeError):
        parse_json(10 ** 9)   # never bytes(10**9): a number is not JSON text


def test_load_json_names_the_file_and_bounds_its_read(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"x": 1}) + " " * 100)
    assert load_json(str(path)) == {"x": 1}
    with pytest.raises(MetadataError) as info:
        load_json(str(path), max_length=50)
    assert info.value.path == str(path) and info.value.field == "state.json" and info.value.limit == "bytes"
    path.write_text(nested(100_000))
    with pytest.raises(MetadataError, match="nested deeper than 64"):
        load_json(str(path))


def test_unique_keys_refuses_a_key_given_twice_at_any_depth():
    from megatron_sft_idx.errors import MetadataError
    from megatron_sft_idx.jsondoc import parse_json

    assert parse_json('{"a": 1, "a": 2}') == {"a": 2}   # (metadata: the last one, as the format says)
    assert parse_json('{"a": {"b": 1}, "c": [{"b": 2}]}', unique_keys=True) == {"a": {"b": 1}, "c": [{"b": 2}]}
    for text in ('{"a": 1, "a": 2}', '{"x": [{"k": 1, "k": 1}]}'):
        with pytest.raises(MetadataError, match="names the key .* twice") as err:
            parse_json(text, "f.json", unique_keys=True)
        assert err.value.path == "f.json" and err.value.field in ("a", "k")
