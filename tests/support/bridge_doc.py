"""The Bridge provider example of docs/TRAINING.md, as the tests read it: shared by
tests/training/test_bridge_provider.py (without Bridge) and tests/compat/test_bridge_example.py
(against the installed Bridge)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC_BATCH_KEYS = ['attention_mask', 'cu_seqlens_kv', 'cu_seqlens_q', 'labels', 'loss_mask', 'max_seqlen_kv',
                  'max_seqlen_q', 'position_ids', 'token_count', 'tokens']


def doc_provider_snippet() -> str:
    """The provider example of docs/TRAINING.md (section "The provider"), as written."""
    text = open(os.path.join(ROOT, "docs", "TRAINING.md"), encoding="utf-8").read()
    section = text.split("\n### The provider\n", 1)[1].split("\n### ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "build_context(" in b]
    assert len(blocks) == 1, "docs/TRAINING.md's provider example moved: update this test"
    return blocks[0]
