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
    trained = [m for m in metrics if m.get("loss") is not None]
    lm = [m for m in trained if m.get("lm_loss") is not None]
    if lm and any(abs(m["lm_loss"] - m["loss"]) > 1e-9 for m in lm):
        # With MTP heads the loss adds their term; the eval loss is the language model's alone, so the
        # curve it is read against is the train LM loss (the total is drawn faintly beside it).
        ax.plot([m["step"] for m in trained], [m["loss"] for m in trained], label="train loss (LM + MTP)",
                lw=0.8, alpha=0.4, color="C0")
        ax.plot([m["step"] for m in lm], [m["lm_loss"] for m in lm], label="train LM loss", lw=1, color="C1")
    else:
        ax.plot([m["step"] for m in trained], [m["loss"] for m in trained], label="train loss", lw=1)
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="eval loss (LM)", color="C2")
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
