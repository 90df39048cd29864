"""The settings of a run, each defined once, composed into the two commands' configurations.

Given (one field per flag; the CLI fills them, the API takes them)::

    PackSettings      how sequences become packs and shards      preprocess-sft and repack-sft
    BalanceSettings   the balanced pack order written beside them preprocess-sft and repack-sft
    RunSettings       how the run executes, what it checks       preprocess-sft and repack-sft
    TokenizeSettings  how records become sequences               preprocess-sft
    Config            inputs (or a --mix file), output, --store + the groups   preprocess-sft
    RepackConfig      a store (or a --mix file), output or --plan-only + pack, balance, run   repack-sft

Resolved once per run, by the driver (:mod:`.driver`)::

    PlanSettings      what decides the packs, as the plan file records it
    PackJob           what the run writes: output, the given settings, the plan settings, pad id

Both configurations take the groups (``Config(inputs, prefix, pack=PackSettings(pack_size=8192))``)
or the flat names of their fields (``Config(inputs, prefix, pack_size=8192)``), as the flat
configurations before them did; a flat name given with its group overrides the group's field,
so ``dataclasses.replace(cfg, workers=4)`` works. Reading a flat name (``cfg.pack_size``) reads
it from its group. Nothing here runs anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..batching.cost import CostModel
from ..batching.layout import Topology
from ..errors import ShardError
from ..format import PAD_LAYOUTS
from ..packing import ALGORITHMS, DEFAULT_ALGORITHM, pad_multiple_for, padded_length, truncation_length
from ..storage.urls import local_only
from . import outputs
from .mixture import Mixture
from .records.encode import EncodeSettings
from .records.partitions import DEFAULT_MAX_RECORD_BYTES

#: Output names of the splits of ``--split`` (one to three weights), in order.
SPLIT_NAMES = ("train", "valid", "test")
#: What ``--overlong`` may say, and ``--truncated-turn-loss``.
OVERLONG = ("truncate", "drop", "error")
TRUNCATED_TURN_LOSS = ("keep", "drop")
_INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class PackSettings:
    """How sequences become packs and shards: the packing flags, shared by both commands."""

    pack_size: int = 4096
    algorithm: str = DEFAULT_ALGORITHM           # --packing-algorithm
    seed: int = 1234                             # the split, first_fit_shuffle, --verify-masks' sample
    overlong: str = "truncate"                   # truncate | drop | error
    truncated_turn_loss: str = "keep"            # keep | drop: loss on an assistant turn cut by truncation
    pad_seq_to_mult: int = 1
    pad_layout: str = "stored"                   # "runtime" pads for Megatron-Bridge (packing/padding.py)
    cp: int = 1
    tp: int = 1
    sp: bool = False
    fp8: Optional[str] = None                    # --fp8 RECIPE: pad for its block too (packing/padding.py)
    pad_id: Optional[int] = None                 # None: the tokenizer's (or the store's)
    split: Optional[Sequence[float]] = None      # weights of train[, valid[, test]]
    max_packs_per_shard: Optional[int] = None
    max_shard_bytes: Optional[int] = None
    skip_bad: bool = False                       # skip and count bad records instead of stopping

    @property
    def parallelism(self) -> Tuple[int, int, bool]:
        """``(cp, tp, sp)`` the padding is computed for."""
        return self.cp, self.tp, self.sp

    def pad_multiple(self) -> int:
        """``lcm(pad_seq_to_mult, the multiple for cp/tp/sp/fp8)``.

        Raises:
            ShardError: the multiple exceeds the pack size (or cp/tp below 1, an unknown FP8 recipe).
        """
        mult = int(np.lcm(max(1, self.pad_seq_to_mult), pad_multiple_for(self.cp, self.tp, self.sp, self.fp8)))
        if mult > self.pack_size:
            raise ShardError(f"padding multiple {mult} exceeds --pack-size {self.pack_size}", field="pack_size")
        return mult

    def plan_settings(self, vocab_size: Optional[int]) -> "PlanSettings":
        """The settings the plan records, for output tokens of a vocabulary of ``vocab_size``.

        Raises:
            ShardError: see :meth:`pad_multiple`.
        """
        return PlanSettings(
            pack_size=self.pack_size, pad_multiple=self.pad_multiple(), algorithm=self.algorithm, seed=self.seed,
            split=tuple(self.split) if self.split else None, overlong=self.overlong, skip_bad=self.skip_bad,
            max_packs_per_shard=self.max_packs_per_shard, max_shard_bytes=self.max_shard_bytes,
            itemsize=2 if (vocab_size or 0) and vocab_size <= 65536 else 4, pad_layout=self.pad_layout,
            truncated_turn_loss=self.truncated_turn_loss)


@dataclass(frozen=True)
class BalanceSettings:
    """The balanced pack order a run writes beside its shards (``--balance-for``; docs/BATCHING.md).

    Derived data: it never changes a shard's bytes, and a resumed run plans it again (the same
    bytes: it is a deterministic function of the packs and these settings).
    """

    balance_for: Optional[Tuple[int, int, int]] = None   # (DP, micro-batch, global batch); None: no order
    step_size: Optional[int] = None   # a mixture without balance_for: packs per step of its interleaved order
    cost_model: str = "llama3-8b"                         # a preset name, or "LINEAR,ATTENTION" FLOP coefficients
    balance_epochs: int = 1
    balance_seed: Optional[int] = None                    # None: --seed (it must be the training data seed)
    exchange_window: int = 1                              # > 1 CHANGES step membership
    balance_labels: bool = False                          # even out trained tokens per rank (and step) too

    def topology(self):
        """The :class:`~megatron_sft_idx.batching.Topology` of ``balance_for`` (None without it).

        Raises:
            ShardError: not a consistent DP, micro-batch, global batch.
        """

        if self.balance_for is None:
            return None if self.step_size is None else Topology(1, 1, self.step_size)
        return Topology(*self.balance_for)

    @property
    def algorithm(self) -> str:
        """How the order deals each step's packs: balanced to ranks (``--balance-for``), or not at all
        (``step_size``: steps alone, for any data-parallel size)."""
        return "kk" if self.balance_for is not None else "shuffle"

    def model(self, pad_multiple: int, pad_layout: str):
        """The cost model, pricing each sequence as the kernel sees it in ``pad_layout``.

        Raises:
            ShardError: an unknown preset, or coefficients that are not two numbers >= 0.
        """
        return CostModel.parse(self.cost_model, pad_multiple=pad_multiple, pad_layout=pad_layout)

    def to_dict(self) -> Optional[dict]:
        """What the run key digests (None without ``balance_for``: keys of unbalanced runs are unchanged)."""
        if self.balance_for is None and self.step_size is None:
            return None
        out = asdict(self)
        if self.step_size is None:   # (keys of runs with --balance-for alone are unchanged)
            del out["step_size"]
        if not self.balance_labels:   # (keys of runs planned before label balancing are unchanged)
            del out["balance_labels"]
        return out


@dataclass(frozen=True)
class RunSettings:
    """How a run executes and what it checks before publishing: never what the shards hold."""

    workers: int = 1
    engine: str = "local"                # local | ray
    ray_address: Optional[str] = None
    resume: bool = False
    overwrite: bool = False
    check: bool = False                  # the gate on every staged shard
    verify_masks: int = 0                # conversations checked against their source
    progress: object = True              # a _progress.Progress, or True (bar on a terminal, else log lines) / False
    staging_dir: Optional[str] = None    # an s3:// / msc:// output is built here, then uploaded


@dataclass(frozen=True, kw_only=True)
class TokenizeSettings(EncodeSettings):
    """How input records become the store's sequences (``preprocess-sft`` only): the encoding
    settings (:class:`~megatron_sft_idx.preprocess.records.encode.EncodeSettings`, defined once
    there: ``loss_on``, ``input_format``, the keys, the loss policies, ``vocab_size``, ...) and
    the run's own, below. :meth:`encode_options` makes the workers' options from them."""

    tokenizer: Optional[str] = None
    chat_template: Optional[str] = None  # a Jinja file, or a name of one of the tokenizer's templates
    batch_size: int = 256
    partition_bytes: Optional[int] = None   # None: auto (records.partitions.auto_partition_bytes)
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    skip_report: Optional[str] = None    # write every skipped record's file, line and reason here (JSON Lines)


def _compose(owner: str, groups: Dict[str, type], given: Dict[str, object], flat: Dict[str, object]) -> dict:
    """Each group of ``owner``: the one ``given`` (else its defaults) with the ``flat`` names of its
    fields set on top.

    Raises:
        TypeError: a flat name no group has (as a dataclass constructor raises).
    """
    flat = dict(flat)
    out = {}
    for attr, cls in groups.items():
        mine = {f.name: flat.pop(f.name) for f in dataclasses.fields(cls) if f.name in flat}
        base = given.get(attr)
        base = cls() if base is None else base
        out[attr] = dataclasses.replace(base, **mine) if mine else base
    if flat:
        raise TypeError(f"{owner}() got an unexpected keyword argument {next(iter(flat))!r}")
    return out


class _Grouped:
    """Flat reads of a composed configuration: ``cfg.pack_size`` is ``cfg.pack.pack_size``."""

    _GROUPS: Dict[str, type] = {}

    def __getattr__(self, name: str):
        if not name.startswith("_"):
            for attr in self._GROUPS:
                group = self.__dict__.get(attr)
                if group is not None and name in group.__dataclass_fields__:
                    return getattr(group, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _set(self, values: dict) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)


@dataclass(frozen=True, init=False)
class Config(_Grouped):
    """Everything ``preprocess-sft`` needs; the CLI fills it from its flags.

    Example::

        Config(["chat.jsonl"], "/data/sft/chat", tokenizer="tok/", pack_size=8192, workers=8)
        Config(["chat.jsonl"], "/data/sft/chat", tokenize=TokenizeSettings(tokenizer="tok/"),
               pack=PackSettings(pack_size=8192), run=RunSettings(workers=8))      # the same

    Raises:
        TypeError: a keyword that is no field of the configuration or of its groups.
    """

    inputs: Sequence[str]
    output_prefix: str
    store: Optional[str]                 # keep the sequence store here (for repack-sft)
    mix: Optional[str]                   # a mixture file (docs/PREPROCESSING.md "Mixtures"): its sources, not inputs
    tokenize: TokenizeSettings
    pack: PackSettings
    run: RunSettings
    balance: BalanceSettings

    _GROUPS = {"tokenize": TokenizeSettings, "pack": PackSettings, "run": RunSettings, "balance": BalanceSettings}

    def __init__(self, inputs: Sequence[str], output_prefix: str, *, store: Optional[str] = None,
                 mix: Optional[str] = None, tokenize: Optional[TokenizeSettings] = None,
                 pack: Optional[PackSettings] = None, run: Optional[RunSettings] = None,
                 balance: Optional[BalanceSettings] = None, **flat) -> None:
        groups = _compose("Config", self._GROUPS, {"tokenize": tokenize, "pack": pack, "run": run,
                                                   "balance": balance}, flat)
        _refuse_mix_with(mix, store=store, inputs=inputs)
        _refuse_remote(groups)
        self._set(dict(inputs=inputs, output_prefix=output_prefix, store=store, mix=mix, **groups))


@dataclass(frozen=True, init=False)
class RepackConfig(_Grouped):
    """Everything ``repack-sft`` needs: a complete sequence store, and an output prefix or a
    ``plan_only`` path (just the pack plan, for virtual packs).

    Raises:
        TypeError: a keyword that is no field of the configuration or of its groups.
    """

    store: Optional[str]                 # None with ``mix``
    output_prefix: Optional[str]
    plan_only: Optional[str]             # write only the pack plan here
    mix: Optional[str]                   # a mixture file: its sources' stores, packed together
    tokenizer: Optional[str]             # for --verify-masks (default: where the store found it)
    pack: PackSettings
    run: RunSettings
    balance: BalanceSettings

    _GROUPS = {"pack": PackSettings, "run": RunSettings, "balance": BalanceSettings}

    def __init__(self, store: Optional[str] = None, output_prefix: Optional[str] = None, *,
                 plan_only: Optional[str] = None, mix: Optional[str] = None, tokenizer: Optional[str] = None,
                 pack: Optional[PackSettings] = None, run: Optional[RunSettings] = None,
                 balance: Optional[BalanceSettings] = None, **flat) -> None:
        groups = _compose("RepackConfig", self._GROUPS, {"pack": pack, "run": run, "balance": balance}, flat)
        if local_only([("--plan-only", plan_only)]):
            raise ShardError("--plan-only writes a local file", path=plan_only, field="plan_only",
                             hint="give a local path (VirtualPackedDataset reads the plan and the store locally)")
        _refuse_mix_with(mix, store=store)
        _refuse_remote(groups)
        if store is None and mix is None:
            raise ShardError("repack-sft packs a store: give --store DIR|URL, or --mix FILE", field="store")
        self._set(dict(store=store, output_prefix=output_prefix, plan_only=plan_only, mix=mix, tokenizer=tokenizer,
                       **groups))


#: ``(group, field, flag)`` of the settings that name a local file or directory only: an
#: ``s3://`` / ``msc://`` URL is refused when a configuration is made, before any work.
LOCAL_ONLY = (("tokenize", "skip_report", "--skip-report"), ("tokenize", "chat_template", "--chat-template"),
              ("run", "staging_dir", "--staging-dir"))


def _refuse_remote(groups: Dict[str, object]) -> None:
    """Raises: ShardError: a :data:`LOCAL_ONLY` setting of ``groups`` is a URL (naming its flag)."""
    for group, name, flag in LOCAL_ONLY:
        value = getattr(groups.get(group), name, None)
        if local_only([(flag, value)]):
            raise ShardError(f"{flag} takes a local path, not a URL", path=value, field=f"{group}.{name}",
                             hint="give a local path (shard outputs, stores, inputs and tokenizers may be URLs)")


def _refuse_mix_with(mix: Optional[str], *, store: Optional[str] = None, inputs: Sequence[str] = ()) -> None:
    """A mixture names its sources' stores and inputs itself: ``--store`` and ``--input`` go with it.

    Raises:
        ShardError: ``mix`` given with a ``store`` or ``inputs``.
    """
    if mix is not None and (store or inputs):
        raise ShardError("--mix names each source's inputs and store itself: give it without "
                         + ("--store" if store else "--input"), path=mix, field="mix",
                         hint="move the inputs and the store into the mixture file's sources")


# --------------------------------------------------------------------------- resolved


@dataclass(frozen=True)
class PlanSettings:
    """Everything that decides the packs (and nothing that decides their bytes): what a plan
    file records (its ``settings``), and what a resumed plan is compared with."""

    pack_size: int
    pad_multiple: int
    algorithm: str
    seed: int
    split: Optional[Tuple[float, ...]]
    overlong: str                   # truncate | drop | error
    skip_bad: bool                  # under --overlong error: skip and count instead of stopping
    max_packs_per_shard: Optional[int]
    max_shard_bytes: Optional[int]
    itemsize: int                   # bytes per output token (for --max-shard-bytes)
    # absent from plans made before them: the given settings' defaults
    pad_layout: str = PackSettings.pad_layout                     # which length the pad multiple applies to
    truncated_turn_loss: str = PackSettings.truncated_turn_loss   # keep | drop: loss on a reply cut by truncation

    @property
    def truncate_to(self) -> int:
        return truncation_length(self.pack_size, self.pad_multiple, self.pad_layout)

    def padded(self, lengths) -> np.ndarray:
        """Each length as padded in a pack (int64): the one padding rule, in this layout."""
        return padded_length(lengths, self.pad_multiple, self.pad_layout)

    @property
    def split_names(self) -> Tuple[str, ...]:
        return SPLIT_NAMES[:len(self.split)] if self.split else ("all",)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["split"] = list(self.split) if self.split else None
        if self.truncated_turn_loss == PackSettings.truncated_turn_loss:  # plans (and run keys) as before the flag
            del out["truncated_turn_loss"]
        return out

    @classmethod
    def from_doc(cls, doc) -> "PlanSettings":
        """The settings a plan file records (``doc``: its ``settings`` object, a
        :class:`~megatron_sft_idx.jsondoc.Doc`), each of its type and range; a key absent from
        an older plan is its default here (the one place defaults are stated: the fields above).

        Raises:
            ShardError (the ``doc``'s error class): a value of the wrong type or out of range,
                naming the plan file and the field (``settings.pad_multiple``).
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}

        def kw(name: str) -> dict:
            default = fields[name].default
            return {} if default is dataclasses.MISSING else {"default": default}

        pack_size = doc.int("pack_size", lo=1, hi=_INT32_MAX)
        split = doc.list("split", none=True)
        if split is not None:
            if not 1 <= len(split) <= len(SPLIT_NAMES):
                raise doc.fail("has the wrong length", "split", expected=f"1..{len(SPLIT_NAMES)}", actual=len(split))
            for k, w in enumerate(split):
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
                    raise doc.fail("must be a weight > 0", f"split[{k}]", actual=w)
        return cls(
            pack_size=pack_size,
            pad_multiple=doc.int("pad_multiple", lo=1, hi=pack_size),
            algorithm=doc.str("algorithm", choices=ALGORITHMS),
            seed=doc.int("seed"),
            split=tuple(split) if split else None,
            overlong=doc.str("overlong", choices=OVERLONG),
            skip_bad=doc.bool("skip_bad"),
            max_packs_per_shard=doc.int("max_packs_per_shard", lo=1, none=True),
            max_shard_bytes=doc.int("max_shard_bytes", lo=1, none=True),
            itemsize=doc.int("itemsize", lo=1, hi=8),
            pad_layout=doc.str("pad_layout", choices=PAD_LAYOUTS, **kw("pad_layout")),
            truncated_turn_loss=doc.str("truncated_turn_loss", choices=TRUNCATED_TURN_LOSS,
                                        **kw("truncated_turn_loss")))


