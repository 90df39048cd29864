"""The promotion gate: check shards before they reach training storage.

    from megatron_sft_idx.gate import check, promote
    report = check(["/data/staging/train_*"], vocab_size=128256, workers=2)
    print(report.format_text())
    if report.passed:
        for shard in report.shards:
            promote(shard, "/data/train")

Every finding has a stable code (``CODES``, documented in ``docs/GATE.md``),
a severity, the file, and the pack and byte offset where it applies.
"""

from .checks import LEVELS, check, check_shard
from .codes import CODES, RULE_CODES
from .promote import promote, promote_report
from .report import Finding, Report, ShardReport

__all__ = ["check", "check_shard", "promote", "promote_report", "Report", "ShardReport", "Finding",
           "CODES", "RULE_CODES", "LEVELS"]
