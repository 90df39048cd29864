"""What a long-running tool tells its user: ``-v`` / ``-q`` logging, and progress per phase.

Logging: one logger for the package, ``megatron_sft_idx`` (modules log to children of it);
:func:`configure_logging` makes ``-q`` errors only, the default warnings, ``-v`` also the
per-phase timings and decisions, each line prefixed with the command name.

Progress (:class:`Progress`): each long phase (tokenize, plan, write, checks, publish, ...)
is a :meth:`Progress.phase` with a total when one is known. On a terminal it is a tqdm bar
(total, rate, ETA); otherwise (a batch job's log file) one plain line every ``interval``
seconds, ``prog: phase: done/total (pct), rate, ETA, elapsed, RSS``, and never a carriage
return. The lines are written by a timer thread with ``os.write`` (no Python-level lock, so a
worker forked meanwhile cannot inherit one held), so a phase stuck in one long unit still says
it is alive. ``-q`` turns both off.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading
import time
from typing import Optional

from ._extras import require_extra
from ._units import duration, human_bytes

LOGGER = "megatron_sft_idx"
DEFAULT_LOG_INTERVAL = 30.0
log = logging.getLogger(LOGGER + ".progress")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (tests swap it)."""

    def __init__(self, prog: str) -> None:
        super().__init__()
        self.setFormatter(_Formatter(prog))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # logging.StreamHandler.__init__ assigns it
        pass


class _Formatter(logging.Formatter):
    def __init__(self, prog: str) -> None:
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        level = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}
        return f"{self.prog}: {level.get(record.levelno, '')}{record.getMessage()}"


