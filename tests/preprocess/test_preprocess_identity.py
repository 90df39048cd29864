"""The batched encoder writes byte-identical shards to the reference path (pinned digests)."""

import json
import os

import pytest

from support.preprocess_identity import CASES, DIGESTS, run_case

with open(DIGESTS, encoding="utf-8") as _f:
    PINNED = json.load(_f)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(tmp_path_factory.mktemp("identity"))


@pytest.mark.slow
@pytest.mark.parametrize("backend,method", [("auto", "auto"), ("hf", "prefix")])
@pytest.mark.parametrize("inputs,template,loss", CASES)
def test_shards_match_the_reference_digests(base, inputs, template, loss, backend, method):
    got = run_case(base, inputs, template, loss, tokenizer_backend=backend, span_method=method)
    assert got == PINNED[f"{inputs}/{template}/{loss}"]
