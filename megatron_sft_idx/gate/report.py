"""What the gate found: findings per shard, a verdict per shard, and an overall verdict.

Rendered as text for people (one line per finding) and as JSON for pipelines
(``schema`` names the layout; keys are only ever added).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from .._units import plural
from ..format import ORDER_SUFFIX
from ..metadata import ShardSet
from .codes import CODES, ERROR, INFO, WARNING

JSON_SCHEMA = "megatron_sft_idx.gate/1"
#: Human output lists this many findings of one code per shard (all with verbose=True).
TEXT_LINES_PER_CODE = 5


@dataclass
class Finding:
    """One problem (or notice) at one place.

    ``file`` is the full path of the file it is about (the prefix when it is
    about the shard as a whole); ``pack`` the pack index and ``offset`` the
    byte offset in ``file`` where it applies, when there is one.
    """

    code: str
    severity: str
    file: str
    message: str
    pack: Optional[int] = None
    offset: Optional[int] = None

    def format_line(self) -> str:
        where = [os.path.basename(self.file)]
        if self.pack is not None:
            where.append(f"pack {self.pack}")
        if self.offset is not None:
            where.append(f"byte {self.offset}")
        return f"  {self.severity:<7} {self.code:<26} {', '.join(where)}: {self.message}"


def make_finding(code: str, message: str, file: str, *, pack=None, offset=None,
                 severity: Optional[str] = None) -> Finding:
    """A finding with the code's default severity and its action appended to ``message``."""
    info = CODES[code]
    action = info.action
    text = message if action in ("nothing",) else f"{message} -- {action}"
    return Finding(code=code, severity=severity or info.severity, file=str(file), message=text,
                   pack=None if pack is None else int(pack), offset=None if offset is None else int(offset))


@dataclass
class ShardReport:
    """The verdict on one shard.

    ``kind`` is ``"sft"``, ``"pretrain"`` or ``"unknown"`` (files missing);
    ``files`` maps each suffix present to its size in bytes; ``promoted`` maps
    each suffix to the path it was moved/linked to (empty when not promoted).
    """

    prefix: str
    kind: str = "unknown"
    level: str = "standard"
    strict: bool = False
    findings: List[Finding] = field(default_factory=list)
    packs: Optional[int] = None
    tokens: Optional[int] = None
    files: Dict[str, int] = field(default_factory=dict)
    checks: List[str] = field(default_factory=list)
    seconds: float = 0.0
    promoted: Dict[str, str] = field(default_factory=dict)
    #: (st_dev, st_ino, size, mtime_ns) per suffix when checked; promotion refuses changed files.
    identity: Dict[str, tuple] = field(default_factory=dict, repr=False)
    #: The set the metadata says the shard belongs to (None: no set, or no readable metadata).
    shard_set: Optional[ShardSet] = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        failing = (ERROR, WARNING) if self.strict else (ERROR,)
        return not any(f.severity in failing for f in self.findings)

    @property
    def unreadable(self) -> bool:
        return any(f.code == "FILE_UNREADABLE" for f in self.findings)

    def count(self, severity: str) -> int:
        return sum(f.severity == severity for f in self.findings)

    def codes(self) -> List[str]:
        return [f.code for f in self.findings]

    def add(self, finding: Finding) -> Finding:
        self.findings.append(finding)
        return finding

    def to_dict(self) -> Dict[str, Any]:
        return {
            "prefix": self.prefix, "kind": self.kind, "passed": self.passed, "level": self.level,
            "packs": self.packs, "tokens": self.tokens, "bytes": sum(self.files.values()),
            "files": dict(self.files), "checks": list(self.checks), "seconds": round(self.seconds, 4),
            "errors": self.count(ERROR), "warnings": self.count(WARNING),
            "findings": [asdict(f) for f in self.findings], "promoted": dict(self.promoted),
        }

    def format_text(self, verbose: bool = False) -> str:
        rank = {ERROR: 0, WARNING: 1, INFO: 2}
        shown = sorted((f for f in self.findings if verbose or f.severity != INFO),
                       key=lambda f: rank.get(f.severity, 3))
        size = sum(self.files.values())
        facts = [self.kind]
        if self.packs is not None:
            facts.append(f"{self.packs:,} packs")
        if self.tokens is not None:
            facts.append(f"{self.tokens:,} tokens")
        facts.append(_human_bytes(size))
        facts.append(f"{self.seconds:.2f} s")
        lines, per_code = [], {}
        for f in shown:
            per_code[f.code] = per_code.get(f.code, 0) + 1
            if verbose or per_code[f.code] <= TEXT_LINES_PER_CODE:
                lines.append(f.format_line())
        for code, count in per_code.items():
            if not verbose and count > TEXT_LINES_PER_CODE:
                lines.append(f"  ... {count - TEXT_LINES_PER_CODE} more {code} finding(s) (--verbose or --json "
                             f"lists them)")
        if verbose and self.checks:
            lines.append(f"  checks run: {', '.join(self.checks)}")
        for suffix, dest in self.promoted.items():
            lines.append(f"  -> {suffix:<9} {dest}")
        verdict = "PASS" if self.passed else "FAIL"
        return "\n".join(lines + [f"{verdict}  {self.prefix}  ({', '.join(facts)})"])


