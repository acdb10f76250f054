"""Where the offline benchmark's time goes, end to end: its real run (64 prompts x 128 tokens, batch 64,
growing context), split into prefill steps and the phases of its decode steps.

`bench_serve_offline.py`'s model, prompts and engine settings run `LLMEngine.generate` once with each
decode phase timed by the thread's CPU clock (`decode_step_split.PhaseClock`: with one torch thread the
compiled kernels run on this thread too, and a loaded machine's waits count for nothing):

- prefill steps: every step that computes a prompt chunk (eager), whole;
- decode steps, per phase (`decode_step_split.PHASES`): schedule, input prep (token ids, the cache's
  `PagedBatchView`), region calls (dynamo's entry, guards, the AOT and inductor wrappers and the
  compiled code), eager glue (embedding, per-layer cache views, output norm, LM head), sampling,
  postprocess (token bookkeeping, detokenizer, stop checks, commit, outputs) and other (the step loop,
  `generate`'s own loop);
- compiled kernels: what of the region calls is the compiled C++ code itself (inductor's
  `inductor_entry_cpp`, read from a second, profiled run: cProfile inflates Python, not these calls).
  Region calls minus kernels is the entry cost; the kernels plus prefill are the floor that no
  host-side cut moves.

    OMP_NUM_THREADS=1 .venv/bin/python bench/offline_step_split.py [--form layers] [--num-scheduler-steps 8]

Writes bench/results/offline_step_split.json.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve_offline import hf_model, make_prompts  # noqa: E402
from common import markdown_table, write_result  # noqa: E402
from decode_step_split import PHASES, PhaseClock, instrument, split  # noqa: E402

from deltamoe.model.load import load_model  # noqa: E402
from deltamoe.serve.engine import multi_step  # noqa: E402
from deltamoe.serve.engine.config import COMPILE_FORMS, EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402


def engine_for(model, form: str, steps: int) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(cache_memory="1GiB", max_num_seqs=64, max_num_batched_tokens=2048,
                                                compile_decode=True, compile_form=form, num_scheduler_steps=steps))


def timed_run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One `generate` with its prefill steps and each decode phase timed apart."""
    clock = PhaseClock()
    instrument(engine, clock)
    draw_tokens = multi_step.draw_tokens
    multi_step.draw_tokens = clock.wrap("sampling", draw_tokens)  # sampling inside a window
    buckets = {"prefill": PhaseClock(), "decode": PhaseClock()}
    counts = {"prefill": 0, "decode": 0}
    seconds = {"prefill": 0.0, "decode": 0.0}
    schedule, step = engine.scheduler.schedule, engine.step
    kind = ["decode"]

    def schedule_noting_prefill():
        batch = schedule()
        kind[0] = "prefill" if any(n > 1 for _, n in batch.items) else "decode"
        return batch

    def step_by_kind():
        before, before_calls = dict(clock.seconds), dict(clock.calls)
        start = time.thread_time()
        try:
            return step()
        finally:
            seconds[kind[0]] += time.thread_time() - start
            counts[kind[0]] += 1
            for name, total in clock.seconds.items():
                buckets[kind[0]].seconds[name] += total - before.get(name, 0.0)
            for name, calls in clock.calls.items():
                buckets[kind[0]].calls[name] += calls - before_calls.get(name, 0)

    engine.scheduler.schedule, engine.step = schedule_noting_prefill, step_by_kind
    start = time.thread_time()
    try:
        engine.generate(prompts, params, progress=False)
    finally:
        multi_step.draw_tokens = draw_tokens
    total = time.thread_time() - start
    # Per decode token step: a multi-step window is one engine step of several compiled calls.
    decode_calls = buckets["decode"].calls["compiled call"]
    return {"total_s": total, "prefill_s": seconds["prefill"], "prefill_steps": counts["prefill"],
            "decode_s": seconds["decode"], "decode_steps": decode_calls, "engine_decode_steps": counts["decode"],
            "decode_ms": split(buckets["decode"], seconds["decode"], decode_calls),
            "outside_steps_s": total - seconds["prefill"] - seconds["decode"]}


def kernel_seconds(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Thread CPU seconds inside inductor's compiled C++ entry points during one profiled `generate`."""
    profile = cProfile.Profile(time.thread_time)
    profile.enable()
    engine.generate(prompts, params, progress=False)
    profile.disable()
    return sum(stat[2] for func, stat in pstats.Stats(profile).stats.items() if "inductor_entry_cpp" in func[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", default=COMPILE_FORMS[0], choices=COMPILE_FORMS)
    parser.add_argument("--num-scheduler-steps", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="timed runs; the fastest is reported")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = make_prompts(64)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model().save_pretrained(tmp)
        model = load_model(tmp)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    engine_for(model, args.form, args.num_scheduler_steps).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), progress=False)  # compiles
    runs = [timed_run(engine_for(model, args.form, args.num_scheduler_steps), prompts, params)
            for _ in range(args.rounds)]
    run = min(runs, key=lambda r: r["total_s"])
    kernels = kernel_seconds(engine_for(model, args.form, args.num_scheduler_steps), prompts, params)
    total, steps = run["total_s"], run["decode_steps"]
    decode = run["decode_ms"]
    rows = [["prefill (eager, whole steps)", f"{run['prefill_steps']} steps",
             f"{1000 * run['prefill_s']:.1f} ms", f"{run['prefill_s'] / total:.1%}"]]
    for phase in PHASES:
        rows.append([f"decode: {phase}", f"{decode[phase]:.3f} ms/step", f"{decode[phase] * steps:.1f} ms",
                     f"{decode[phase] * steps / 1000 / total:.1%}"])
    rows.append(["  of the region calls: compiled kernels", f"{1000 * kernels / steps:.3f} ms/step",
                 f"{1000 * kernels:.1f} ms", f"{kernels / total:.1%}"])
    rows.append(["outside steps (generate's set-up, results)", "", f"{1000 * run['outside_steps_s']:.1f} ms",
                 f"{run['outside_steps_s'] / total:.1%}"])
    print(markdown_table(["piece", "per step", "run", "share"], rows))
    floor = kernels + run["prefill_s"]
    print(f"\n{64 * 128 / total:,.0f} output tok per CPU s ({steps} decode steps in {run['engine_decode_steps']} engine "
          f"steps, {run['prefill_steps']} prefill); "
          f"compiled kernels + prefill alone: {64 * 128 / floor:,.0f} tok per CPU s")
    path = write_result("offline_step_split", {
        "config": {"model": "offline benchmark (Kimi Linear, 4 layers)", "prompts": 64, "new_tokens": 128,
                   "form": args.form, "num_scheduler_steps": args.num_scheduler_steps, "clock": "thread CPU",
                   "threads": 1, "rounds": args.rounds},
        **run, "kernel_s": kernels, "tokens_per_cpu_s": 64 * 128 / total, "floor_tokens_per_cpu_s": 64 * 128 / floor})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
