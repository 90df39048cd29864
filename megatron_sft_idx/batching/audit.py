"""What each trainer's loss normalisation does to a planned order: every token's effective
weight against the exact token mean of its step (``plan-batches --audit``, docs/BATCHING.md).

The objective a user means is the token mean over each optimizer step: every trained token of
the step weighs ``1 / N`` (``N``, the step's trained tokens under the trainer's own positions,
:mod:`.trained`). A trainer whose loss divides by something else gives a token the weight ``w``;
its *deviation* is ``w * N - 1`` (0: exact; -0.5: half the weight it should have). The rules,
each restated from the code named (the installed packages where they install, else the
repository at the commit named; never copied):

* ``megatron-lm:per-token`` -- ``calculate_per_token_loss=True``: Megatron-LM's ``loss_func``
  (``pretrain_gpt.py``) returns the micro-batch's loss *sum* and token count; megatron-core's
  schedule (``forward_step_calc_loss``) leaves the sum as is, DDP does not scale gradients, and
  ``finalize_model_grads`` divides them by the token count all-reduced over DP x CP:
  ``w = 1 / N``, exact (megatron-core 0.16.1 and 0.19.2; Megatron-LM ``d98e8a64``).
* ``megatron-lm:per-micro-batch`` -- the default (``False``): the schedule divides each
  micro-batch's sum by its own count (clamped to 1) and by the number of micro-batches ``M``;
  DDP scales gradients by ``1 / (DP * CP)``. Under context parallelism each CP rank divides by the
  trained tokens *of its own shard* of the micro-batch (Megatron-LM #7513, open): a token on CP
  rank ``c`` of micro-batch ``m`` of rank ``d`` weighs ``1 / (DP * CP * M * n[d, m, c])``. The
  split is Transformer Engine's ``thd_get_partitioned_indices`` (``d0067d0d``) on Megatron-LM's
  ``cu_seqlens`` (:func:`~.trained.cp_sequence_counts`, layout ``megatron``).
* ``megatron-bridge:default`` -- Megatron-Bridge 0.6.2: ``masked_next_token_loss`` returns the
  same sum and count, megatron-core's ``TransformerConfig.calculate_per_token_loss`` defaults to
  False and Bridge's Llama recipes keep it (Bridge asserts it True for CP > 1 only with its own
  SFT dataset configs, not with a custom ``DatasetProvider`` such as ours): the per-micro-batch
  rule over Bridge's positions (0.6: EOS inputs zeroed, :data:`~.trained.BRIDGE_06`, with the
  EOS id; else the stored mask) and Bridge's CP split of runtime segments (layout ``bridge``).
* ``nemo-rl:token`` -- NeMo-RL (``7ea279ab``): ``NLLLossFn`` is token-level; each micro-batch's
  sum is divided by ``global_valid_toks``, the step's tokens all-reduced over DP before the CP
  split: ``w = 1 / (N + 1e-8)``, exact.
* ``nemo-rl:sequence`` -- NeMo-RL's sequence-level losses (``LossType.SEQUENCE_LEVEL``): each
  sequence's masked mean, summed, divided by ``global_valid_seqs`` (every sequence of the
  step: ``sample_mask`` is 1 in SFT): ``w = 1 / (n_s * S)``. A different objective by design.
* ``transformers:num_items_in_batch`` -- TRL 1.16 ``SFTTrainer`` and transformers 5.25
  ``Trainer`` defaults: ``num_items_in_batch`` counts ``labels[..., 1:] != -100`` over the
  gradient-accumulation micro-batches, gathered over processes
  (``average_tokens_across_devices=True``), the loss multiplied by the process count, DDP
  averaging: ``w = 1 / N``, exact.
* ``transformers:per-device`` -- ``average_tokens_across_devices=False``: each rank divides by
  its own count over its micro-batches, DDP averages ranks: ``w = 1 / (DP * n[d])``.
* ``transformers:per-micro-batch`` -- a model that takes no loss kwargs: the model's mean per
  micro-batch, divided by the accumulation steps: ``w = 1 / (DP * M * n[d, m])``; a micro-batch
  with no label makes the mean NaN (counted as ``empty``).

The audit replays these on the planned steps of an order; the tests hold each replay against
the trainer's own loss function's gradient on a tiny model where it runs on a CPU
(``tests/batching/test_batching_audit.py``, ``tests/compat/test_loss_rules.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ..errors import ShardError
from .layout import Topology
from .trained import BRIDGE_06, LAYOUT_BRIDGE, LAYOUT_MEGATRON, STORED, TrainedCounts, cp_sequence_counts, step_table

__all__ = ["AUDIT_RULES", "AuditRule", "RuleAudit", "audit_stream", "audit_order", "format_audit", "group_table",
           "group_weights", "rule_named"]


@dataclass(frozen=True)
class AuditRule:
    """One trainer's normalisation: which positions it counts (``count``: ``"megatron"``,
    ``"bridge"`` or ``"labels"``), how it groups a step's tokens (``groups``) and its source."""

    name: str
    count: str
    groups: str      # step | microbatch-cp | rank | microbatch | sequence
    source: str


