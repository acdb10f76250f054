"""Speculative decoding with the MTP head against plain decoding, side by side in one run: decode
tokens/s at batch 1 and 8 with K = 1, 2, 3 drafts, and acceptance per draft position on raw and
chat-templated prompts.

The model is the `tiny` preset (8 layers + 1 MTP layer, MTP loss weight 0.3) trained here on a
recall + arithmetic + copy mixture for `--train-steps` steps, its one MTP layer trained at depths
1..`--mtp-train-depth` (applied recursively, as it drafts), then the MTP layer alone
self-distilled on the trunk's greedy tokens for `--mtp-distill-steps` steps
(deltamoe/train/mtp_distill.py); both cached under runs/bench_spec_decode/ and reused by later
runs with the same recipe. Prompts are held-out
examples of each task cut before an answer (as the demo's serve stage draws them); the
chat-templated kind wraps the same text as one user message with the model's chat template.
Every run is greedy with EOS ignored (acceptance over `--new-tokens` tokens per prompt, the
answer and whatever the model writes after it). Decode tokens/s counts the tokens after each
request's first one over the time after every request has its first token, best of
`--rounds` alternating rounds over the modes (eager, one torch thread, unless --compile: then
plain decodes run the compiled graph, and verification stays eager).

Rollback: the cost per verification of the two ways to undo rejected drafts in the KDA state,
measured on the same model at batch 1: per-position checkpoints kept during the verification
forward (what the engine does), against restoring the state from before the step and
replaying the kept tokens through the model whenever a draft is rejected (weighted by the
measured acceptance).

    .venv/bin/python bench/bench_spec_decode.py [--quick] [--train-steps N] [--compile]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, result_name, write_result  # noqa: E402

from deltamoe.demo.serve_stage import held_out_prompts  # noqa: E402
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
TASK = "recall+arithmetic+copy"
TARGET = {"speedup_batch1_k2": 1.6, "min_acceptance": 0.7}


def recipe(steps: int, threads: int, mtp_depth: int) -> dict:
    model = {"preset": "tiny", "overrides": {"mtp_train_depth": mtp_depth}} if mtp_depth > 1 else {"preset": "tiny"}
    return {"model": model,
            "data": {"task": TASK, "num_pairs": 8, "num_queries": 8, "digits": 2, "seq_len": 64, "batch_size": 32,
                     "eval_rows": 64},
            "optim": {"lr": 1e-3, "warmup_steps": min(20, steps // 5), "min_lr_ratio": 0.1},
            "run": {"steps": steps, "eval_every": steps, "threads": threads}}


def trained_checkpoint(steps: int, threads: int, mtp_depth: int) -> tuple[Path, bool]:
    """The tiny MTP model trained with `recipe(steps)`: from runs/ when an earlier run made it."""
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.trainer import train

    settings = recipe(steps, threads, mtp_depth)
    key = hashlib.sha256(json.dumps({**settings, "run": {"steps": steps}}, sort_keys=True).encode()).hexdigest()[:10]
    out = ROOT / "runs" / "bench_spec_decode" / f"tiny-{steps}-{key}"
    if (out / "model" / "config.json").exists():
        return out / "model", True
    settings["run"]["out"] = str(out)
    train(TrainConfig.from_dict(settings).validate())
    return out / "model", False


def distilled_checkpoint(checkpoint: Path, steps: int, threads: int, mtp_depth: int) -> tuple[Path, bool]:
    """`checkpoint` with its MTP layer self-distilled for `steps` steps (train/mtp_distill.py) at depths
    1..mtp_depth on the recipe's training rows (16 a step, after the ones training used); cached beside it."""
    from deltamoe.model.weights import save_checkpoint
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.data import build_data
    from deltamoe.train.mtp_distill import distill_mtp

    out = checkpoint.parent / f"model-mtp-distilled-{steps}"
    if (out / "config.json").exists():
        return out, True
    settings = recipe(steps, threads, mtp_depth)
    model = load_model(checkpoint)
    data = build_data(TrainConfig.from_dict(settings).validate(), model.config)
    torch.set_num_threads(threads)
    rows = (data.rows("train", 10**6 + 16 * i, 16).input_ids for i in range(steps))
    losses = distill_mtp(model, rows, mtp_depth)
    print(f"MTP self-distillation: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps", flush=True)
    save_checkpoint(model, out)
    return out, False


def prompt_sets(checkpoint: Path, tokenizer, per_task: int) -> dict[str, list[list[int]]]:
    task = make_task(TASK, digits=2, num_pairs=8, num_queries=8)
    texts = [p.prompt for t in task.tasks for p in held_out_prompts(t, per_task, seed=1)]
    template = ChatTemplate.for_model(tokenizer, checkpoint)
    bos = tokenizer.bos_token_id
    return {"raw": [tokenizer.encode(t, add_bos=bos is not None) for t in texts],
            "chat": [template.encode([{"role": "user", "content": t}]) for t in texts]}


def engine(model, tokenizer, k: int | None, compile_decode: bool) -> LLMEngine:
    config = EngineConfig(cache_memory="256MiB", max_num_seqs=64, compile_decode=compile_decode,
                          speculative="mtp" if k else None, num_draft_tokens=k or 2, spec_min_acceptance=0.0)
    return LLMEngine(model, tokenizer, config)


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def acceptance(model, tokenizer, prompts: list[list[int]], k: int, new_tokens: int) -> dict:
    eng = engine(model, tokenizer, k, False)
    eng.generate(prompts, greedy(new_tokens), progress=False)
    rates = eng.runner.tracker.acceptance_rates()
    return {"k": k, "per_position": [round(r, 4) for r in rates], "mean_kept_drafts": round(sum(rates), 4),
            "mean_acceptance": round(sum(rates) / k, 4), "verifications": eng.runner.tracker.verifications}


