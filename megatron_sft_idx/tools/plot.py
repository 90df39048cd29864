"""The summary's histograms as one PNG (matplotlib, optional extra ``[tools]``)."""

from __future__ import annotations

import os
from typing import Any, Dict

from .._atomic import write_file_atomically
from .._extras import require_extra

_PANELS = (("sequences_per_pack", "sequences per pack", "packs", "int"),
           ("sequence_length", "sequence length (tokens)", "sequences", "int"),
           ("pack_fill", "pack fill (packed length / pack size)", "packs", "pct"))


def _labels(edges, kind):
    if kind == "pct":
        return [f"{a:.0%}–{b:.0%}" for a, b in zip(edges[:-1], edges[1:])]
    return [f"{int(a):,}" if int(b) - int(a) == 1 else f"{int(a):,}–{int(b) - 1:,}"
            for a, b in zip(edges[:-1], edges[1:])]


def plot_summary(summary: Dict[str, Any], path: str) -> str:
    """Draw the three histograms of ``summary`` (from :func:`.inspect.summarize`) into ``path``.

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    require_extra("tools", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2), constrained_layout=True)
    for ax, (key, title, unit, kind) in zip(axes, _PANELS):
        hist = summary["histograms"][key]
        labels = _labels(hist["edges"], kind)
        bars = ax.bar(range(len(labels)), hist["counts"], color="#3b75af", edgecolor="white")
        ax.bar_label(bars, labels=[f"{c:,}" if c else "" for c in hist["counts"]], fontsize=8, padding=2)
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=9)
        ax.set_title(title, fontsize=12)
        ax.set_ylabel(unit)
        ax.margins(y=0.12)
        ax.spines[["top", "right"]].set_visible(False)
    name = os.path.basename(summary["shards"][0]) + (f" + {len(summary['shards']) - 1} more"
                                                     if len(summary["shards"]) > 1 else "")
    fig.suptitle(f"{name}: {summary['packs']:,} packs, {summary['sequences']:,} sequences, "
                 f"{summary['tokens']:,} tokens ({summary['trainable_share']:.1%} trainable), "
                 f"packing efficiency {summary['packing_efficiency']:.1%}", fontsize=13)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_file_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return path
