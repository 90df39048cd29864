"""Deprecated: the pipeline lives in :mod:`.driver` (stage order, resume, commit),
:mod:`.config` (the settings), :mod:`.plan` and :mod:`.tokenize` (the inputs and the store).
Importing this module warns once (``FutureWarning``, :mod:`megatron_sft_idx._moved`); the names
below keep working until the version that table names."""

from .._moved import warn_moved

warn_moved(__name__)

from .config import Config, PackJob, PlanSettings  # noqa: E402
from .driver import prove_inputs, run  # noqa: E402
from .plan import plan_shards, split_conversations  # noqa: E402
from .tokenize import Inputs, resolve_inputs  # noqa: E402

__all__ = ["Config", "run", "PackJob", "PlanSettings", "Inputs", "resolve_inputs", "prove_inputs", "plan_shards",
           "split_conversations"]
