"""The new input shapes (tool calls, reasoning, Alpaca, parts, JSON arrays) keep their pinned bytes,
by the batched path and the reference path alike (tests/support/shapes_identity.py)."""

import json

import pytest

from support.shapes_identity import CASES, DIGESTS, run_case

with open(DIGESTS, encoding="utf-8") as _f:
    PINNED = json.load(_f)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(tmp_path_factory.mktemp("shapes"))


@pytest.mark.slow
@pytest.mark.parametrize("backend,method", [("auto", "auto"), ("hf", "prefix")])
@pytest.mark.parametrize("name", sorted(CASES))
def test_shapes_match_the_pinned_digests(base, name, backend, method):
    got = run_case(base, name, tokenizer_backend=backend, span_method=method)
    assert got == PINNED[name]
