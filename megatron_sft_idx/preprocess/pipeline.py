"""Deprecated alias: the pipeline now lives in :mod:`.driver` (stage order, resume, commit),
:mod:`.config` (the settings) and :mod:`.tokenize` (the inputs and the store). The names
below keep working."""

from .config import Config, PackJob, PlanSettings
from .driver import prove_inputs, run
from .plan import plan_shards, split_conversations
from .tokenize import Inputs, resolve_inputs

__all__ = ["Config", "run", "PackJob", "PlanSettings", "Inputs", "resolve_inputs", "prove_inputs", "plan_shards",
           "split_conversations"]
