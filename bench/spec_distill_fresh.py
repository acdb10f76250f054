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

    python bench/spec_distill_fresh.py CHECKPOINT OUT [--steps N] [--lr LR] [--until HH:MM]
        [--rows copy=3,repeat=3,recall=1,arithmetic=1] [--every N] [--eval-prompts N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
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


def parse_rows(text: str) -> dict[str, int]:
    rows = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        if name not in TASK.split("+") or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"--rows: {part!r} is not TASK=COUNT with a task of {TASK.replace('+', ', ')}")
        rows[name] = int(count)
    return rows


def deadline(text: str | None) -> float | None:
    if text is None:
        return None
    now = datetime.datetime.now(datetime.timezone.utc)
    hh, mm = (int(v) for v in text.split(":"))
    at = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    return at.timestamp()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--depth", type=int, default=2, help="MTP depths trained (1..depth, chained as it drafts)")
    ap.add_argument("--rows", default="copy=3,repeat=3,recall=1,arithmetic=1",
                    help="new examples per task per step (each raw and chat-templated)")
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--eval-prompts", type=int, default=6, help="held-out prompts per task for the acceptance log")
    ap.add_argument("--until", help="UTC HH:MM: stop there (the best checkpoint so far stays in OUT)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows, stop_at = parse_rows(args.rows), deadline(args.until)
    torch.set_num_threads(1)
    model = load_model(args.checkpoint)
    tokenizer = load_tokenizer(args.checkpoint, model.config.vocab_size)
    encode = encoders(args.checkpoint, tokenizer)
    tasks = {t.name: t for t in make_task(TASK, digits=2, num_pairs=8, num_queries=8, string_len=8).tasks}
    batches = fresh_answer_batches({name: (tasks[name], n) for name, n in rows.items()}, list(encode.values()),
                                   lambda text: tokenizer.encode(text, add_bos=False), tokenizer.eos_token_id,
                                   model.config.pad_token_id, args.steps, seed=args.seed)
    held_out = task_prompts(args.eval_prompts)
    given = args.checkpoint / RECIPE_FILE
    recipe = json.loads(given.read_text()) if given.exists() else {}
    latest = args.out / "latest"
    best = {"score": -1.0}
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
            best.update(score=score, step=step)
            save_checkpoint(model, args.out)
            note = (f"then {step} steps of fresh task answers each step ({args.rows}, raw and chat, labels the "
                    f"trunk's greedy tokens at the answer positions), depths 1..{args.depth}, lr {args.lr:g} "
                    f"(warm-up {args.warmup}, cosine over {args.steps}), trunk frozen (bench/spec_distill_fresh.py)")
            write_json_atomic(args.out / RECIPE_FILE, {**recipe, "continued_from": str(args.checkpoint),
                                                "mtp_distill_steps": (recipe.get("mtp_distill_steps") or 0) + step,
                                                "mtp_distill_data": f"{recipe.get('mtp_distill_data', '')}; {note}",
                                                "held_out_acceptance_k2": report})

    def on_step(step: int, loss: float) -> None:
        window.append(loss)
        if step % args.every == 0 or step == args.steps:
            print(f"step {step} loss {sum(window) / len(window):.3f} "
                  f"{(time.perf_counter() - t0) / step:.2f} s/step", flush=True)
            window.clear()
            evaluate(step)
        if stop_at is not None and time.time() >= stop_at:
            if step % args.every:
                evaluate(step)
            raise StopAt

    evaluate(0)
    try:
        distill_mtp(model, batches, args.depth, lr=args.lr, warmup=args.warmup, total_steps=args.steps,
                    on_step=on_step)
    except StopAt:
        print("stopped at --until", flush=True)
    print(f"best: step {best['step']} mix acceptance {best['score']:.4f} in {args.out}", flush=True)


if __name__ == "__main__":
    main()