AUDIT_RULES = (
    AuditRule("megatron-lm:per-token", "megatron", "step",
              "calculate_per_token_loss=True (Megatron-LM d98e8a64, megatron-core 0.16.1/0.19.2)"),
    AuditRule("megatron-lm:per-micro-batch", "megatron", "microbatch-cp",
              "calculate_per_token_loss=False, the default (megatron-core schedules + DDP 1/(DP*CP))"),
    AuditRule("megatron-bridge:default", "bridge", "microbatch-cp",
              "Megatron-Bridge 0.6.2 masked_next_token_loss, calculate_per_token_loss=False"),
    AuditRule("nemo-rl:token", "labels", "step", "NeMo-RL 7ea279ab NLLLossFn, global_valid_toks"),
    AuditRule("nemo-rl:sequence", "labels", "sequence", "NeMo-RL 7ea279ab sequence-level, global_valid_seqs"),
    AuditRule("transformers:num_items_in_batch", "labels", "step",
              "TRL 1.16 / transformers 5.25 defaults, average_tokens_across_devices=True"),
    AuditRule("transformers:per-device", "labels", "rank", "transformers, average_tokens_across_devices=False"),
    AuditRule("transformers:per-micro-batch", "labels", "microbatch",
              "transformers, a model without loss kwargs (mean per micro-batch / accumulation steps)"),
)


def rule_named(name: str) -> AuditRule:
    """The rule of that name (:data:`AUDIT_RULES`).

    Raises:
        ShardError: no such rule.
    """
    for rule in AUDIT_RULES:
        if rule.name == name:
            return rule
    raise ShardError(f"no audit rule {name!r}", field="rule", expected=[r.name for r in AUDIT_RULES], actual=name)


@dataclass
class RuleAudit:
    """One rule on one order. Per complete step (arrays): ``tokens`` (``N``), ``mean_dev`` (the
    token mean of ``|w * N - 1|``), ``max_dev`` (its max over the step's tokens), ``scale`` (the
    sum of the weights: 1 for an exact rule), ``empty`` (groups with no trained token)."""

    rule: AuditRule
    first_step: int
    tokens: np.ndarray
    mean_dev: np.ndarray
    max_dev: np.ndarray
    scale: np.ndarray
    empty: np.ndarray
    note: Optional[str] = None

    def summary(self) -> dict:
        """Over steps: the mean of ``mean_dev``, the max of ``max_dev``, the worst step (largest
        ``mean_dev``) with its figures, the scale's range and the empty groups (JSON-ready)."""
        if self.note is not None or self.tokens.size == 0:
            return {"rule": self.rule.name, "steps": int(self.tokens.size), "note": self.note}
        worst = int(np.argmax(self.mean_dev))
        return {"rule": self.rule.name, "steps": int(self.tokens.size), "mean_dev": float(self.mean_dev.mean()),
                "max_dev": float(self.max_dev.max()), "worst_step": self.first_step + worst,
                "worst_mean_dev": float(self.mean_dev[worst]), "worst_max_dev": float(self.max_dev[worst]),
                "worst_tokens": int(self.tokens[worst]), "scale_min": float(self.scale.min()),
                "scale_max": float(self.scale.max()), "empty_groups": int(self.empty.sum()),
                "source": self.rule.source}


def group_table(rule: AuditRule, table: np.ndarray) -> np.ndarray:
    """``[steps, D]``: the trained tokens of each of the ``D`` groups ``rule`` normalises by, from
    a step table ``[steps, micro-batches, dp, cp]`` (:func:`~.trained.step_table` per CP rank)."""
    steps, micro, dp, cp = table.shape
    if rule.groups == "step":
        return table.reshape(steps, micro * dp * cp).sum(axis=1, keepdims=True)
    if rule.groups == "rank":
        return table.sum(axis=(1, 3))
    if rule.groups == "microbatch":
        return table.sum(axis=3).reshape(steps, micro * dp)
    if rule.groups == "microbatch-cp":
        return table.reshape(steps, micro * dp * cp)
    raise ShardError(f"rule {rule.name!r} weighs sequences, not groups of a step table", field="rule")


