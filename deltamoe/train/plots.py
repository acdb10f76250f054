"""The end-of-run PNG: training loss (and eval loss) per step, and eval accuracy when scored."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def plot_curves(metrics: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on training hosts
    import matplotlib.pyplot as plt

    has_acc = any(e.get("accuracy") is not None for e in evals)
    fig, axes = plt.subplots(1, 2 if has_acc else 1, figsize=(11 if has_acc else 6, 4), squeeze=False)
    ax = axes[0][0]
    steps = [m["step"] for m in metrics if m.get("loss") is not None]
    ax.plot(steps, [m["loss"] for m in metrics if m.get("loss") is not None], label="train loss", lw=1)
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    if has_acc:
        ax = axes[0][1]
        ax.plot([e["step"] for e in evals], [e["accuracy"] for e in evals], "o-", color="C2")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out answer accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Write a matplotlib figure atomically (a reader never sees half a PNG) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path
