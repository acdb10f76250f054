"""Blockwise FP8 training quality on a smooth objective: byte-level language modelling.

The `tiny` preset learns to predict the bytes of a text corpus (this repository's own documentation,
docs/*.md and README.md, one document per file; its size and sha256 go into the results) with and
without `--fp8 blockwise` (linears and experts in e4m3 with DeepSeek-V3 tiling, forward and
backward) at several seeds. Each seed fixes the initial weights and the order of the training rows,
so the two runs of one seed differ only by fp8; the held-out rows (the corpus's last 5 %) are the
same for every run. Recall, the earlier objective, has a phase transition whose step varies from
seed to seed, so one seed's gap measured when it jumped, not fp8; a language-modelling loss falls
smoothly, and after its fast drop the seeds end close together.

Per run: the final training loss (the next-token loss, metrics.jsonl's `lm_loss`, without MTP's
term; mean of the last `--tail` steps: one batch's loss is noisy) and the held-out eval loss. Per seed pair: fp8 / reference - 1 for both; over the pairs their mean and
spread (sample standard deviation; min and max); the reference's own seed-to-seed spread
(standard deviation / mean of its final losses) says how large a gap noise alone makes. The goal
is a mean gap within 1 % on both losses. Also per decoder layer the mean relative quantisation
error of x, W and dy at the last step (from metrics.jsonl's `fp8_error`), and the curves
(bench/results/train_fp8.png: smoothed training loss per run, and the gap per seed pair over steps).

The rest of the model, and the reference run, train at `--precision`: bf16 autocast by default
(on a CPU too: KDA's chunked op leaves the region and computes in fp32, as its triangular solve has
no bf16 CPU kernel), or fp32. On a CPU the fp8 products are the exact quantise -> dequantise
emulation, so the wall times measure the emulation, not fp8 speed. The runs train side by side in processes of one thread each
(`--jobs N` at a time); `--out DIR` keeps their run folders (metrics.jsonl, eval.jsonl).
Run: python bench/bench_train_fp8.py [--quick] [--steps N] [--seeds K] [--precision bf16|fp32]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, markdown_table, result_name, write_result  # noqa: E402

GOAL = 0.01  # mean relative gap of the smoothed final training loss and of the final eval loss
REPO = Path(__file__).resolve().parent.parent
SETTINGS = {
    "data": {"seq_len": 64, "batch_size": 16, "eval_rows": 64, "eval_fraction": 0.05},
    "optim": {"lr": 3e-3, "warmup_steps": 20, "min_lr_ratio": 0.1},
    "run": {"eval_every": 40, "threads": 1, "progress": False, "fp8_stats_every": 40},
}


def write_corpus(path: Path) -> dict:
    """docs/*.md then README.md, one {"text": ...} line per file; returns what identifies the corpus."""
    files = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
    lines = [json.dumps({"text": f.read_text(encoding="utf-8")}) for f in files]
    path.write_text("\n".join(lines) + "\n")
    return {"files": [str(f.relative_to(REPO)) for f in files], **corpus_identity(path)}


def corpus_identity(path: Path) -> dict:
    blob = path.read_bytes()
    return {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}


def layer_errors(fp8_error: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per decoder layer (model.layers.N, mtp...): the mean over its converted modules of each operand's error."""
    groups: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for name, errs in fp8_error.items():
        parts = name.split(".")
        key = ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else parts[0] if parts[0] != "model" else ".".join(parts[:2])
        for operand, e in errs.items():
            groups[key][operand].append(e)
    order = sorted(groups, key=lambda k: (k.split(".")[0], int(k.rsplit(".", 1)[1]) if k[-1].isdigit() else -1))
    return {k: {op: sum(v) / len(v) for op, v in groups[k].items()} for k in order}


def run(fp8: bool, seed: int, steps: int, tail: int, settings: dict, out: str) -> dict:
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.trainer import train

    s = {k: dict(v) for k, v in settings.items()}
    s["run"].update(steps=steps, out=out, fp8="blockwise" if fp8 else None, seed=seed)
    cfg = TrainConfig.from_dict({"model": {"preset": "tiny"}, **s}).validate()
    shutil.rmtree(Path(out) / "checkpoints", ignore_errors=True)  # a fresh run each time (train refuses another's)
    t0 = time.perf_counter()
    train(cfg)
    return {**read_run(Path(out), fp8, seed, tail, steps), "wall_s": time.perf_counter() - t0}


def read_run(out: Path, fp8: bool, seed: int, tail: int, upto: int) -> dict:
    """A run's record from its folder (metrics.jsonl, eval.jsonl), through step `upto`."""
    from deltamoe.train.metrics import read_jsonl

    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m and m["step"] <= upto]
    losses = [m["lm_loss"] for m in metrics]  # next-token loss, as evaluated (the total `loss` adds MTP's)
    evals = [{"step": e["step"], "loss": e["loss"]} for e in read_jsonl(out / "eval.jsonl") if e["step"] <= upto]
    record = {"seed": seed, "losses": losses, "final_loss": sum(losses[-tail:]) / len(losses[-tail:]),
              "evals": evals, "eval_loss": evals[-1]["loss"] if evals else None,
              "eval_step": evals[-1]["step"] if evals else None}
    if fp8:
        stats = [(m["step"], m["fp8_error"]) for m in metrics if "fp8_error" in m]
        record["fp8_error_by_layer_last_step"] = layer_errors(stats[-1][1])
        record["fp8_error_mean_over_modules"] = [
            {"step": step, **{op: statistics.mean(e[op] for e in errs.values() if op in e) for op in ("x", "w", "dy")}}
            for step, errs in stats]
    return record


def read_runs(root: Path, prec: str, tail: int) -> tuple[list[dict], list[dict], int, int]:
    """--from-runs: the kept folders of an earlier (possibly unfinished) run of this script, compared
    through the last step every run reached and the last evaluation every run made."""
    from deltamoe.train.metrics import read_jsonl

    folders = sorted(root.glob(f"{prec}_seed*"), key=lambda p: int(p.name.rsplit("seed", 1)[1]))
    pairs = [(f, root / f"fp8_seed{f.name.rsplit('seed', 1)[1]}") for f in folders]
    runs = [p for pair in pairs for p in pair]
    if len(pairs) < 2 or not all((p / "metrics.jsonl").is_file() for p in runs):
        raise SystemExit(f"error: --from-runs: {root} needs {prec}_seedN and fp8_seedN folders for >= 2 seeds")
    schedule = json.loads((runs[0] / "train_config.json").read_text())["run"]["steps"]
    reached = min(max(m["step"] for m in read_jsonl(p / "metrics.jsonl") if "loss" in m) for p in runs)
    ref = [read_run(r, False, int(r.name.rsplit("seed", 1)[1]), tail, reached) for r, _ in pairs]
    fp8 = [read_run(f, True, int(f.name.rsplit("seed", 1)[1]), tail, reached) for _, f in pairs]
    if any(r["eval_step"] is None for r in ref + fp8):
        raise SystemExit(f"error: --from-runs: not every run in {root} has evaluated by step {reached} yet")
    last_eval = min(r["eval_step"] for r in ref + fp8)
    for r in ref + fp8:  # every run's eval loss at the same step
        r["evals"] = [e for e in r["evals"] if e["step"] <= last_eval]
        r["eval_loss"], r["eval_step"], r["wall_s"] = r["evals"][-1]["loss"], last_eval, None
    return ref, fp8, reached, schedule


def spread(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def summarise(ref: list[dict], fp8: list[dict]) -> dict:
    """Per seed pair the gaps fp8 / reference - 1; their spread; the reference's own seed-to-seed spread."""
    pairs = [{"seed": r["seed"], "rel_gap": f["final_loss"] / r["final_loss"] - 1,
              "eval_rel_gap": f["eval_loss"] / r["eval_loss"] - 1} for r, f in zip(ref, fp8)]
    out = {"pairs": pairs, "rel_gap": spread([p["rel_gap"] for p in pairs]),
           "eval_rel_gap": spread([p["eval_rel_gap"] for p in pairs])}
    for key, metric in (("seed_rel_spread", "final_loss"), ("seed_eval_rel_spread", "eval_loss")):
        s = spread([r[metric] for r in ref])
        out[key] = s["std"] / s["mean"]
    out["within_goal"] = abs(out["rel_gap"]["mean"]) <= GOAL and abs(out["eval_rel_gap"]["mean"]) <= GOAL
    return out


def running_mean(xs: list[float], k: int) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def plot(prec: str, ref: list[dict], fp8: list[dict], path: Path, window: int = 10) -> Path:
    """Left: every run's training loss (`window`-step running mean) and eval loss. Right: fp8 / reference - 1 per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from deltamoe.train.plots import save_figure

    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for runs, cmap, name in ((ref, plt.cm.Blues, prec), (fp8, plt.cm.Reds, f"{prec} + fp8 blockwise")):
        for i, r in enumerate(runs):
            color = cmap(0.5 + 0.4 * i / max(1, len(runs) - 1))
            steps = range(1, len(r["losses"]) + 1)
            ax.plot(steps, running_mean(r["losses"], window), color=color, lw=1.2, label=f"{name}, seed {r['seed']}")
            ax.plot([e["step"] for e in r["evals"]], [e["loss"] for e in r["evals"]], "o", color=color, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel(f"next-token loss (train: {window}-step mean; dots: held-out eval)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for i, (r, f) in enumerate(zip(ref, fp8)):
        gap = [b / a - 1 for a, b in zip(running_mean(r["losses"], window), running_mean(f["losses"], window))]
        gap_ax.plot(range(1, len(gap) + 1), [100 * g for g in gap], color=f"C{i}", lw=1.2,
                    label=f"seed {r['seed']}: train")
        gap_ax.plot([e["step"] for e in r["evals"]],
                    [100 * (b["loss"] / a["loss"] - 1) for a, b in zip(r["evals"], f["evals"])],
                    "o--", color=f"C{i}", ms=3, lw=0.8, label=f"seed {r['seed']}: eval")
    for y in (-100 * GOAL, 100 * GOAL):
        gap_ax.axhline(y, color="k", lw=0.6, ls=":")
    gap_ax.set_xlabel("step")
    gap_ax.set_ylabel(f"fp8 / {prec} - 1 (%)")
    gap_ax.set_ylim(-10, 10)
    gap_ax.grid(alpha=0.3)
    gap_ax.legend(fontsize=7)
    fig.suptitle(f"tiny preset, byte-level LM on the repo's docs: blockwise FP8 vs {prec}")
    return save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--seeds", type=int, default=3, help="seed pairs (reference and fp8 at seeds 0..K-1)")
    ap.add_argument("--tail", type=int, default=30, help="steps averaged into the final training loss")
    ap.add_argument("--quick", action="store_true", help="2 seeds x 6 steps of 4 x 32 tokens (a smoke run)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16",
                    help="the reference run's precision, and the rest of the model's in the fp8 run")
    ap.add_argument("--jobs", type=int, help="runs training at once (default: all of them)")
    ap.add_argument("--out", help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--from-runs", metavar="DIR", help="train nothing: compare the run folders an earlier --out "
                    "kept, through the last step all of them reached (an unfinished run: `steps` < `schedule_steps`)")
    args = ap.parse_args()
    settings = {k: dict(v) for k, v in SETTINGS.items()}
    settings["run"]["precision"] = args.precision
    steps, seeds, tail = args.steps, args.seeds, args.tail
    if args.quick:
        settings["data"].update(seq_len=32, batch_size=4, eval_rows=4)
        settings["optim"]["warmup_steps"] = 2
        settings["run"].update(eval_every=3, fp8_stats_every=3)
        steps, seeds, tail = 6, 2, 3
    if seeds < 2 or not 1 <= tail <= steps:
        ap.error("--seeds needs >= 2 (the spread) and --tail 1..--steps")
    schedule = steps
    if args.from_runs:
        root = Path(args.from_runs)
        corpus = corpus_identity(root / "corpus.jsonl")
        kept = json.loads(next(root.glob("fp8_seed*/train_config.json")).read_text())
        settings = {k: {f: kept[k][f] for f in v} for k, v in settings.items()}
        ref, fp8, steps, schedule = read_runs(root, args.precision, tail)
        seeds = len(ref)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(args.out or tmp)
            root.mkdir(parents=True, exist_ok=True)
            corpus = write_corpus(root / "corpus.jsonl")
            settings["data"]["path"] = str(root / "corpus.jsonl")
            jobs = [(fp8, seed, steps, tail, settings, str(root / f"{'fp8' if fp8 else args.precision}_seed{seed}"))
                    for seed in range(seeds) for fp8 in (False, True)]
            with multiprocessing.get_context("spawn").Pool(args.jobs or len(jobs)) as pool:
                results = pool.starmap(run, jobs)
        ref, fp8 = results[0::2], results[1::2]
    settings["data"]["path"] = "corpus.jsonl (docs/*.md + README.md)"
    summary = summarise(ref, fp8)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the trainer's (CUDA: the products use scaled_mm)
    data = {"objective": "byte-level language modelling", "device": device, "corpus": corpus, "settings": settings,
            "steps": steps, "schedule_steps": schedule, "eval_step": ref[0]["eval_step"], "seeds": seeds, "tail_steps": tail,
            "goal_rel_gap": GOAL, "precision": args.precision, **summary, args.precision: ref, "fp8_blockwise": fp8}
    path = write_result(result_name("train_fp8", args.quick), data)
    png = plot(args.precision, ref, fp8, RESULTS / f"{result_name('train_fp8', args.quick)}.png")
    rows = [[r["seed"], f"{r['final_loss']:.4f} / {r['eval_loss']:.4f}", f"{f['final_loss']:.4f} / {f['eval_loss']:.4f}",
             f"{p['rel_gap']:+.2%} / {p['eval_rel_gap']:+.2%}", " / ".join("-" if x["wall_s"] is None else f"{x['wall_s']:.0f} s" for x in (r, f))]
            for r, f, p in zip(ref, fp8, summary["pairs"])]
    print(markdown_table(["seed", f"{args.precision} train (last {tail}) / eval loss", "fp8 train / eval loss",
                          "fp8 gap train / eval", "wall"], rows))
    g, e = summary["rel_gap"], summary["eval_rel_gap"]
    print(f"fp8 vs {args.precision} over {seeds} seeds: train loss {g['mean']:+.2%} +- {g['std']:.2%}, "
          f"eval loss {e['mean']:+.2%} +- {e['std']:.2%} (goal: mean within {GOAL:.0%}: "
          f"{'met' if summary['within_goal'] else 'missed'}); {args.precision} seed-to-seed spread "
          f"{summary['seed_rel_spread']:.2%} / {summary['seed_eval_rel_spread']:.2%}")
    print(f"results: {path}, curve: {png}")


if __name__ == "__main__":
    main()
