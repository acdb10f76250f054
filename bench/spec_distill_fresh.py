"""A long frozen-trunk MTP distillation on fresh task answers every step, watched as it runs.

Continues a checkpoint's MTP layer (trunk frozen, `train/mtp_distill.py`) on new examples of the
bench's tasks each step (`mtp_distill_data.fresh_answer_batches`: prompt, true answer, EOS, raw
and chat-templated, labels the trunk's greedy tokens at the answer positions). Every `--every`
steps it saves the latest state to OUT/latest and logs the engine's K = 2 acceptance per draft
position on held-out prompts of every task, raw and chat-templated (each decoded to the end of its
answer, as the bench's mix workload); the checkpoint with the best mix acceptance (mean of raw and
chat) is kept in OUT itself, every file written atomically, so OUT is always a whole checkpoint
that `bench/bench_spec_decode.py --checkpoint OUT` measures.

The learning rate warms up, then follows a cosine to a tenth over `--steps`; `--until HH:MM`
(UTC) stops earlier, keeping the best checkpoint so far.

`--eval-seed` picks which held-out prompts choose the best (1, the default, is the bench's own set;
`spec_train_recipe.py` uses 2 so the bench's figures are not the ones the pick was made on);
`--soft` fits the trunk's next-token distribution instead of its greedy token. `distill_fresh` is
the run as a function (`spec_train_recipe.py`'s second stage).

    python bench/spec_distill_fresh.py CHECKPOINT OUT [--steps N] [--lr LR] [--until HH:MM]
        [--rows copy=3,repeat=3,recall=1,arithmetic=1] [--every N] [--eval-prompts N] [--eval-seed S]
        [--soft] [--seed S]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec_decode import RECIPE_FILE, TASK, acceptance, encoders, merged, task_prompts, to_answer_end  # noqa: E402

from deltamoe.model.load import load_model  # noqa: E402
from deltamoe.model.weights import save_checkpoint, write_json_atomic  # noqa: E402
from deltamoe.tokenizers.load import load_tokenizer  # noqa: E402
from deltamoe.train.data.tasks import make_task  # noqa: E402
from deltamoe.train.mtp_distill import distill_mtp  # noqa: E402
from deltamoe.train.mtp_distill_data import fresh_answer_batches  # noqa: E402


class StopAt(Exception):
    """Raised by the step hook at the --until deadline."""


@dataclass
class FreshDistill:
    """One run of this script: the MTP layer distilled on fresh task answers, trunk frozen."""

    steps: int = 2000
    lr: float = 2e-3
    warmup: int = 20
    depth: int = 2  # MTP depths trained (1..depth, chained as it drafts)
    soft: bool = False  # fit the trunk's whole next-token distribution, not only its greedy token
    rows: str = "copy=3,repeat=3,recall=1,arithmetic=1"  # new examples per task per step, each raw and chat
    every: int = 100  # steps between acceptance evaluations (and saves)
    eval_prompts: int = 6  # held-out prompts per task for the acceptance log
    # Which held-out prompts pick the best checkpoint: 1 is the bench's own set (the figures it reports
    # then flatter the pick); any other draws a separate set, so the bench measures prompts never used.
    eval_seed: int = 1
    seed: int = 0


def parse_rows(text: str) -> dict[str, int]:
    rows = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        if name not in TASK.split("+") or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"--rows: {part!r} is not TASK=COUNT with a task of {TASK.replace('+', ', ')}")
        rows[name] = int(count)
    return rows


def deadline(text: str | None) -> float | None:
    """`HH:MM` (UTC, today) as a time.time() value; None stays None."""
    if text is None:
        return None
    hh, _, mm = text.partition(":")
    if not (hh.isdigit() and mm.isdigit() and int(hh) < 24 and int(mm) < 60):
        raise SystemExit(f"--until: {text!r} is not a UTC time HH:MM")
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.replace(hour=int(hh), minute=int(mm), second=0, microsecond=0).timestamp()


def distill_fresh(checkpoint: Path, out: Path, run: FreshDistill, stop_at: float | None = None,
                  threads: int = 1) -> dict:
    """Distill `checkpoint`'s MTP layer as `run` says, keeping the best checkpoint (mean K = 2 mix
    acceptance, raw and chat) in `out` and the latest in out/latest; stops at `stop_at`
    (time.time()). Returns {"score", "step", "report"} of the best evaluation and "last_step", the
    last step run."""
    rows = parse_rows(run.rows)
    torch.set_num_threads(threads)
    torch.manual_seed(run.seed)
    model = load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint, model.config.vocab_size)
    encode = encoders(checkpoint, tokenizer)
    tasks = {t.name: t for t in make_task(TASK, digits=2, num_pairs=8, num_queries=8, string_len=8).tasks}
    batches = fresh_answer_batches({name: (tasks[name], n) for name, n in rows.items()}, list(encode.values()),
                                   lambda text: tokenizer.encode(text, add_bos=False), tokenizer.eos_token_id,
                                   model.config.pad_token_id, run.steps, seed=run.seed)
    held_out = task_prompts(run.eval_prompts, seed=run.eval_seed)
    given = checkpoint / RECIPE_FILE
    recipe = json.loads(given.read_text()) if given.exists() else {}
    latest = out / "latest"
    best: dict = {"score": -1.0, "last_step": 0}
    t0 = time.perf_counter()
    window: list[float] = []

    def evaluate(step: int) -> None:
        save_checkpoint(model, latest)
        probe = load_model(latest)  # the engine works on its own copy, never on the weights being trained
        report: dict = {"step": step, "seconds": round(time.perf_counter() - t0)}
        for kind, enc in encode.items():
            per_task = {name: acceptance(probe, tokenizer, to_answer_end(ps, enc), 2) for name, ps in held_out.items()}
            # None: no verification to count (a one-byte answer leaves no room for drafts).
            report[kind] = {name: r["per_position"] if r["verifications"] else None for name, r in per_task.items()}
            report[kind]["(mix)"] = merged(list(per_task.values()))["per_position"]
        score = sum(sum(report[kind]["(mix)"]) / 2 for kind in encode) / len(encode)
        report["mix_mean_acceptance"] = round(score, 4)
        print(json.dumps(report), flush=True)
        if score > best["score"]:
            best.update(score=score, step=step, report=report)
            save_checkpoint(model, out)
            target = "next-token distribution" if run.soft else "greedy tokens"
            note = (f"then {step} steps of fresh task answers each step ({run.rows}, raw and chat, labels the "
                    f"trunk's {target} at the answer positions), depths 1..{run.depth}, lr {run.lr:g} "
                    f"(warm-up {run.warmup}, cosine over {run.steps}), seed {run.seed}, trunk frozen "
                    f"(bench/spec_distill_fresh.py)")
            write_json_atomic(out / RECIPE_FILE, {**recipe, "continued_from": str(checkpoint),
                                                  "mtp_distill_steps": (recipe.get("mtp_distill_steps") or 0) + step,
                                                  "mtp_distill_data": f"{recipe.get('mtp_distill_data') or ''}; {note}",
                                                  "held_out_acceptance_k2": report})

    def on_step(step: int, loss: float) -> None:
        best["last_step"] = step
        window.append(loss)
        if step % run.every == 0 or step == run.steps:
            print(f"step {step} loss {sum(window) / len(window):.3f} "
                  f"{(time.perf_counter() - t0) / step:.2f} s/step", flush=True)
            window.clear()
            evaluate(step)
        if stop_at is not None and time.time() >= stop_at:
            if step % run.every:
                evaluate(step)
            raise StopAt

    evaluate(0)
    try:
        distill_mtp(model, batches, run.depth, lr=run.lr, warmup=run.warmup, total_steps=run.steps,
                    on_step=on_step, soft=run.soft)
    except StopAt:
        print("stopped at --until", flush=True)
    print(f"best: step {best['step']} mix acceptance {best['score']:.4f} in {out}", flush=True)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    defaults = FreshDistill()
    for f in dataclasses.fields(FreshDistill):
        flag, default = f"--{f.name.replace('_', '-')}", getattr(defaults, f.name)
        if isinstance(default, bool):
            ap.add_argument(flag, action="store_true")
        else:
            ap.add_argument(flag, type=type(default), default=default)
    ap.add_argument("--until", help="UTC HH:MM: stop there (the best checkpoint so far stays in OUT)")
    args = ap.parse_args()
    run = FreshDistill(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FreshDistill)})
    parse_rows(run.rows)  # a bad --rows fails before the model loads
    distill_fresh(args.checkpoint, args.out, run, deadline(args.until))


if __name__ == "__main__":
    main()
