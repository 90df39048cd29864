"""What the three tool command lines share: exit codes, error reporting, signals, output.

Exit status: 0 success; 1 the tool refused or failed on readable input (incompatible
shards, a corrupt shard, an output that failed the gate); 2 usage error or input it
cannot use at all (no such shard, an existing output; a missing optional dependency is
:class:`~megatron_sft_idx._extras.MissingExtraError`, which :mod:`megatron_sft_idx._console`
turns into one line naming the extra). A user's mistake prints one line naming the file and
what to do, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Callable, Iterator, List, Optional, Union

from .._signals import INTERRUPTS, exit_code, signal_name, signals_raise
from ..errors import ShardError, ShardExistsError, ShardNotFoundError

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
_USAGE_ERRORS = (ShardNotFoundError, ShardExistsError)


def parse(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> Union[argparse.Namespace, int]:
    """Parsed arguments, or the exit code when argparse exited (``--help``: 0, a bad flag: 2)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_USAGE


def usage_error(parser: argparse.ArgumentParser, message: str) -> int:
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


from .._units import human_bytes  # noqa: E402,F401  (one formatter for every summary)
