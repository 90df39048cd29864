"""``--skip-report FILE``: every record the run skipped, one JSON object a line, in input order.

Two stages skip: *tokenize* (a record that breaks a rule: its partition's ``.skips`` file,
committed by the partition's receipt) and *plan* (a sequence over the pack size under
``--overlong drop``, or with nothing trained left after ``--overlong truncate``: found again
here by the plan's own rule, :func:`~.plan.load_kept`). :class:`SkipReportStep` makes the lines
where the engine runs it (with the store in object storage the task pulls the partitions'
``.skips`` and ``.rows``: the driver gets the lines alone); the driver writes the file
(:func:`write_skip_report`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List

from .._atomic import write_file_atomically
from .config import PlanSettings
from .files import LOCAL, Files
from .plan import OVERLONG_REASON, load_kept
from .store import SKIPS_SUFFIX, SequenceStore, part_prefix, rows_paths

__all__ = ["plan_drops", "skip_report_lines", "write_skip_report", "SkipReportStep"]


def plan_drops(store: SequenceStore, s: PlanSettings) -> list:
    """``(file, line, entry)`` of every sequence the plan drops (``--overlong drop``, or nothing
    trained after ``--overlong truncate``), in store order, found by the plan's own rule
    (:func:`~.plan.load_kept`, lengths only): ``--skip-report``'s lines, ``entry`` being ``{"file",
    "line", "reason", "length", "stage": "plan"}`` with the reason the summary's
    ``sequences_dropped`` counts. None under ``--overlong error`` alone (the plan refuses instead)."""
    if s.overlong == "error" and not s.skip_bad:
        return []
    dropped = load_kept(store, s).dropped
    out: list = []
    base = 0
    for k, part in enumerate(store.partitions):
        if not dropped.size:
            break
        rows = store.rows(k)
        mine = dropped[(dropped >= base) & (dropped < base + rows.size)] - base
        name = store.inputs[part.file]["name"]
        out += [(part.file, int(rows["line"][i]), {"file": name, "line": int(rows["line"][i]),
                                                   "reason": OVERLONG_REASON[s.overlong],
                                                   "length": int(rows["length"][i]), "stage": "plan"})
                for i in mine]
        base += rows.size
    return out


def skip_report_lines(store: SequenceStore, plan_drops=()) -> List[str]:
    """``--skip-report FILE``'s lines: every record the run skipped, one JSON object a line, in
    input order (file, then line). A record the tokenize stage skipped is ``{"file", "line",
    "reason"}``; ``plan_drops`` adds the sequences the plan stage drops (``(file, line, entry)``
    from :func:`plan_drops`: entries ``{"file", "line", "reason", "length", "stage": "plan"}``).

    Raises:
        ShardError: a partition's skips file does not verify.
    """
    entries = [(part.file, line, {"file": store.inputs[part.file]["name"], "line": line, "reason": reason})
               for k, part in enumerate(store.partitions) for line, reason in store.skips(k)]
    entries += plan_drops
    entries.sort(key=lambda e: (e[0], e[1]))   # (stable: a record's skips stay in stage order)
    return [json.dumps(e) + "\n" for _, _, e in entries]


def write_skip_report(path: str, lines: List[str]) -> int:
    """Write :func:`skip_report_lines`' ``lines`` to ``path`` atomically; returns how many.

    Raises:
        OSError: the report cannot be written.
    """
    write_file_atomically(path, lambda f: f.write("".join(lines).encode("utf-8")))
    return len(lines)


@dataclass(frozen=True)
class SkipReportStep:
    """Unit 0: ``--skip-report``'s lines (:func:`skip_report_lines`, with the plan's drops by
    :func:`plan_drops`) where the unit runs. Returns ``{"unit": 0, "lines": [...]}``."""

    store_dir: str
    settings: PlanSettings
    files: Files = LOCAL
    name: str = "skip-report"

    @property
    def writes_to(self) -> str:
        return self.store_dir

    def reads(self, unit: int) -> List[str]:
        rows = rows_paths(self.store_dir)
        return rows + [part_prefix(self.store_dir, k) + SKIPS_SUFFIX for k in range(len(rows))]

    def run(self, unit: int) -> dict:
        store = SequenceStore(self.store_dir, files=self.files)
        return {"unit": unit, "lines": skip_report_lines(store, plan_drops(store, self.settings))}