def decode_rate(eng: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens after each request's first, per second after every request has its first token."""
    for p in prompts:
        eng.add_request(p, greedy(new_tokens))
    first: set[str] = set()
    while len(first) < len(prompts):
        first |= {o.request_id for o in eng.step() if o.num_output_tokens}
    t0, tokens = time.perf_counter(), 0
    while eng.has_unfinished():
        tokens += sum(len(o.delta_token_ids) for o in eng.step())
    return tokens / (time.perf_counter() - t0)


def speed(model, tokenizer, prompts: list[list[int]], batch: int, new_tokens: int, rounds: int,
          compile_decode: bool) -> dict:
    modes = {"plain": None, "K=1": 1, "K=2": 2, "K=3": 3}
    engines = {name: engine(model, tokenizer, k, compile_decode) for name, k in modes.items()}
    chosen = (prompts * batch)[:batch]
    for eng in engines.values():  # warm-up: compiles (with --compile) and first-call costs
        eng.warm_up()
        decode_rate(eng, chosen, min(8, new_tokens))
    best = {name: 0.0 for name in modes}
    for _ in range(rounds):
        for name, eng in engines.items():
            best[name] = max(best[name], decode_rate(eng, chosen, new_tokens))
    return {"batch": batch, "tokens_per_s": {n: round(v, 1) for n, v in best.items()},
            "speedup": {n: round(best[n] / best["plain"], 3) for n in modes if n != "plain"}}


@torch.inference_mode()
def rollback_costs(model, tokenizer, prompt: list[int], k: int, accept: list[float], repeats: int) -> dict:
    """ms per verification at batch 1: checkpoints during the forward vs replay after a rejection."""
    eng = engine(model, tokenizer, k, False)
    seq = eng.make_sequence(prompt, greedy(4))
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="few training steps and tokens (a smoke run)")
    ap.add_argument("--train-steps", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts-per-task", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads while decoding")
    ap.add_argument("--train-threads", type=int, default=2)
    ap.add_argument("--mtp-train-depth", type=int, default=3,
                    help="MTP depths trained (the one MTP layer applied recursively, as it drafts); 1: depth 1 only")
    ap.add_argument("--mtp-distill-steps", type=int, default=300,
                    help="then fine-tune the MTP layer alone on the trunk's greedy tokens (0: off)")
    ap.add_argument("--compile", action="store_true", help="plain decodes through the compiled graph")
    args = ap.parse_args()
    steps = 10 if args.quick else args.train_steps
    new_tokens = 12 if args.quick else args.new_tokens
    per_task = 2 if args.quick else args.prompts_per_task
    rounds = 1 if args.quick else args.rounds

    checkpoint, reused = trained_checkpoint(steps, args.train_threads, args.mtp_train_depth)
    distill = 5 if args.quick and args.mtp_distill_steps else args.mtp_distill_steps
    if distill:
        checkpoint, _ = distilled_checkpoint(checkpoint, distill, args.train_threads, args.mtp_train_depth)
    torch.set_num_threads(args.threads)
    model = load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint, model.config.vocab_size)
    prompts = prompt_sets(checkpoint, tokenizer, per_task)
    accept = {kind: [acceptance(model, tokenizer, ps, k, new_tokens) for k in (1, 2, 3)]
              for kind, ps in prompts.items()}
    speeds = [speed(model, tokenizer, prompts["raw"], b, new_tokens, rounds, args.compile) for b in (1, 8)]
    rollback = rollback_costs(model, tokenizer, prompts["raw"][0], 2, accept["raw"][1]["per_position"],
                              5 if args.quick else 50)

    b1 = speeds[0]
    k2_accept = accept["raw"][1]["mean_acceptance"]
    data = {
        "quick": args.quick, "target": TARGET,
        "model": {"preset": "tiny", "task": TASK, "train_steps": steps, "mtp_train_depth": args.mtp_train_depth,
                  "mtp_distill_steps": distill,
                  "checkpoint": str(checkpoint),
                  "reused": reused},
        "workload": {"prompts_per_kind": len(prompts["raw"]), "new_tokens": new_tokens, "rounds": rounds,
                     "threads": args.threads, "compile_decode": args.compile},
        "acceptance": accept, "speed": speeds, "rollback": rollback,
        "goal_met": b1["speedup"]["K=2"] >= TARGET["speedup_batch1_k2"] if k2_accept >= TARGET["min_acceptance"]
        else None,
    }
    path = write_result(result_name("spec_decode", args.quick), data)
    rows = [[kind, f"K={r['k']}", " ".join(f"{x:.2f}" for x in r["per_position"]), f"{r['mean_kept_drafts']:.2f}"]
            for kind, rs in accept.items() for r in rs]
    print(markdown_table(["prompts", "drafts", "acceptance per position", "kept per verification"], rows))
    print(markdown_table(["batch", *speeds[0]["tokens_per_s"]],
                         [[s["batch"], *(f"{v:,.1f}" for v in s["tokens_per_s"].values())] for s in speeds]))
    print(f"rollback at K=2: checkpoints {rollback['checkpoints_ms']} ms vs replay {rollback['replay_expected_ms']} "
          f"ms per verification -> {rollback['chosen']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
