"""Speculative decoding with the MTP head against plain decoding, side by side in one run: decode
tokens/s at batch 1 and 8 with K = 0 (plain), 1, 2, 3 drafts, and acceptance per draft position
on raw and chat-templated prompts, per task.

The model is the `tiny` preset (8 layers + 1 MTP layer, MTP loss weight 0.3) trained here on a
recall + arithmetic + copy + repeat mixture for `--train-steps` steps (repeat: `abc|` ->
`abcabc...`, 32 letters of a fully predictable answer), its one MTP layer trained at depths
1..`--mtp-train-depth` (applied recursively, as it drafts), then the MTP layer alone
self-distilled for `--mtp-distill-steps` steps (deltamoe/train/mtp_distill.py) on the model's own
greedy continuations of training-split prompts, raw and chat-templated, only the generated
positions scored (deltamoe/train/mtp_distill_data.py); both cached under runs/bench_spec_decode/
and reused by later runs with the same recipe. `--save-checkpoint DIR` copies the result to DIR;
`--checkpoint DIR` measures DIR and trains nothing (the speed part alone, e.g. on a quiet
machine); `--checkpoint DIR --mtp-distill-steps N --save-checkpoint DIR2` distills DIR's MTP
layer N steps further (trunk frozen), saves DIR2 and measures it.

Getting a checkpoint worth measuring: the training here (a few hundred steps, then self-distillation
on the model's own continuations) leaves drafts well short of the 0.7 acceptance the goal needs.
`python bench/spec_train_recipe.py DIR [--seed S] [--until HH:MM]` rebuilds the bench checkpoint
from nothing in one command (this file's trunk training, then `spec_distill_fresh.py`'s
distillation on fresh task answers, the best kept; its recipe in DIR/spec_recipe.json); then
`--checkpoint DIR` (with `--acceptance-only` on a loaded machine).

Prompts are held-out examples of each task cut before an answer (as the demo's serve stage draws
them); the chat-templated kind wraps the same text as one user message with the model's chat
template. Everything is greedy. Workloads:
- mix: every task's prompts, each decoded to the end of its answer (EOS; at most the answer's
  bytes + 1 tokens): acceptance per task and over the mixture, and tokens/s ("acceptance" and
  "speed" in the results, the README row);
- repeat: the repeat task's prompts alone (long predictable answers), to the end of the answer;
- open_ended: the mixture's prompts, `--new-tokens` tokens each with EOS ignored (the answer and
  whatever the model writes after it: the measure of earlier runs).
Decode tokens/s counts the tokens after each request's first one over the time after every
request of a group of `batch` has its first token (eager, one torch thread, unless --compile: then
plain decodes, verifications and the MTP layer's drafting calls run through compiled regions,
`serve/spec_decode/compiled_verify.py`). The modes take turns within a round, each round starting
one mode further on: `--batch1-rounds` rounds at batch 1, `--rounds` at batch 8. Per mode:
`tokens_per_s` the best round (the README's figure until now), `tokens_per_s_median` and
`tokens_per_s_spread` (slowest, fastest round); per K, `speedup` from the best rounds and
`speedup_median` / `speedup_spread` from each round's ratio to the plain run of the same round (so
one noisy round shows as spread, not as the figure). The speculative modes "K=1".."K=3" speculate
at every batch size (`spec_max_batch=0`: forced speculation, the rows' meaning before the
batch-size rule); at batch 8 the modes "K=1 (rule)".."K=3 (rule)" run with the engine's default
`spec_max_batch` (`serve/spec_decode/batch_rule.py`): steps of that many requests decode plainly,
and under it the default cost rule (`spec_decode/step_costs.py`) lets a group's last requests
speculate, once the others finished, only at batch sizes where the engine measured that it pays. The goal (>= 1.6x at batch 1, K = 2)
applies to a workload whose K = 2 acceptance is >= 0.7; `goal_met` (the best rounds' speedup) and
`goal_met_median` (the median round's) are null for one below it.

Rollback: the cost per verification of the two ways to undo rejected drafts in the KDA state,
measured on the same model at batch 1: per-position checkpoints kept during the verification
forward (what the engine does), against restoring the state from before the step and
replaying the kept tokens through the model whenever a draft is rejected (weighted by the
measured acceptance).

    .venv/bin/python bench/bench_spec_decode.py [--quick] [--train-steps N] [--compile] [--batch1-rounds N]
        [--save-checkpoint DIR | --checkpoint DIR [--mtp-distill-steps N --save-checkpoint DIR2]]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, result_name, write_result  # noqa: E402

from deltamoe.demo.serve_stage import HeldOutPrompt, answer_prompts  # noqa: E402
from deltamoe.model.load import load_model  # noqa: E402
from deltamoe.serve.api.chat_template import ChatTemplate  # noqa: E402
from deltamoe.serve.engine.cache_view import PagedBatchView  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402
from deltamoe.serve.spec_decode.checkpoint_view import CheckpointView  # noqa: E402
from deltamoe.tokenizers.load import load_tokenizer  # noqa: E402
from deltamoe.train.data.tasks import make_task  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASK = "recall+arithmetic+copy+repeat"
# rule_batch8_vs_plain: batch 8 under the default batch-size rule, each K against plain decoding.
TARGET = {"speedup_batch1_k2": 1.6, "min_acceptance": 0.7, "rule_batch8_vs_plain": 0.95}
RECIPE_FILE = "bench_spec_decode_recipe.json"  # beside a --save-checkpoint copy: its training steps
DISTILL_PROMPTS_PER_TASK = 64  # training-split prompts per task, each raw and chat-templated
DISTILL_NEW_TOKENS = 48  # greedy tokens the model writes after each (the answer and beyond)
DISTILL_LR = 1e-3
DISTILL_WARMUP = 20  # steps of linear warm-up, then a cosine to a tenth of the rate


def recipe(steps: int, threads: int, mtp_depth: int, seed: int = 0) -> dict:
    model = {"preset": "tiny", "overrides": {"mtp_train_depth": mtp_depth}} if mtp_depth > 1 else {"preset": "tiny"}
    return {"model": model,
            "data": {"task": TASK, "num_pairs": 8, "num_queries": 8, "digits": 2, "string_len": 8, "seq_len": 64,
                     "batch_size": 32,
                     "eval_rows": 64},
            "optim": {"lr": 1e-3, "warmup_steps": min(20, steps // 5), "min_lr_ratio": 0.1},
            "run": {"steps": steps, "eval_every": steps, "threads": threads, "seed": seed}}


def trained_checkpoint(steps: int, threads: int, mtp_depth: int, seed: int = 0, out: Path | None = None,
                       max_minutes: float | None = None) -> tuple[Path, bool]:
    """The tiny MTP model trained with `recipe(steps)` into `out` (default: under runs/, keyed by the
    recipe): from there when an earlier run made it. `max_minutes` stops the training early (the
    trainer exports what it has); the same call later resumes from its last checkpoint and finishes
    the same schedule. `trunk_steps_run` tells how far a run got."""
    from deltamoe.train import checkpoint as train_checkpoints
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.trainer import train

    settings = recipe(steps, threads, mtp_depth, seed)
    if out is None:
        # the key leaves threads out (they do not change what is trained) and seed 0 out (older runs' keys)
        run_key = {"steps": steps, "seed": seed} if seed else {"steps": steps}
        key = hashlib.sha256(json.dumps({**settings, "run": run_key}, sort_keys=True).encode()).hexdigest()[:10]
        out = ROOT / "runs" / "bench_spec_decode" / f"tiny-{steps}-{key}"
    if (out / "model" / "config.json").exists() and trunk_steps_run(out) >= steps:
        return out / "model", True
    settings["run"].update(out=str(out), max_minutes=max_minutes,
                           resume=train_checkpoints.latest_checkpoint(out) is not None)
    train(TrainConfig.from_dict(settings).validate())
    return out / "model", False


def trunk_steps_run(run_dir: Path) -> int:
    """The last step a training run in `run_dir` logged (0: none); older runs without a metrics log
    count as finished."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0 if not (run_dir / "model" / "config.json").exists() else sys.maxsize
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"step"' in line]
    return max(steps, default=0)


