"""The RL run's PNG: reward, accuracy (sampled and held-out greedy), KL and clip fraction, the
trainer-vs-engine logprob mismatch, and where each step's time went."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltamoe.train.plots import save_figure


def plot_rl_curves(records: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[int], list[float]]:
        rows = [r for r in records if r.get(key) is not None]
        return [r["step"] for r in rows], [r[key] for r in rows]

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    panels = [
        (axes[0][0], [("reward_mean", "reward mean")], "reward", None),
        (axes[0][1], [("accuracy", "sampled accuracy"), ("eval_accuracy", "held-out greedy accuracy")], "accuracy",
         (0, 1.02)),
        (axes[0][2], [("kl", "KL to the initial policy")], "KL (k3)", None),
        (axes[1][0], [("clip_fraction", "clip fraction")], "share of tokens", None),
        (axes[1][1], [("logprob_mismatch", "mean |trainer - engine|"), ("logprob_mismatch_max", "max")],
         "logprob mismatch (nats)", None),
        (axes[1][2], [("rollout_s", "rollout"), ("train_s", "train"), ("sync_s", "weight sync")], "seconds", None),
    ]
    for ax, keys, ylabel, ylim in panels:
        for key, label in keys:
            x, y = series(key)
            if x and key == "eval_accuracy":  # with its 95 % interval where logged
                rows = [r for r in records if r.get(key) is not None]
                lo = [r[key] - r["eval_ci95"][0] if r.get("eval_ci95") else 0.0 for r in rows]
                hi = [r["eval_ci95"][1] - r[key] if r.get("eval_ci95") else 0.0 for r in rows]
                ax.errorbar(x, y, yerr=[lo, hi], fmt="o-", label=label + " (95 % CI)", lw=1, ms=3, capsize=3)
            elif x:
                ax.plot(x, y, "-", label=label, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)