def group_weights(rule: AuditRule, groups: np.ndarray) -> np.ndarray:
    """The weight of every trained token of each group (``groups``: :func:`group_table`'s
    ``[steps, D]``; for ``nemo-rl:sequence``, each step's sequences ``[steps, S]``), as the rule's
    trainer gives it (module doc): megatron-core clamps a count to 1, NeMo-RL adds 1e-8,
    transformers' per-micro-batch mean divides by the count itself (a group of none: NaN)."""
    n = np.asarray(groups, dtype=np.float64)
    d = float(n.shape[-1])
    with np.errstate(divide="ignore", invalid="ignore"):
        if rule.name.startswith("nemo-rl:sequence"):
            return 1.0 / ((n + 1e-8) * (d + 1e-8))
        if rule.name.startswith("nemo-rl"):
            return 1.0 / (n + 1e-8)
        if rule.name.startswith("transformers:per-micro-batch"):
            return np.where(n > 0, 1.0 / (d * n), np.nan)
        return 1.0 / (d * np.maximum(n, 1.0))


def _grouped(rule: AuditRule, table: np.ndarray, first_step: int) -> RuleAudit:
    """A rule that weighs the ``n_g`` tokens of each of ``D`` groups alike (``table``: ``[steps, D]``)."""
    table = table.astype(np.float64)
    steps = table.shape[0]
    total = table.sum(axis=1)
    live = table > 0
    dev = np.where(live, np.abs(group_weights(rule, table) * total[:, None] - 1.0), 0.0)
    mean_dev = np.divide((dev * table).sum(axis=1), total, out=np.zeros(steps), where=total > 0)
    max_dev = dev.max(axis=1) if table.shape[1] else np.zeros(steps)
    scale = np.where(live, group_weights(rule, table) * table, 0.0).sum(axis=1)
    return RuleAudit(rule, first_step, total.astype(np.int64), mean_dev, max_dev, scale,
                     (~live).sum(axis=1).astype(np.int64))


