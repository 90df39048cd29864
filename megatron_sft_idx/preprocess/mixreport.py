"""What a mixture will train, before training: the report in the summary, as text, and as a plot.

From a mixture plan's metadata alone (:mod:`.mixplan` records, per split and source, one epoch of
the source and what the packs hold of it; and the source's split packed alone), per split and
source:

* ``target_share`` / ``share``: the target and the realised share in the mixture's unit (for the
  ``epochs`` unit, of sequences), and ``trained_share`` in trained tokens;
* ``tokens``, ``trained_tokens``, ``sequences`` (a sequence taken twice counts twice) and
  ``epochs`` (the realised amount over one epoch's);
* ``data_path``: the same numbers for Megatron's ``data_path`` blend of per-source shards --
  each source packed alone, sampled by the mixture's weights as sample weights (for ``epochs``,
  weight times its packs, which gives those epochs), as many samples as the mixture has packs:
  source ``k`` gets ``N * w_k / sum(w)`` packs of ``trained_tokens_k / packs_k`` trained tokens
  on average. That is what the same weights do when they weigh packs, on the user's own data.

``windows`` (with a topology: ``--balance-for``) is added by the balanced order's planner
(:func:`window_deviation`): the worst deviation from the split's shares over every window of K
steps, for the interleaved order and for the adapters' shuffle.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from .mixing import shares, target_shares


def mixture_report(plan: dict) -> dict:
    """The report of a mixture plan (its metadata, or its receipt: module doc)."""
    mixture = plan["mixture"]
    unit = mixture["unit"]
    weights = [s["weight"] for s in mixture["sources"]]
    out = {"unit": unit, "total": mixture["total"], "window_steps": mixture["window_steps"],
           "stores": [{"name": s["name"], "store_id": s["store_id"]} for s in plan["stores"]], "splits": {}}
    for split in plan["splits"]:
        out["splits"][split["name"]] = _split_report(unit, weights, split)
    return out


def _split_report(unit: str, weights: Sequence[float], split: dict) -> dict:
    src = split["sources"]
    amounts = np.array([s["amount"] for s in src], dtype=np.float64)
    epoch = np.array([s["epoch_amount"] for s in src], dtype=np.float64)
    trained = np.array([s["trained_tokens"] for s in src], dtype=np.float64)
    epochs = np.array([s["target_epochs"] for s in src], dtype=np.float64)
    target = target_shares(unit, weights, epochs, epoch)
    share, trained_share = shares(amounts), shares(trained)
    blend = _data_path(unit, weights, src, split["packs"])
    rows = []
    for k, s in enumerate(src):
        rows.append({"name": s["name"], "target_share": round(float(target[k]), 6), "share": round(float(share[k]), 6),
                     "trained_share": round(float(trained_share[k]), 6), "tokens": s["tokens"],
                     "trained_tokens": s["trained_tokens"], "sequences": s["sequences"],
                     "target_epochs": round(float(epochs[k]), 6),
                     "epochs": round(float(amounts[k] / epoch[k]), 6) if epoch[k] else 0.0,
                     "data_path": blend[k]})
    return {"packs": split["packs"], "sources": rows,
            "max_share_deviation": round(float(np.max(np.abs(share - target))), 6),
            "data_path_max_share_deviation": round(float(np.max(np.abs(
                np.array([b["share"] for b in blend]) - target))), 6)}


def _data_path(unit: str, weights: Sequence[float], src: List[dict], packs: int) -> List[dict]:
    """Each source under a ``data_path`` blend of per-source shards (module doc)."""
    alone = [s["packed_alone"] for s in src]
    w = np.asarray(weights, dtype=np.float64)
    if unit == "epochs":
        w = w * np.array([a["packs"] for a in alone], dtype=np.float64)
    samples = packs * w / w.sum()
    per_pack = {key: np.array([a[key] / a["packs"] if a["packs"] else 0.0 for a in alone])
                for key in ("tokens", "trained_tokens", "amount")}
    amount, trained = samples * per_pack["amount"], samples * per_pack["trained_tokens"]
    share, trained_share = shares(amount), shares(trained)
    return [{"weight": float(weights[k]), "packs_alone": alone[k]["packs"], "samples": round(float(samples[k]), 3),
             "epochs": round(float(samples[k] / alone[k]["packs"]), 6) if alone[k]["packs"] else 0.0,
             "share": round(float(share[k]), 6), "trained_share": round(float(trained_share[k]), 6),
             "tokens": int(round(samples[k] * per_pack["tokens"][k])),
             "trained_tokens": int(round(trained[k]))} for k in range(len(src))]


def window_deviation(order: np.ndarray, measures: np.ndarray, target: np.ndarray, steps_per_window: int,
                     global_batch_size: int) -> dict:
    """The worst deviation of a window's shares from ``target`` over every window of
    ``steps_per_window`` consecutive complete steps of the packs ``order`` serves.

    Args:
        order: the pack served at each position (int64, several epochs concatenated).
        measures: int[P, S]: each pack's measure of each source (the plan's ``pack_measures``).
        target: the shares a window should hold (float64[S]).

    Returns:
        ``{"windows": count, "max": worst |share - target| of any source in any window,
        "mean": mean over windows of each window's worst}`` (zeros when no window fits).
    """
    steps = order.size // global_batch_size
    if steps < steps_per_window or measures.size == 0:
        return {"windows": 0, "max": 0.0, "mean": 0.0}
    served = measures[order[:steps * global_batch_size]].astype(np.int64)
    per_step = served.reshape(steps, global_batch_size, -1).sum(axis=1)
    cum = np.concatenate([np.zeros((1, per_step.shape[1]), np.int64), np.cumsum(per_step, axis=0)])
    window = cum[steps_per_window:] - cum[:-steps_per_window]
    totals = window.sum(axis=1, keepdims=True)
    got = np.divide(window, totals, out=np.zeros(window.shape), where=totals > 0)
    worst = np.abs(got - np.asarray(target)[None, :]).max(axis=1)
    return {"windows": int(worst.size), "max": round(float(worst.max()), 6), "mean": round(float(worst.mean()), 6)}


def format_mixture(report: dict) -> List[str]:
    """The report as summary lines, a table per split."""
    lines = [f"mixture by {report['unit'].replace('_', ' ')}"
             + (f", total {report['total']:,}" if report.get("total") else "")]
    for name, split in report["splits"].items():
        lines.append(f"  split {name}: {split['packs']:,} packs; worst share deviation {_pct(split['max_share_deviation'])}"
                     f" (data_path blend: {_pct(split['data_path_max_share_deviation'])})")
        lines.append(f"    {'source':<16} {'target':>8} {'share':>8} {'trained':>8} {'epochs':>8} {'sequences':>10} "
                     f"{'trained tokens':>15} | {'data_path share':>15} {'trained':>8} {'epochs':>8}")
        for s in split["sources"]:
            b = s["data_path"]
            lines.append(f"    {s['name'][:16]:<16} {_pct(s['target_share']):>8} {_pct(s['share']):>8} "
                         f"{_pct(s['trained_share']):>8} {s['epochs']:>8.3f} {s['sequences']:>10,} "
                         f"{s['trained_tokens']:>15,} | {_pct(b['share']):>15} {_pct(b['trained_share']):>8} "
                         f"{b['epochs']:>8.3f}")
        windows = split.get("windows")
        if windows and windows["interleaved"].get("windows"):
            lines.append(f"    over every window of {report['window_steps']} steps ({windows['topology']}): worst share "
                         f"deviation {_pct(windows['interleaved']['max'])} interleaved, "
                         f"{_pct(windows['shuffle']['max'])} shuffled")
        elif windows:
            lines.append(f"    fewer steps than one window of {report['window_steps']} ({windows['topology']}): "
                         "no window to report")
    return lines


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def plot_mixture(report: dict, path: str) -> None:
    """Bars per split and source: the target share, the mixture's trained-token share and the
    ``data_path`` blend's, written to ``path`` (matplotlib: the ``tools`` extra).

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    from .._extras import require_extra

    require_extra("tools", "matplotlib")
    import matplotlib   # (an optional dependency, loaded only for a plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(report["splits"].items())
    fig, axes = plt.subplots(1, len(splits), figsize=(6 * len(splits), 4), squeeze=False)
    for ax, (name, split) in zip(axes[0], splits):
        names = [s["name"] for s in split["sources"]]
        x = np.arange(len(names))
        bars = (("target", [s["target_share"] for s in split["sources"]]),
                ("mixture (trained tokens)", [s["trained_share"] for s in split["sources"]]),
                ("data_path blend (trained tokens)", [s["data_path"]["trained_share"] for s in split["sources"]]))
        for k, (label, values) in enumerate(bars):
            ax.bar(x + (k - 1) * 0.27, values, 0.27, label=label)
        ax.set_xticks(x, names)
        ax.set_title(f"split {name}: share by trained tokens")
        ax.set_ylabel("share")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def windows_target(split_report: dict) -> np.ndarray:
    """The shares a window should hold: the split's realised shares in the unit."""
    return np.array([s["share"] for s in split_report["sources"]], dtype=np.float64)


__all__ = ["mixture_report", "window_deviation", "format_mixture", "plot_mixture", "windows_target"]