def configure_logging(prog: str, verbose: bool = False, quiet: bool = False) -> None:
    """``-q``: errors only; default: warnings; ``-v``: info (timings, decisions). Idempotent."""
    logger = logging.getLogger(LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    logger.addHandler(_StderrHandler(prog))
    logger.setLevel(logging.ERROR if quiet else logging.INFO if verbose else logging.WARNING)
    logger.propagate = False


def add_verbosity_arguments(parser, quiet_help: str = "errors only: no progress and no summary",
                            verbose_help: str = "also log each phase's timing and the decisions taken",
                            group=None) -> None:
    """``-q/--quiet`` and ``-v/--verbose`` (mutually exclusive), the same on every tool."""
    g = (group or parser).add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", action="store_true", help=quiet_help)
    g.add_argument("-v", "--verbose", action="store_true", help=verbose_help)


_PEAK_SEEN = [0.0]   # the largest peak this process has read: a reset of VmHWM never lowers it


def own_peak_rss_mib() -> float:
    """This process's own peak resident memory (MiB): the kernel's high-water mark of its
    address space (``VmHWM`` in ``/proc/self/status``), which starts afresh at ``exec``.

    Not ``ru_maxrss``: on Linux it keeps the peak of the process image replaced by ``exec``, so
    a tool started from a large process (a notebook, a test runner, a launcher) would report
    its parent's size. A forked child (no ``exec``) counts the pages it shares with its parent
    at the fork, as the kernel does. The value never decreases within a process, even if
    something resets the mark after a read (``/proc/self/clear_refs``). Where ``/proc`` is missing (macOS),
    ``ru_maxrss`` (bytes there, KiB on Linux).
    """
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith((b"VmHWM:", b"VmRSS:")):
                    _PEAK_SEEN[0] = max(_PEAK_SEEN[0], int(line.split()[1]) / 1024)
        if _PEAK_SEEN[0]:
            return _PEAK_SEEN[0]
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def rss_mib() -> float:
    """This process's resident memory now (MiB); its peak where /proc is missing."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Progress:
    """How this run reports progress: ``mode`` is ``bar``, ``log`` or ``off``.

    Args:
        prog: the command name, first on every log line.
        mode: ``auto`` is ``bar`` when stderr is a terminal, else ``log``.
        interval: seconds between log lines (``log`` mode).
    """

    def __init__(self, prog: str, mode: str = "auto", interval: float = DEFAULT_LOG_INTERVAL) -> None:
        if mode == "auto":
            mode = "bar" if _isatty(sys.stderr) else "log"
        if mode not in ("bar", "log", "off"):
            raise ValueError(f"unknown progress mode {mode!r}")
        self.prog, self.mode, self.interval = prog, mode, max(0.01, float(interval))

    @classmethod
    def of(cls, value, prog: str = "megatron_sft_idx") -> "Progress":
        """A Progress from a Config's ``progress`` (a Progress, True: auto, False: off)."""
        if isinstance(value, Progress):
            return value
        return cls(prog, "auto" if value else "off")

    def phase(self, name: str, total: Optional[int] = None, unit: str = "", byte_unit: bool = False) -> "Phase":
        return Phase(self, name, total, unit, byte_unit)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Phase:
    """One phase's progress (a context manager): ``update(n)``, ``reset(total)``; on exit the
    phase's time is logged at info level (``-v``)."""

    def __init__(self, progress: Progress, name: str, total: Optional[int], unit: str, byte_unit: bool) -> None:
        self.progress, self.name, self.total, self.unit, self.byte_unit = progress, name, total, unit, byte_unit
        self.done = 0
        self._bar = None
        self._stop = threading.Event()
        self._thread = None
        self.started = time.monotonic()

    def __enter__(self) -> "Phase":
        self.started = time.monotonic()
        if self.progress.mode == "bar":
            require_extra("preprocess", "tqdm")
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.name, unit=self.unit or ("B" if self.byte_unit else "it"),
                             unit_scale=self.byte_unit,
                             unit_divisor=1024 if self.byte_unit else 1000, file=sys.stderr,
                             dynamic_ncols=True, mininterval=0.5)
        elif self.progress.mode == "log":
            self._thread = threading.Thread(target=self._tick, name=f"progress-{self.name}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.close()
        if kind is None:
            log.info("%s: %s in %.2f s", self.name, self._amount(self.done, self.total), time.monotonic() - self.started)

    def update(self, n: int = 1) -> None:
        self.done += int(n)
        if self._bar is not None:
            self._bar.update(int(n))

    def reset(self, total: Optional[int]) -> None:
        """A new total (known only once the phase is under way); ``done`` starts again at 0."""
        self.total, self.done = total, 0
        if self._bar is not None:
            self._bar.reset(total=total)

    # ------------------------------------------------------------------ log mode

    def _tick(self) -> None:
        while not self._stop.wait(self.progress.interval):
            _write_stderr(self.line() + "\n")

    def _amount(self, done, total) -> str:
        fmt = human_bytes if self.byte_unit else (lambda n: f"{int(n):,}")
        unit = "" if self.byte_unit or not self.unit else f" {self.unit}"
        return f"{fmt(done)}/{fmt(total)}{unit}" if total is not None else f"{fmt(done)}{unit}"

    def line(self) -> str:
        """The one-line report: ``prog: phase: done/total (pct), rate, ETA, elapsed, RSS``."""
        elapsed = max(1e-9, time.monotonic() - self.started)
        done, total = self.done, self.total
        parts = [self._amount(done, total)]
        if total:
            parts[0] += f" ({100.0 * done / total:.1f}%)"
        rate = done / elapsed
        if done:
            parts.append(f"{human_bytes(rate)}/s" if self.byte_unit else f"{rate:,.1f} {self.unit or 'it'}/s")
        if total and done and done < total:
            parts.append(f"ETA {duration((total - done) / rate)}")
        parts.append(f"elapsed {duration(elapsed)}")
        parts.append(f"RSS {rss_mib():,.0f} MiB")
        return f"{self.progress.prog}: {self.name}: " + ", ".join(parts)


def _write_stderr(text: str) -> None:
    data = text.encode("utf-8", "replace")
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a test's capture)
        try:
            sys.stderr.write(text)
        except (OSError, ValueError):
            pass
        return
    try:
        os.write(fd, data)
    except OSError:  # a closed stderr must not kill the run
        pass
