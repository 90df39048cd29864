"""What every command line shares (``check-idx``, ``preprocess-sft`` / ``repack-sft``,
``write-sft-manifest`` and the shard tools): the prologue, the argparse types, exit codes, error
reporting, signals, output. One copy: a command's CLI module builds its parser and calls
:func:`start`, which parses (argparse's exits become exit codes) and configures logging.

Exit status: 0 success; 1 the tool refused or failed on readable input (incompatible
shards, a corrupt shard, an output that failed the gate); 2 usage error or input it
cannot use at all (no such shard, an existing output; a missing optional dependency is
:class:`~megatron_sft_idx._extras.MissingExtraError`, which :mod:`megatron_sft_idx._console`
turns into one line naming the extra). A user's mistake prints one line naming the file and
what to do, never a traceback.
"""

from __future__ import annotations

import argparse
import math
import contextlib
import os
import sys
from typing import Callable, Iterator, List, Optional, Union

from ._progress import configure_logging
from ._signals import INTERRUPTS, exit_code, signal_name, signals_raise
from ._units import MAX_SECONDS, parse_size
from .errors import ShardError, ShardExistsError, ShardNotFoundError

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
_USAGE_ERRORS = (ShardNotFoundError, ShardExistsError)


def parse(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> Union[argparse.Namespace, int]:
    """Parsed arguments, or the exit code when argparse exited (``--help``: 0, a bad flag: 2)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_USAGE


def start(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> Union[argparse.Namespace, int]:
    """The prologue of every command: parsed arguments with logging configured for them
    (``-q``/``-v`` where the parser has them), or the exit code when argparse exited."""
    args = parse(parser, argv)
    if not isinstance(args, int):
        configure_logging(parser.prog, getattr(args, "verbose", False), getattr(args, "quiet", False))
    return args


def usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    """Print the usage and one line naming the problem, as argparse does; the usage exit code."""
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(prog: str, body: Callable[[], int]) -> int:
    """Run ``body`` with the project's error policy. SIGINT and SIGTERM raise inside it
    (:mod:`megatron_sft_idx._signals`), so a tool's cleanup (removing its staging files) runs;
    the tool then exits 130 / 143 saying whether its output was published."""
    try:
        with signals_raise():
            return body()
    except _USAGE_ERRORS as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ShardError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except ImportError:  # a missing extra: megatron_sft_idx._console prints it in one line, exit 2
        raise
    except OSError as exc:  # permission denied, disk full, a directory given for a file, ...
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        print(f"{prog}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAIL
    except INTERRUPTS as exc:
        published = getattr(exc, "published", None)
        outcome = f"{published} had been published completely" if published else "nothing was published"
        print(f"{prog}: interrupted by {signal_name(exc)}; {outcome}", file=sys.stderr)
        return exit_code(exc)


@contextlib.contextmanager
def published(output: str) -> Iterator[None]:
    """Mark a SIGINT/SIGTERM raised inside the block as arriving after ``output`` was published
    (so the tool does not claim that nothing was)."""
    try:
        yield
    except INTERRUPTS as exc:
        exc.published = output
        raise


def emit(text: str) -> None:
    """Print to stdout; a closed pipe (``| head``) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())



# --------------------------------------------------------------------------- one setting, several spellings


def add_aliased(group, *flags: str, **kwargs):
    """``group.add_argument(*flags, **kwargs)`` for one setting with several spellings
    (``--balance-epochs`` / ``--epochs``): the same spelling given again keeps its last value, as
    argparse does, but two spellings given two values refuse the command line naming both (exit 2):
    ``--balance-epochs 2 --epochs 5`` is never read as 5 epochs without a word. ``kwargs`` as
    ``add_argument`` takes them (``action`` a store-like action: ``store``, ``store_true``, ...)."""
    base = group._registry_get("action", kwargs.get("action", "store"), kwargs.get("action", "store"))
    kwargs["action"] = type("Aliased" + base.__name__, (_Aliased, base), {})
    return group.add_argument(*flags, **kwargs)


class _Aliased(argparse.Action):
    """Mixed into a store-like action by :func:`add_aliased`: remembers, per parse, which spelling
    set the value; a second spelling with another value is an ``argparse.ArgumentError``."""

    _given = None   # (namespace, option string, value) of this parse

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        given = self._given
        if given is not None and given[0] is namespace and given[1] != option_string and given[2] != value:
            raise argparse.ArgumentError(self, f"{given[1]} {_shown(given[2])} and {option_string} {_shown(value)} "
                                               "are two spellings of one setting with two values: give one")
        self._given = (namespace, option_string, value)
        super().__call__(parser, namespace, values, option_string)


def _shown(value) -> str:
    return "(set)" if value is True else "(unset)" if value is False else str(value)


# --------------------------------------------------------------------------- argparse types
# (``type=``: argparse names the flag and the value in its error, exit 2)


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def size_arg(text: str) -> int:
    """A positive byte count, as :func:`megatron_sft_idx._units.parse_size` reads it (``64M``, ``1.5GiB``)."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def percent(text: str) -> float:
    """A percentage 0..100 (``1``, ``0.5%``)."""
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage like 1 or 0.5%, got {text!r}") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be between 0 and 100, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A finite duration in seconds, more than 0 and at most :data:`~megatron_sft_idx._units.MAX_SECONDS`
    (``30``, ``0.5``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds like 30 or 0.5, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_SECONDS} seconds, got {text!r}")
    return value
