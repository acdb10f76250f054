"""Figures for the HTML report, as PNG bytes (matplotlib, headless)."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from deltamoe.trace.summary import RankSummary  # noqa: E402

MAX_ROWS = 512  # heat-map rows; more ranks are averaged into bands


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def heatmap(summaries: list[RankSummary]) -> bytes:
    """Compute utilisation, ranks x (steps x slices)."""
    ids = np.unique(np.concatenate([s.step_ids for s in summaries]))
    bins = summaries[0].heat.shape[1] if summaries and summaries[0].heat.ndim == 2 else 16
    m = np.full((len(summaries), len(ids) * bins), np.nan)
    for i, s in enumerate(summaries):
        for k, sid in enumerate(s.step_ids):
            j = int(np.searchsorted(ids, sid))
            m[i, j * bins:(j + 1) * bins] = s.heat[k]
    band = max(1, -(-len(summaries) // MAX_ROWS))
    if band > 1:
        pad = (-len(m)) % band
        m = np.nanmean(np.vstack([m, np.full((pad, m.shape[1]), np.nan)]).reshape(-1, band, m.shape[1]), axis=1)
    fig, ax = plt.subplots(figsize=(10, min(8, 1.5 + 0.12 * len(m))))
    im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xlabel(f"time (steps {int(ids[0])}..{int(ids[-1])}, {bins} slices each)")
    ax.set_ylabel("rank" if band == 1 else f"rank / {band}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for k in range(1, len(ids)):
        ax.axvline(k * bins - 0.5, color="white", lw=0.5)
    fig.colorbar(im, ax=ax, label="compute busy fraction")
    ax.set_title("Compute utilisation per rank over time")
    return _png(fig)


def breakdown_bars(rows: list[dict]) -> bytes:
    ranks = np.array([r["rank"] for r in rows])
    parts = [("compute_s", "compute", "#2a9d8f"), ("exposed_comm_s", "exposed comm", "#e76f51"),
             ("memcpy_s", "memcpy", "#e9c46a"), ("idle_s", "idle", "#adb5bd")]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    bottom = np.zeros(len(rows))
    for key, label, color in parts:
        v = np.array([r[key] for r in rows])
        if len(rows) <= 128:
            ax.bar(ranks, v, bottom=bottom, label=label, color=color, width=0.9)
        else:
            ax.fill_between(ranks, bottom, bottom + v, label=label, color=color, step="mid")
        bottom += v
    ax.set_xlabel("rank")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("seconds (kept steps)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not on them
    ax.set_title("Per-rank time breakdown")
    return _png(fig)


def straggler_ranking(ranking: list[dict], flagged: set[int], limit: int = 24) -> bytes:
    top = ranking[:limit]
    fig, ax = plt.subplots(figsize=(10, 3))
    colors = ["#d62828" if r["rank"] in flagged else "#8d99ae" for r in top]
    ax.bar([str(r["rank"]) for r in top], [r["score"] for r in top], color=colors)
    ax.set_xlabel("rank (red: straggler)")
    ax.set_ylabel("score (step fractions lost by others / step)")
    ax.set_title("Straggler ranking")
    return _png(fig)


def bubble_chart(pipe: dict) -> bytes:
    stages = sorted(pipe["bubble_fraction"], key=int)
    vals = [pipe["bubble_fraction"][s] for s in stages]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(stages, vals, color="#457b9d", label="measured")
    if pipe.get("theoretical_bubble_fraction") is not None:
        ax.axhline(pipe["theoretical_bubble_fraction"], color="#d62828", ls="--",
                   label=f"{pipe['schedule']} theory (p={pipe['stages']}, m={pipe['microbatches']})")
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("bubble fraction")
    ax.set_ylim(0, max(vals + [pipe.get("theoretical_bubble_fraction") or 0]) * 1.15 or 1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("Pipeline bubbles per stage")
    return _png(fig)


def step_histogram(summaries: list[RankSummary]) -> bytes:
    t = np.concatenate([s.step_time for s in summaries]) / 1e3
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist(t, bins=min(60, max(5, len(t) // 4)), color="#6d597a")
    ax.set_xlabel("step time (ms), all ranks and steps")
    ax.set_ylabel("count")
    ax.set_title("Step-time distribution")
    return _png(fig)