def check_pad_id(pad_id: Optional[int], vocab: Optional[int]) -> int:
    """``pad_id`` when it is a token of the vocabulary.

    Raises:
        ShardError: none, negative, or not below ``vocab``.
    """
    if pad_id is None or pad_id < 0 or (vocab is not None and pad_id >= vocab):
        raise ShardError("no usable pad id", field="pad_id", actual=pad_id,
                         hint="pass --pad-id in [0, vocab size) (the tokenizer has no pad or EOS token)")
    return pad_id


@dataclass(frozen=True)
class PackJob:
    """What one run writes: the settings as given, and what was resolved from them once."""

    output_prefix: str                   # "" for --plan-only
    pack: PackSettings
    run: RunSettings
    settings: PlanSettings               # resolved from ``pack`` (pad multiple, token width)
    pad_id: int                          # resolved: --pad-id, else the tokenizer's (or the store's)
    vocab_size: Optional[int]
    tokenizer_path: Optional[str] = None  # for --verify-masks
    balance: BalanceSettings = BalanceSettings()
    mixture: Optional[Mixture] = None    # --mix: the packs hold its sources at their shares

    @classmethod
    def resolve(cls, output_prefix: Optional[str], pack: PackSettings, run: RunSettings,
                vocab_size: Optional[int], default_pad_id: Optional[int],
                tokenizer_path: Optional[str] = None, balance: Optional[BalanceSettings] = None,
                mixture: Optional[Mixture] = None) -> "PackJob":
        """Resolve the pad id (``pack.pad_id``, else ``default_pad_id``) and the plan settings.

        Raises:
            ShardError: no usable pad id; a padding multiple above the pack size.
        """
        pad_id = check_pad_id(pack.pad_id if pack.pad_id is not None else default_pad_id, vocab_size)
        balance = balance or BalanceSettings()
        balance.topology()   # (refused now, not after the shards are written)
        balance.model(1, "stored")
        return cls(output_prefix or "", pack, run, pack.plan_settings(vocab_size), pad_id, vocab_size,
                   tokenizer_path, balance, mixture)

    @property
    def parallelism(self) -> Tuple[int, int, bool]:
        return self.pack.parallelism

    @property
    def fp8(self) -> Optional[str]:
        """The FP8 recipe the padding is for (None: none; absent from keys and metadata then)."""
        return self.pack.fp8

    @property
    def bases(self) -> List[str]:
        """The output prefix of each split (before any shard number)."""
        return [outputs.split_prefix(self.output_prefix, s, bool(self.settings.split))
                for s in self.settings.split_names]


__all__ = ["PackSettings", "BalanceSettings", "RunSettings", "TokenizeSettings", "Config", "RepackConfig", "PlanSettings",
           "PackJob", "check_pad_id", "SPLIT_NAMES", "OVERLONG", "TRUNCATED_TURN_LOSS"]
