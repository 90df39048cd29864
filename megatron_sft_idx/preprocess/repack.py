"""Deprecated alias: ``repack-sft`` now lives in :mod:`.cli` (the CLI), :mod:`.config` (its
configuration) and :mod:`.driver` (the run). The names below keep working."""

from .cli import REPACK_DESCRIPTION as DESCRIPTION, REPACK_PROG as PROG, build_repack_parser as build_parser
from .cli import repack_main as main
from .config import RepackConfig
from .driver import plan_only, repack
from .summary import format_plan_summary

__all__ = ["RepackConfig", "repack", "plan_only", "build_parser", "main", "format_plan_summary", "PROG",
           "DESCRIPTION"]
