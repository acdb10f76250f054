"""What a step at the batch-size rule's limit costs (`serve/spec_decode/batch_rule.py`), against a
plain engine's step at the same batch, and what the MTP catch-up would cost if it ran every step.

Modes, each an engine over the same random-weight preset, `--batch` requests decoding together
(all at the limit: `--spec-max-batch` = the batch):
- plain: no speculation;
- rule (deferred): what the engine does, the speculating rows' hidden states kept, the MTP layer
  run over them once a block of them fills (or when drafting resumes);
- rule (every step): the same, plus the MTP layer over each row's new position after every step,
  batched in one call (the other way to keep the drafter current).
Per step: the thread's CPU time (other jobs on a busy machine are not counted) and wall time,
the median over `--rounds` interleaved rounds of `--steps` steps, compiled regions with
`--compile` (as the rule's plain steps run by default) or eager.

    python bench/spec_plain_catch_up.py [--preset tiny] [--batch 8] [--steps 64] [--rounds 5] [--compile]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from deltamoe.config import load_preset
from deltamoe.model.load import build_model
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.spec_decode.mtp_drafter import CatchUp

MODES = ("plain", "rule (deferred)", "rule (every step)")


def make_engine(model, mode: str, batch: int, compile_decode: bool) -> LLMEngine:
    spec = mode != "plain"
    config = EngineConfig(cache_memory="256MiB", max_num_seqs=batch, compile_decode=compile_decode,
                          speculative="mtp" if spec else None, num_draft_tokens=2, spec_min_acceptance=0.0,
                          spec_max_batch=batch)
    eng = LLMEngine(model, config=config)
    if mode == "rule (every step)":
        catch_up_every_step(eng.runner)
    return eng


def catch_up_every_step(runner) -> None:
    """After each plain-by-rule step, the MTP layer over every pending position (one batched call)."""
    plain_step = runner._execute_plain

    def step(batch):
        results = plain_step(batch)
        rows = []
        for r in results:
            state = runner.tracker.state(r.seq)
            pending, state.pending = state.pending, None
            if pending is not None and pending.length:
                # Called before the engine appends r.token: the last position's next token is r.token.
                tokens = r.seq.token_ids[pending.start + 1:pending.end] + [r.token]
                rows.append(CatchUp(r.seq, pending.start, torch.cat(pending.hidden), tokens, draft=False))
        runner.drafter.run(rows)
        return results

    runner._execute_plain = step


def decode_steps(eng: LLMEngine, batch: int, steps: int, seed: int) -> tuple[list[float], list[float]]:
    """`batch` requests prefilled, then `steps` decode steps timed: (CPU seconds, wall seconds) per step."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(torch.randint(0, 256, (16,), generator=g).tolist(), params)
    eng.step()  # prefill
    eng.step()  # first decode (compiles on first use)
    cpu, wall = [], []
    for _ in range(steps):
        c0, w0 = time.thread_time(), time.perf_counter()
        eng.step()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    while eng.has_unfinished():
        eng.step()
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = load_preset(args.preset)
    config = dataclasses.replace(config, num_nextn_predict_layers=max(1, config.num_nextn_predict_layers))
    model = build_model(config, seed=0).eval()
    engines = {mode: make_engine(model, mode, args.batch, args.compile) for mode in MODES}
    for eng in engines.values():
        decode_steps(eng, args.batch, 4, 0)  # warm-up
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            c, w = decode_steps(engines[mode], args.batch, args.steps, r)
            cpu[mode].append(statistics.mean(c))
            wall[mode].append(statistics.mean(w))
    base = statistics.median(cpu["plain"])
    print(f"{args.preset}, batch {args.batch}, {'compiled' if args.compile else 'eager'}, "
          f"median of {args.rounds} rounds of {args.steps} steps")
    print("| mode | CPU ms/step | wall ms/step | CPU vs plain |\n|---|---|---|---|")
    for mode in MODES:
        c, w = statistics.median(cpu[mode]), statistics.median(wall[mode])
        print(f"| {mode} | {c * 1e3:.2f} | {w * 1e3:.2f} | {c / base:.3f}x |")
    for mode in MODES[1:]:
        assert engines[mode].runner.tracker.verifications == 0  # every timed step ran at the limit


if __name__ == "__main__":
    main()