def distilled_checkpoint(checkpoint: Path, steps: int, threads: int, mtp_depth: int,
                         out: Path | None = None, lr: float = DISTILL_LR,
                         tasks: list[str] | None = None) -> tuple[Path, bool]:
    """`checkpoint` with its MTP layer self-distilled for `steps` steps (train/mtp_distill.py) at depths
    1..mtp_depth on the model's own greedy continuations of training-split prompts of every task (or
    of `tasks`), raw and chat-templated (16 rows a step; train/mtp_distill_data.py); cached beside it
    unless `out`."""
    from deltamoe.model.weights import save_checkpoint
    from deltamoe.train.mtp_distill import distill_mtp
    from deltamoe.train.mtp_distill_data import frozen_trunk_batches, own_continuations

    if out is None:
        variant = "" if tasks is None and lr == DISTILL_LR else f"-{'+'.join(tasks or ['all'])}-lr{lr:g}"
        out = checkpoint.parent / f"model-mtp-distilled-own-{steps}{variant}"
        if (out / "config.json").exists():
            return out, True
    torch.set_num_threads(threads)
    model = load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint, model.config.vocab_size)
    encode = encoders(checkpoint, tokenizer)
    texts = [p.prompt for task, ps in task_prompts(DISTILL_PROMPTS_PER_TASK, split="train").items()
             if tasks is None or task in tasks for p in ps]
    t0 = time.perf_counter()
    rows = own_continuations(engine(model, tokenizer, None, False), [enc(t) for t in texts for enc in encode.values()],
                             DISTILL_NEW_TOKENS)
    print(f"MTP self-distillation: {len(rows)} greedy continuations in {time.perf_counter() - t0:.0f} s", flush=True)
    losses = distill_mtp(model, frozen_trunk_batches(model, rows, 16, steps), mtp_depth, lr=lr,
                         warmup=min(DISTILL_WARMUP, steps // 5), total_steps=steps)
    print(f"MTP self-distillation: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps", flush=True)
    save_checkpoint(model, out)
    return out, False


@dataclass
class Workload:
    """Prompts with their own sampling params (all greedy), run `batch` at a time."""

    prompts: list[list[int]]
    params: list[SamplingParams]


def task_prompts(per_task: int, split: str = "eval", seed: int = 1) -> dict[str, list[HeldOutPrompt]]:
    """Examples of each task of the mixture (held-out ones by default), cut before an answer; seed 1
    draws the prompts this bench reports on."""
    task = make_task(TASK, digits=2, num_pairs=8, num_queries=8, string_len=8)
    return {t.name: answer_prompts(t, per_task, seed, split) for t in task.tasks}


def encoders(checkpoint: Path, tokenizer) -> dict[str, Callable[[str], list[int]]]:
    """raw: the text after BOS, as training rows start; chat: one user message through the chat template."""
    template = ChatTemplate.for_model(tokenizer, checkpoint)
    bos = tokenizer.bos_token_id
    return {"raw": lambda text: tokenizer.encode(text, add_bos=bos is not None),
            "chat": lambda text: template.encode([{"role": "user", "content": text}])}


def to_answer_end(prompts: list[HeldOutPrompt], encode: Callable[[str], list[int]]) -> Workload:
    """Each prompt decoded until the model ends its answer (EOS), at most the answer's bytes + 1."""
    return Workload([encode(p.prompt) for p in prompts],
                    [SamplingParams(max_tokens=len(p.answer.encode()) + 1, temperature=0.0) for p in prompts])


def open_ended(prompts: list[HeldOutPrompt], encode: Callable[[str], list[int]], new_tokens: int) -> Workload:
    """`new_tokens` per prompt with EOS ignored: the answer, then whatever the model writes after it."""
    return Workload([encode(p.prompt) for p in prompts],
                    [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True) for _ in prompts])


def engine(model, tokenizer, k: int | None, compile_decode: bool, rule: bool = False) -> LLMEngine:
    """`rule`: the batch-size rule at its default (`EngineConfig.spec_max_batch`); else speculation at
    every batch size."""
    config = EngineConfig(cache_memory="256MiB", max_num_seqs=64, compile_decode=compile_decode,
                          speculative="mtp" if k else None, num_draft_tokens=k or 2, spec_min_acceptance=0.0,
                          spec_max_batch=EngineConfig.spec_max_batch if rule else 0)
    return LLMEngine(model, tokenizer, config)


def acceptance(model, tokenizer, work: Workload, k: int) -> dict:
    eng = engine(model, tokenizer, k, False)
    eng.generate(work.prompts, work.params, progress=False)
    rates = eng.runner.tracker.acceptance_rates()
    return {"k": k, "per_position": [round(r, 4) for r in rates], "mean_kept_drafts": round(sum(rates), 4),
            "mean_acceptance": round(sum(rates) / k, 4), "verifications": eng.runner.tracker.verifications}


def decode_time(eng: LLMEngine, work: Workload, batch: int) -> tuple[int, float]:
    """(tokens, seconds) over the workload run `batch` requests at a time: in each group, the tokens
    after each request's first, over the time after every request of the group has its first token."""
    tokens, seconds = 0, 0.0
    for i in range(0, len(work.prompts), batch):
        group = list(zip(work.prompts[i:i + batch], work.params[i:i + batch]))
        for prompt, params in group:
            eng.add_request(prompt, params)
        first: set[str] = set()
        while len(first) < len(group) and eng.has_unfinished():
            first |= {o.request_id for o in eng.step() if o.num_output_tokens}
        t0 = time.perf_counter()
        while eng.has_unfinished():
            tokens += sum(len(o.delta_token_ids) for o in eng.step())
        seconds += time.perf_counter() - t0
    return tokens, seconds


def speed(model, tokenizer, work: Workload, batch: int, rounds: int, compile_decode: bool) -> dict:
    """Decode tokens/s of the workload with K = 0 (plain), 1, 2, 3 (and at a batch the rule turns plain,
    K = 1, 2, 3 under the rule): `rounds` rounds, the modes taking turns."""
    modes: dict[str, tuple[int | None, bool]] = {"plain": (None, False), "K=1": (1, False), "K=2": (2, False),
                                                 "K=3": (3, False)}
    if batch >= EngineConfig.spec_max_batch:
        modes.update({f"K={k} (rule)": (k, True) for k in (1, 2, 3)})
    engines = {name: engine(model, tokenizer, k, compile_decode, rule) for name, (k, rule) in modes.items()}
    warm = Workload(work.prompts[:batch], [dataclasses.replace(p, max_tokens=min(8, p.max_tokens))
                                           for p in work.params[:batch]])
    for eng in engines.values():  # warm-up: compiles (with --compile) and first-call costs
        eng.warm_up()
        decode_time(eng, warm, batch)
    names = list(modes)
    rates: dict[str, list[float]] = {name: [] for name in names}
    tokens = 0
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each round starts one mode further on
            tokens, seconds = decode_time(engines[name], work, batch)
            rates[name].append(tokens / seconds)
    best = {name: max(v) for name, v in rates.items()}
    ratios = {name: [x / p for x, p in zip(rates[name], rates["plain"])] for name in names if name != "plain"}
    return {"batch": batch, "decode_tokens": tokens, "rounds": rounds,
            "tokens_per_s": {n: round(v, 1) for n, v in best.items()},
            "tokens_per_s_median": {n: round(statistics.median(v), 1) for n, v in rates.items()},
            "tokens_per_s_spread": {n: [round(min(v), 1), round(max(v), 1)] for n, v in rates.items()},
            "speedup": {n: round(best[n] / best["plain"], 3) for n in names if n != "plain"},
            "speedup_median": {n: round(statistics.median(v), 3) for n, v in ratios.items()},
            "speedup_spread": {n: [round(min(v), 3), round(max(v), 3)] for n, v in ratios.items()}}


def goal_met(accept_k2: float, speedup_k2: float) -> bool | None:
    """The issue's conditional goal: None when acceptance stays under the floor (the goal does not apply)."""
    return speedup_k2 >= TARGET["speedup_batch1_k2"] if accept_k2 >= TARGET["min_acceptance"] else None


@torch.inference_mode()
def rollback_costs(model, tokenizer, prompt: list[int], k: int, accept: list[float], repeats: int) -> dict:
    """ms per verification at batch 1: checkpoints during the forward vs replay after a rejection."""
    eng = engine(model, tokenizer, k, False)
    seq = eng.make_sequence(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    eng.add_sequence(seq)
    eng.step()  # prefill
    cache = eng.cache
    cache.grow(seq, seq.num_computed + k + 1)
    ids = torch.tensor([[1] * (k + 1)])

    def forward(view_class, t: int) -> float:
        times = []
        for _ in range(repeats):
            view = view_class(cache, [seq.block_table], [seq.num_computed], [seq.slot], t)
            t0 = time.perf_counter()
            model(ids[:, :t], cache=view, logits_to_keep=t)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2] * 1e3

    with_checkpoints = forward(CheckpointView, k + 1)
    plain_verify = forward(PagedBatchView, k + 1)
    replay = [forward(PagedBatchView, a + 1) for a in range(k)]  # recompute a kept drafts + the pending token
    # P(exactly a drafts kept) from the per-position acceptance (draft j kept implies every earlier one).
    p_kept = [1.0] + list(accept)
    p_exact = [p_kept[a] - p_kept[a + 1] for a in range(k)]
    expected_replay = plain_verify + sum(p * r for p, r in zip(p_exact, replay))
    return {"k": k, "checkpoints_ms": round(with_checkpoints, 3), "replay_expected_ms": round(expected_replay, 3),
            "verify_without_checkpoints_ms": round(plain_verify, 3), "replay_forward_ms": [round(r, 3) for r in replay],
            "chosen": "checkpoints" if with_checkpoints <= expected_replay else "replay"}


def merged(results: list[dict]) -> dict:
    """Acceptance over several workloads' verifications together."""
    k, total = results[0]["k"], sum(r["verifications"] for r in results)
    rates = [sum(r["per_position"][j] * r["verifications"] for r in results) / max(total, 1) for j in range(k)]
    return {"k": k, "per_position": [round(r, 4) for r in rates], "mean_kept_drafts": round(sum(rates), 4),
            "mean_acceptance": round(sum(rates) / k, 4), "verifications": total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="few training steps and tokens (a smoke run)")
    ap.add_argument("--checkpoint", type=Path, help="measure this trained MTP checkpoint; no training")
    ap.add_argument("--save-checkpoint", type=Path, help="copy the trained (and distilled) checkpoint here")
    ap.add_argument("--train-steps", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt of the open-ended workload")
    ap.add_argument("--prompts-per-task", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the batch-8 speed runs")
    ap.add_argument("--batch1-rounds", type=int, default=5, help="rounds of the batch-1 speed runs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads while decoding")
    ap.add_argument("--train-threads", type=int, default=2)
    ap.add_argument("--mtp-train-depth", type=int, default=3,
                    help="MTP depths trained (the one MTP layer applied recursively, as it drafts); 1: depth 1 only")
    ap.add_argument("--mtp-distill-steps", type=int,
                    help="then fine-tune the MTP layer alone on the model's own greedy continuations (default 300; "
                         "0: off); with --checkpoint (default 0 there): continue from it, into --save-checkpoint")
    ap.add_argument("--mtp-distill-lr", type=float, default=DISTILL_LR,
                    help="peak learning rate of the MTP self-distillation (warm-up, then a cosine to a tenth)")
    ap.add_argument("--mtp-distill-tasks", type=lambda v: v.split(","),
                    help="comma-separated tasks whose prompts the distillation continues (default: every task)")
    ap.add_argument("--compile", action="store_true", help="plain decodes, verifications and drafts through compiled regions")
    ap.add_argument("--acceptance-only", action="store_true",
                    help="acceptance per position alone: no tokens/s and no rollback timing (a loaded machine)")
    args = ap.parse_args()
    unknown = sorted(set(args.mtp_distill_tasks or []) - set(TASK.split("+")))
    if unknown:
        raise SystemExit(f"--mtp-distill-tasks: unknown task {unknown[0]!r} (tasks: {TASK.replace('+', ', ')})")
    steps = 10 if args.quick else args.train_steps
    new_tokens = 12 if args.quick else args.new_tokens
    per_task = 2 if args.quick else args.prompts_per_task
    rounds = {1: 1 if args.quick else args.batch1_rounds, 8: 1 if args.quick else args.rounds}
    distill_steps = args.mtp_distill_steps if args.mtp_distill_steps is not None else (
        0 if args.checkpoint is not None else 300)
    distill = 5 if args.quick and distill_steps else distill_steps

    trained = {"train_steps": steps, "mtp_train_depth": args.mtp_train_depth, "mtp_distill_steps": distill,
               "mtp_distill_data": "own greedy continuations" if distill else None}
    if args.checkpoint is not None:
        if not (args.checkpoint / "config.json").exists():
            raise SystemExit(f"--checkpoint: no config.json in {args.checkpoint}")
        if distill and args.save_checkpoint is None:
            raise SystemExit("--mtp-distill-steps with --checkpoint: name the new checkpoint with --save-checkpoint")
        checkpoint, reused = args.checkpoint, True
        saved = args.checkpoint / RECIPE_FILE  # how --save-checkpoint's run trained it
        trained = json.loads(saved.read_text()) if saved.exists() else dict.fromkeys(trained)
        if distill:  # continue: distill the given checkpoint's MTP layer further
            checkpoint, reused = distilled_checkpoint(args.checkpoint, distill, args.train_threads,
                                                      args.mtp_train_depth, out=args.save_checkpoint,
                                                      lr=args.mtp_distill_lr, tasks=args.mtp_distill_tasks)
            trained = {**trained, "continued_from": str(args.checkpoint),
                       "mtp_distill_steps": (trained.get("mtp_distill_steps") or 0) + distill,
                       "mtp_distill_data": f"{trained.get('mtp_distill_steps') or 0} steps on "
                                           f"{trained.get('mtp_distill_data') or 'data rows'}, then {distill} on own "
                                           f"greedy continuations of {'+'.join(args.mtp_distill_tasks or ['every task'])} "
                                           f"prompts (depths 1..{args.mtp_train_depth}, lr {args.mtp_distill_lr:g} "
                                           f"with warm-up and cosine)"}
            (args.save_checkpoint / RECIPE_FILE).write_text(json.dumps(trained))
            print(f"saved the checkpoint to {args.save_checkpoint}", flush=True)
    else:
        checkpoint, reused = trained_checkpoint(steps, args.train_threads, args.mtp_train_depth)
        if distill:
            checkpoint, _ = distilled_checkpoint(checkpoint, distill, args.train_threads, args.mtp_train_depth,
                                                 lr=args.mtp_distill_lr, tasks=args.mtp_distill_tasks)
        if args.save_checkpoint is not None:
            shutil.copytree(checkpoint, args.save_checkpoint, dirs_exist_ok=True)
            (args.save_checkpoint / RECIPE_FILE).write_text(json.dumps(trained))
            print(f"saved the checkpoint to {args.save_checkpoint}", flush=True)
    torch.set_num_threads(args.threads)
    model = load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint, model.config.vocab_size)
    by_task = task_prompts(per_task)
    mix = [p for ps in by_task.values() for p in ps]
    encode = encoders(checkpoint, tokenizer)

    per_task_accept = {kind: {task: [acceptance(model, tokenizer, to_answer_end(ps, enc), k) for k in (1, 2, 3)]
                              for task, ps in by_task.items()} for kind, enc in encode.items()}
    accept = {kind: [merged([rs[i] for rs in tasks.values()]) for i in range(3)]
              for kind, tasks in per_task_accept.items()}
    accept_open = {kind: [acceptance(model, tokenizer, open_ended(mix, enc, new_tokens), k) for k in (1, 2, 3)]
                   for kind, enc in encode.items()}
    rows = [[kind, task, f"K={r['k']}", " ".join(f"{x:.2f}" for x in r["per_position"]), f"{r['mean_kept_drafts']:.2f}"]
            for kind, tasks in [(k, {**t, "(mix)": accept[k]}) for k, t in per_task_accept.items()]
            for task, rs in tasks.items() for r in rs]
    rows += [[kind, f"(open-ended, {new_tokens} tokens)", f"K={r['k']}", " ".join(f"{x:.2f}" for x in r["per_position"]),
              f"{r['mean_kept_drafts']:.2f}"] for kind, rs in accept_open.items() for r in rs]
    print(markdown_table(["prompts", "task", "drafts", "acceptance per position", "kept per verification"], rows))
    if args.acceptance_only:
        return
    workloads = {"mix": (to_answer_end(mix, encode["raw"]), accept["raw"]),
                 "repeat": (to_answer_end(by_task["repeat"], encode["raw"]), per_task_accept["raw"]["repeat"]),
                 "open_ended": (open_ended(mix, encode["raw"], new_tokens), accept_open["raw"])}
    speeds = {name: [speed(model, tokenizer, work, b, rounds[b], args.compile) for b in (1, 8)]
              for name, (work, _) in workloads.items()}
    goals = {name: goal_met(acc[1]["mean_acceptance"], speeds[name][0]["speedup"]["K=2"])
             for name, (_, acc) in workloads.items()}
    goals_median = {name: goal_met(acc[1]["mean_acceptance"], speeds[name][0]["speedup_median"]["K=2"])
                    for name, (_, acc) in workloads.items()}
    rollback = rollback_costs(model, tokenizer, workloads["mix"][0].prompts[0], 2, accept["raw"][1]["per_position"],
                              5 if args.quick else 50)

    data = {
        "quick": args.quick, "target": TARGET,
        "model": {"preset": "tiny", "task": TASK, **trained, "checkpoint": str(checkpoint), "reused": reused,
                  "given": args.checkpoint is not None},
        "workload": {"prompts_per_task": per_task, "tasks": list(by_task), "open_ended_new_tokens": new_tokens,
                     "rounds": {f"batch_{b}": n for b, n in rounds.items()}, "threads": args.threads,
                     "compile_decode": args.compile, "spec_max_batch_default": EngineConfig.spec_max_batch,
                     "spec_batch_rule_default": EngineConfig.spec_batch_rule},
        # "acceptance" and "speed": the mixture's prompts, each decoded to the end of its answer (EOS).
        "acceptance": accept, "acceptance_per_task": per_task_accept, "acceptance_open_ended": accept_open,
        "speed": speeds["mix"], "speed_by_workload": speeds, "rollback": rollback,
        "acceptance_k2_by_workload": {name: acc[1]["mean_acceptance"] for name, (_, acc) in workloads.items()},
        "goal_met": goals["mix"], "goal_met_by_workload": goals,
        "goal_met_median": goals_median["mix"], "goal_met_median_by_workload": goals_median,
    }
    path = write_result(result_name("spec_decode", args.quick), data)
    modes = list(speeds["mix"][1]["tokens_per_s"])  # batch 8's: the rule's modes too
    print(markdown_table(["workload", "batch", *modes, "K=2 speedup", "goal"],
                         [[name, s["batch"], *(f"{s['tokens_per_s'][m]:,.1f}" if m in s["tokens_per_s"] else ""
                                               for m in modes),
                           f"{s['speedup']['K=2']:.2f}x", goals[name] if s["batch"] == 1 else ""]
                          for name, ss in speeds.items() for s in ss]))
    print("speedup over plain per round, median (slowest - fastest round); K=n forced: speculation at every "
          f"batch size; K=n (rule): --spec-max-batch {EngineConfig.spec_max_batch}")
    columns = modes[1:]
    print(markdown_table(["workload", "batch", "rounds", *columns, "goal (median)"],
                         [[name, s["batch"], s["rounds"],
                           *(f"{s['speedup_median'][c]:.2f}x ({s['speedup_spread'][c][0]:.2f}-"
                             f"{s['speedup_spread'][c][1]:.2f})" if c in s["speedup_median"] else "" for c in columns),
                           goals_median[name] if s["batch"] == 1 else ""]
                          for name, ss in speeds.items() for s in ss]))
    print(f"rollback at K=2: checkpoints {rollback['checkpoints_ms']} ms vs replay {rollback['replay_expected_ms']} "
          f"ms per verification -> {rollback['chosen']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