@dataclass
class Report:
    """The verdicts on every shard of one gate run.

    ``passed`` is true when at least one shard was checked and every shard
    passed; ``exit_code`` is the CLI's status (0 pass, 1 fail, 2 unreadable input).
    """

    shards: List[ShardReport] = field(default_factory=list)
    level: str = "standard"
    options: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    #: With --promote: each manifest or order that travelled with its shards, ``{"source", "promoted"}``,
    #: that was left in place, ``{"source", "left": why}``, or an old order (or shard file) removed at the
    #: destination (``--replace``), ``{"source": its path, "removed": why}``.
    manifests: List[Dict[str, str]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.shards) and all(s.passed for s in self.shards)

    @property
    def exit_code(self) -> int:
        if any(s.unreadable for s in self.shards) or not self.shards:
            return 2
        return 0 if self.passed else 1

    def findings(self) -> List[Finding]:
        return [f for s in self.shards for f in s.findings]

    def to_dict(self) -> Dict[str, Any]:
        failed = [s for s in self.shards if not s.passed]
        return {
            "schema": JSON_SCHEMA, "passed": self.passed, "exit_code": self.exit_code,
            "level": self.level, "options": dict(self.options), "seconds": round(self.seconds, 4),
            "summary": {"shards": len(self.shards), "passed": len(self.shards) - len(failed),
                        "failed": len(failed), "errors": sum(s.count(ERROR) for s in self.shards),
                        "warnings": sum(s.count(WARNING) for s in self.shards)},
            "shards": [s.to_dict() for s in self.shards],
            "manifests": [dict(m) for m in self.manifests],
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False, default=str)

    def format_text(self, verbose: bool = False) -> str:
        blocks = [s.format_text(verbose) for s in self.shards]
        for m in self.manifests:   # manifests, and the balanced orders that travel with them
            kind = ("order" if m["source"].endswith(ORDER_SUFFIX) else "manifest" if m["source"].endswith(".json")
                    else "file")
            if "promoted" in m:
                blocks.append(f"{kind} {m['source']} -> {m['promoted']}")
            elif "removed" in m:
                blocks.append(f"{kind} {m['source']} removed: {m['removed']}")
            else:
                blocks.append(f"{kind} {m['source']} left in place: {m['left']}")
        return "\n".join(blocks + [self.verdict_line()])

    def verdict_line(self) -> str:
        failed = sum(not s.passed for s in self.shards)
        errors = sum(s.count(ERROR) for s in self.shards)
        warnings = sum(s.count(WARNING) for s in self.shards)
        verdict = "PASS" if self.passed else "FAIL"
        note = " (checksums skipped: --fast)" if self.level == "fast" else ""

        total = len(self.shards)
        return (f"overall: {verdict}: {total - failed} of {plural(total, 'shard')} passed, "
                f"{plural(errors, 'error')}, {plural(warnings, 'warning')}, level {self.level}{note}")


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