def _sequence_level(rule: AuditRule, stream: np.ndarray, counts: TrainedCounts, seq_values: np.ndarray,
                    topology: Topology, start: int) -> RuleAudit:
    """NeMo-RL's sequence level: ``w = 1 / (n_s * S)`` over the ``S`` sequences of each step."""
    gbs = topology.global_batch_size
    first = -(-start // gbs)
    steps = max(0, (start + stream.shape[0]) // gbs - first)
    lo = first * gbs - start
    packs = stream[lo:lo + steps * gbs]
    per_pack = np.diff(counts.sequence_offsets)[packs]
    firsts = counts.sequence_offsets[packs]
    ends = np.cumsum(per_pack)
    idx = np.repeat(firsts - (ends - per_pack), per_pack) + np.arange(int(ends[-1]) if ends.size else 0)
    n = seq_values[idx].astype(np.float64)
    step = np.repeat(np.arange(steps).repeat(gbs), per_pack)
    seqs = np.bincount(step, minlength=steps).astype(np.float64)
    total = np.bincount(step, weights=n, minlength=steps)
    share = np.divide(total, seqs, out=np.zeros(steps), where=seqs > 0)[step]
    dev = np.abs(np.divide(share, n, out=np.ones_like(n), where=n > 0) - 1.0)
    mean_dev = np.divide(np.bincount(step, weights=np.abs(share - n) * (n > 0), minlength=steps), total,
                         out=np.zeros(steps), where=total > 0)
    max_dev = np.zeros(steps)
    np.maximum.at(max_dev, step, np.where(n > 0, dev, 0.0))
    live = np.bincount(step, weights=(n > 0).astype(np.float64), minlength=steps)
    scale = np.divide(live, seqs, out=np.zeros(steps), where=seqs > 0)
    return RuleAudit(rule, first, total.astype(np.int64), mean_dev, max_dev, scale, (seqs - live).astype(np.int64))


def audit_stream(stream, topology: Topology, counts: TrainedCounts, *, start: int = 0, cp: int = 1,
                 cp_counts: Optional[Dict[str, np.ndarray]] = None, bridge_rule: str = STORED,
                 rules=AUDIT_RULES) -> List[RuleAudit]:
    """Every rule on a sample stream (pack ids at global positions ``start, start + 1, ...``).

    ``cp_counts``: ``{"megatron": [num_sequences, cp], "bridge": [...]}`` per-sequence counts per
    CP rank (:func:`~.trained.cp_sequence_counts`; needed for ``cp > 1``; a layout missing is
    reported as a note on its rules); ``bridge_rule``: the positions Bridge counts
    (:data:`~.trained.BRIDGE_06` with an EOS id).
    """
    stream = np.asarray(stream, dtype=np.int64)
    first = -(-int(start) // topology.global_batch_size)
    out = []
    for rule in rules:
        seq_rule = bridge_rule if rule.count == "bridge" else STORED
        if rule.groups == "sequence":
            out.append(_sequence_level(rule, stream, counts, counts.require(seq_rule), topology, int(start)))
            continue
        if rule.groups == "microbatch-cp" and cp > 1:
            per_seq = (cp_counts or {}).get(LAYOUT_BRIDGE if rule.count == "bridge" else LAYOUT_MEGATRON)
            if per_seq is None or isinstance(per_seq, str):
                out.append(RuleAudit(rule, first, *(np.empty(0),) * 5,
                                     note=per_seq or "no context-parallel split for this trainer's layout"))
                continue
            cum = np.vstack((np.zeros((1, cp), np.int64), np.cumsum(per_seq, axis=0, dtype=np.int64)))
            pack_cp = cum[counts.sequence_offsets[1:]] - cum[counts.sequence_offsets[:-1]]
            table = np.stack([step_table(stream, pack_cp[:, c], topology, start) for c in range(cp)], axis=-1)
        else:
            table = step_table(stream, counts.pack(seq_rule), topology, start)[..., None]
        flat = group_table(rule, table)
        out.append(_grouped(rule, flat, first))
    return out


def audit_order(order, counts: TrainedCounts, *, topology: Optional[Topology] = None, cp: int = 1,
                source=None, seq_length: Optional[int] = None) -> List[RuleAudit]:
    """:func:`audit_stream` over every planned epoch of ``order``, sliced for ``topology``
    (default: the planned one). With ``cp > 1`` the per-CP-rank counts are read from ``source``
    (the data), for each trainer's layout; a layout the data cannot be split in becomes a note.

    Raises:
        ShardError: ``cp > 1`` without ``source``; counts of another number of packs; no layout splits.
    """
    topology = order.topology if topology is None else topology
    if counts.num_packs != order.num_packs:
        raise ShardError("the trained-token counts are of another number of packs than the order", field="trained",
                         expected=order.num_packs, actual=counts.num_packs, hint="audit the order with its own data")
    bridge_rule = BRIDGE_06 if BRIDGE_06 in counts.sequence else STORED
    cp_counts = None
    if cp > 1:
        if source is None:
            raise ShardError("a context-parallel audit reads the data's masks: give the source", field="source")
        cp_counts, errors = {}, []
        for layout, rule in ((LAYOUT_MEGATRON, STORED), (LAYOUT_BRIDGE, bridge_rule)):
            try:
                cp_counts[layout] = cp_sequence_counts(source, cp, layout=layout, rule=rule, eos_id=counts.eos_id,
                                                       seq_length=seq_length if layout == LAYOUT_MEGATRON else None)
            except ShardError as exc:
                cp_counts[layout] = f"not trainable with CP {cp}: {exc.message}"
                errors.append(exc)
        if len(errors) == 2:
            raise errors[0]
    start = order.first_epoch * order.num_packs
    return audit_stream(order.permutations.reshape(-1), topology, counts, start=start, cp=cp, cp_counts=cp_counts,
                        bridge_rule=bridge_rule)


def format_audit(results: Dict[str, List[RuleAudit]]) -> str:
    """A text table: one row per rule, per named order its mean and max deviation (%), then each
    order's worst step per rule that deviates."""
    names = list(results)
    head = ["rule"] + [f"{n} {k}" for n in names for k in ("mean %", "max %")]
    rows, notes = [], []
    for i, rule in enumerate(AUDIT_RULES):
        row = [rule.name]
        for name in names:
            s = results[name][i].summary()
            if s.get("note") or not s.get("steps"):
                row += ["n/a", "n/a"]
                if s.get("note") and name == names[0]:
                    notes.append(f"{rule.name}: {s['note']}")
                continue
            row += [f"{100 * s['mean_dev']:.2f}", f"{100 * s['max_dev']:.1f}"]
            if s["max_dev"] > 1e-9:
                notes.append(f"{name}, {rule.name}: worst step {s['worst_step']:,} ({s['worst_tokens']:,} tokens): "
                             f"mean {100 * s['worst_mean_dev']:.2f} %, max {100 * s['worst_max_dev']:.1f} %; "
                             f"weights sum to {s['scale_min']:.3f}..{s['scale_max']:.3f}"
                             + (f"; {s['empty_groups']:,} empty groups" if s["empty_groups"] else ""))
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).rjust(w) if j else str(x).ljust(w) for j, (x, w) in enumerate(zip(row, widths)))
             for row in [head, *rows]]
    return "\n".join(lines + notes)
