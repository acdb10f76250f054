"""One command that rebuilds the speculative-decoding bench checkpoint from nothing, deterministic
from a seed: the `tiny` trunk trained with its MTP loss on the bench's task mixture
(`bench_spec_decode.trained_checkpoint`), then its MTP layer alone distilled on fresh task answers
every step, trunk frozen (`spec_distill_fresh.distill_fresh`).

OUT ends up a whole checkpoint that `bench/bench_spec_decode.py --checkpoint OUT` measures: the
best MTP layer of the distillation (mean K = 2 mix acceptance on held-out prompts of their own,
`--eval-seed`, not the ones the bench reports on), every file written atomically, OUT/latest the
last evaluated state, OUT/trunk the trunk's training run, and OUT/spec_recipe.json this recipe
(every setting, the seed, the stages' wall times, the best evaluation), rewritten after each stage.

Why the two stages: the tasks score only answer bytes and their keys and values are random, so the
MTP loss during training teaches the MTP layer little about what the trunk writes; drafts are kept
when they equal the trunk's own greedy tokens, so the MTP layer is then fitted to those, on new
examples every step (no row to memorise: only a copy rule lowers the loss). See docs/serving-speculative.md,
"Fresh task answers every step".

    python bench/spec_train_recipe.py OUT [--seed S] [--until HH:MM] [--trunk-steps N]
        [--distill-steps N] [--lr LR] [--rows copy=4,repeat=4,recall=2,arithmetic=2] [--every N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec_decode import RECIPE_FILE, trained_checkpoint, trunk_steps_run  # noqa: E402
from spec_distill_fresh import FreshDistill, deadline, distill_fresh, parse_rows  # noqa: E402

from deltamoe.model.weights import write_json_atomic  # noqa: E402

RECIPE_JSON = "spec_recipe.json"


@dataclass
class SpecRecipe:
    seed: int = 0
    trunk_steps: int = 600
    mtp_train_depth: int = 3  # the trunk's MTP loss at depths 1..3, one layer applied recursively
    train_threads: int = 2
    distill: FreshDistill = field(default_factory=lambda: FreshDistill(
        steps=3000, lr=2e-3, warmup=20, depth=2, rows="copy=4,repeat=4,recall=2,arithmetic=2", every=250,
        eval_prompts=8, eval_seed=2))


def build(out: Path, recipe: SpecRecipe, stop_at: float | None, command: str,
          distill_reserve_minutes: float = 15.0) -> dict:
    """Run both stages into `out`; returns the recipe record written to out/spec_recipe.json.

    `stop_at` (time.time()) bounds the whole build: the trunk trains until `distill_reserve_minutes`
    before it, the distillation until it. A build cut short says so ("complete": false) and still
    leaves a usable checkpoint; the same command later resumes the trunk from its last checkpoint
    (the same schedule, so the same trunk) and redoes the distillation on it."""
    recipe = dataclasses.replace(recipe, distill=dataclasses.replace(recipe.distill, seed=recipe.seed))  # one seed
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"command": command, "recipe": dataclasses.asdict(recipe), "stages": {}, "complete": False}
    write_json_atomic(out / RECIPE_JSON, record)
    t0 = time.perf_counter()
    trunk_minutes = None if stop_at is None else max(1.0, (stop_at - time.time()) / 60 - distill_reserve_minutes)
    trunk, reused = trained_checkpoint(recipe.trunk_steps, recipe.train_threads, recipe.mtp_train_depth,
                                       recipe.seed, out=out / "trunk", max_minutes=trunk_minutes)
    trunk_steps = min(trunk_steps_run(out / "trunk"), recipe.trunk_steps)
    # what the distillation's checkpoints record as their origin (bench_spec_decode reads it back)
    write_json_atomic(trunk / RECIPE_FILE, {"train_steps": trunk_steps, "mtp_train_depth": recipe.mtp_train_depth,
                                            "mtp_distill_steps": 0,
                                            "mtp_distill_data": f"spec_train_recipe.py seed {recipe.seed}"})
    record["stages"]["trunk"] = {"checkpoint": str(trunk), "reused": reused, "steps_run": trunk_steps,
                                 "seconds": round(time.perf_counter() - t0)}
    write_json_atomic(out / RECIPE_JSON, record)
    print(f"trunk: {trunk} ({'reused' if reused else 'trained'}, {trunk_steps}/{recipe.trunk_steps} steps, "
          f"{record['stages']['trunk']['seconds']} s)", flush=True)
    t1 = time.perf_counter()
    best = distill_fresh(trunk, out, recipe.distill, stop_at,
                         threads=recipe.train_threads)
    record["stages"]["distill"] = {"seconds": round(time.perf_counter() - t1), "steps_run": best["last_step"],
                                   "best_step": best["step"], "best_mix_mean_acceptance": round(best["score"], 4),
                                   "best_report": best["report"]}
    record["seconds"] = round(time.perf_counter() - t0)
    record["complete"] = trunk_steps == recipe.trunk_steps and best["last_step"] == recipe.distill.steps
    write_json_atomic(out / RECIPE_JSON, record)
    print(f"{'done' if record['complete'] else 'stopped at --until (incomplete)'} in {record['seconds']} s: {out}",
          flush=True)
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    defaults = SpecRecipe()
    ap.add_argument("--seed", type=int, default=defaults.seed)
    ap.add_argument("--trunk-steps", type=int, default=defaults.trunk_steps)
    ap.add_argument("--mtp-train-depth", type=int, default=defaults.mtp_train_depth)
    ap.add_argument("--train-threads", type=int, default=defaults.train_threads)
    ap.add_argument("--distill-steps", type=int, default=defaults.distill.steps)
    ap.add_argument("--lr", type=float, default=defaults.distill.lr, help="peak lr of the distillation")
    ap.add_argument("--rows", default=defaults.distill.rows, help="new examples per task per distillation step")
    ap.add_argument("--soft", action="store_true",
                    help="distill on the trunk's next-token distribution (KL), not its greedy token")
    ap.add_argument("--every", type=int, default=defaults.distill.every, help="steps between evaluations")
    ap.add_argument("--until", help="UTC HH:MM: stop the distillation there, keeping the best checkpoint")
    args = ap.parse_args()
    parse_rows(args.rows)  # a bad --rows fails before minutes of training
    if args.train_threads > 2:
        raise SystemExit(f"--train-threads: at most 2 (the machine's cores are shared), got {args.train_threads}")
    recipe = SpecRecipe(seed=args.seed, trunk_steps=args.trunk_steps, mtp_train_depth=args.mtp_train_depth,
                        train_threads=args.train_threads,
                        distill=dataclasses.replace(defaults.distill, steps=args.distill_steps, lr=args.lr,
                                                    rows=args.rows, every=args.every, soft=args.soft))
    build(args.out, recipe, deadline(args.until), " ".join(sys.argv))


if __name__ == "__main__":
    main()
