"""Shared plumbing of the benchmarks: child processes, memory probes, medians, JSON, tables.

A measurement that involves memory runs in a fresh interpreter so that its peak RSS
is its own: :func:`run_child` starts ``python -m bench._common '<json spec>'``, the
child imports ``module:function``, calls it with the spec's keyword arguments and
prints one marked JSON line holding the function's result plus its own peak RSS
(``VmHWM`` from ``/proc/self/status``, the kernel's high-water mark; equal to
``ru_maxrss``). Sizes are MiB, times seconds.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
_MARK = "@@BENCH-RESULT@@"
MIB = 1 << 20


class ChildError(RuntimeError):
    """A benchmark child process failed; the message carries the tail of its stderr."""


# ---------------------------------------------------------------- memory probes (Linux /proc)

def proc_status() -> Dict[str, float]:
    """``VmHWM`` (peak RSS), ``VmRSS``, ``RssAnon``, ``RssFile`` of this process, in MiB.

    ``RssFile`` holds mmapped file pages (reclaimable page cache that happens to be
    mapped); ``RssAnon`` is the heap that cannot be given back without freeing it.
    """
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) / 1024.0
    except OSError:  # not Linux: fall back to ru_maxrss for the peak only
        import resource
        out["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return out


def rss_mb() -> float:
    """Current resident set size in MiB."""
    return proc_status().get("VmRSS", float("nan"))


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0: write 5 to clear_refs). True on success."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- child processes

def run_child(target: str, timeout: Optional[float] = None, **kwargs) -> Dict[str, Any]:
    """Run ``module:function(**kwargs)`` in a fresh interpreter; return its result dict.

    The result gains ``peak_rss_mb`` (the child's VmHWM at exit), ``rss_end_mb``,
    ``rss_anon_end_mb`` and ``child_wall_s``.

    Raises:
        ChildError: the child exited non-zero or printed no result.
    """
    spec = json.dumps({"target": target, "kwargs": kwargs})
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONWARNINGS", "ignore")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench._common", spec], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise ChildError(f"{target} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(_MARK):])
    result["child_wall_s"] = wall
    return result


def _child_main(argv: Sequence[str]) -> int:
    spec = json.loads(argv[0])
    module, _, name = spec["target"].partition(":")
    result = getattr(import_module(module), name)(**spec["kwargs"])
    status = proc_status()
    result = dict(result)
    result.setdefault("peak_rss_mb", status.get("VmHWM"))
    result["rss_end_mb"] = status.get("VmRSS")
    result["rss_anon_end_mb"] = status.get("RssAnon")
    sys.stdout.write(_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


# ---------------------------------------------------------------- statistics

def median_dicts(runs: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Per-key median of numeric values over repeated runs; other values from the first run."""
    out: Dict[str, Any] = {}
    for key in runs[0]:
        values = [r.get(key) for r in runs]
        numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numeric and len(numeric) == len(values):
            out[key] = statistics.median(numeric)
        elif all(isinstance(v, bool) for v in values):
            out[key] = all(values)
        else:
            out[key] = values[0]
    return out


def ratio(ours: Optional[float], peer: Optional[float]) -> Optional[float]:
    """ours ÷ peer, or None when either is missing or the peer is zero."""
    if ours is None or peer is None or not isinstance(ours, (int, float)) or not isinstance(peer, (int, float)):
        return None
    if peer <= 0:  # a ratio against zero or a negative figure says nothing
        return None
    return ours / peer


# ---------------------------------------------------------------- machine and JSON

def machine() -> Dict[str, Any]:
    """What ran the benchmark: CPU model, cores, memory, library versions."""
    info: Dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    from importlib import metadata
    for dist in ("numpy", "numba", "pyarrow", "torch", "megatron-core"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    return info


def write_json(name: str, payload: Mapping[str, Any], results_dir: Optional[Path] = None) -> Path:
    """Write ``payload`` plus the machine description and the command to ``results/<name>.json``."""
    out_dir = Path(results_dir) if results_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    doc = {"benchmark": name, "command": " ".join([Path(sys.executable).name, "-m", f"bench.{name}"] + sys.argv[1:]),
           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine()}
    doc.update(payload)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n")
    os.replace(tmp, path)
    return path


def _jsonable(value):
    try:
        import numpy as np
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:
        pass
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ---------------------------------------------------------------- tables

def fmt(value: Any) -> str:
    """Compact human format: 3 significant digits for floats, '—' for missing."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if value != value:
            return "—"
        a = abs(value)
        if a >= 1e6:
            return f"{value:.3g}"
        if a >= 100:
            return f"{value:.0f}"
        if a >= 1:
            return f"{value:.3g}"
        return f"{value:.3g}"
    return str(value)


def format_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-markdown table (also readable in a terminal)."""
    cells = [[str(h) for h in header]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def ratio_cell(ours: Optional[float], peer: Optional[float], higher_is_better: bool) -> str:
    """'0.52× ✓' — the ratio ours÷peer with a check mark when ours is better by >5%."""
    r = ratio(ours, peer)
    if r is None:
        return "—"
    better = r > 1.05 if higher_is_better else r < 0.95
    worse = r < 0.95 if higher_is_better else r > 1.05
    text = f"{r:.3g}×" if r >= 0.01 else f"{r:.2e}×"
    return text + (" ✓" if better else " ✗" if worse else " ≈")


def list_of_floats(text: str) -> List[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def chosen_corpora(text: str, known: Sequence[str]) -> List[str]:
    """The corpora a comma-separated ``--corpora`` names, in its order; one known to the bench each."""
    corpora = [c for c in text.split(",") if c]
    unknown = sorted(set(corpora) - set(known))
    if unknown:
        raise SystemExit(f"unknown corpus {unknown[0]!r}: choose from {', '.join(known)}")
    return corpora


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
