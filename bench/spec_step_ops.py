"""Torch ops dispatched per engine step, plain against speculative (K = 1..3), at batch 1: the
load-independent side of a speculative step's cost (at decode sizes each op's dispatch, not its
arithmetic, is what a small model's step costs).

The model is a random-weight preset with its MTP layer; the drafts are replaced by the plain
greedy continuation (every draft right, as at acceptance 1), so each step emits K + 1 tokens.
Per mode: ops per step, tokens per step, ops per token, and the step's split into the
verification call and the MTP drafter's pass. `--time`: also the median wall time of a step
(uncounted steps, one torch thread) against a plain step's, and the speedup that cost gives at
acceptance 0.7 (1 + 0.7 K tokens per verification: 2.4 at K = 2): a quiet machine's figure.

    python bench/spec_step_ops.py [--preset tiny] [--steps 6] [--time [--timed-steps 40]]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltamoe.config import load_preset
from deltamoe.model.load import build_model
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.spec_decode.mtp_drafter import MTPDrafter

PROMPT = list(range(1, 40))
ACCEPTANCE = 0.7  # the goal's floor: K = 2 then emits 2.4 tokens per verification


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class RightDrafter(MTPDrafter):
    """The MTP drafter's work, its draft tokens then replaced by the plain greedy continuation."""

    def __init__(self, model, cache, k: int, continuation: list[int], compiled=None):
        super().__init__(model, cache, k, compiled)
        self.continuation = continuation

    def run(self, rows):
        drafts = super().run(rows)
        for d in drafts:
            if d is not None:
                for j in range(len(d.tokens)):
                    i = d.position + 1 + j - len(PROMPT)
                    d.tokens[j] = self.continuation[i] if i < len(self.continuation) else 0
        return drafts


def counted(obj, name: str, totals: Counter) -> None:
    """Wrap obj.name so that the ops it dispatches add up in totals[name]."""
    method = getattr(obj, name)

    def wrapper(*args):
        with OpCount() as c:
            out = method(*args)
        totals[name] += sum(c.ops.values())
        return out

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=6, help="decode steps counted per mode")
    ap.add_argument("--time", action="store_true", help="also time steps (median ms, quiet machine)")
    ap.add_argument("--timed-steps", type=int, default=40, help="steps timed per mode with --time")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model(load_preset(args.preset), seed=3).eval()
    timed = args.timed_steps if args.time else 0
    greedy = SamplingParams(max_tokens=4 * (args.steps + timed) + 8, temperature=0.0, ignore_eos=True)
    continuation = LLMEngine(model, config=EngineConfig(cache_memory="64MiB")).generate(
        [PROMPT], greedy, progress=False)[0].token_ids
    plain_ops = plain_ms = None
    for k in (0, 1, 2, 3):
        config = EngineConfig(cache_memory="64MiB", speculative="mtp" if k else None, num_draft_tokens=k or 2,
                              spec_min_acceptance=0.0)
        eng = LLMEngine(model, config=config)
        phases: Counter = Counter()
        if k:
            eng.runner.drafter = RightDrafter(model, eng.cache, k, continuation)
            counted(eng.runner, "_verify", phases)
            counted(eng.runner.drafter, "run", phases)
        eng.add_request(PROMPT, greedy)
        for _ in range(3):  # prefill, then the first drafts
            eng.step()
        phases.clear()
        with OpCount() as c:
            tokens = sum(len(o.delta_token_ids) for _ in range(args.steps) for o in eng.step())
        ops = sum(c.ops.values()) / args.steps
        plain_ops = plain_ops or ops
        split = ", ".join(f"{name} {n / args.steps:,.0f}" for name, n in phases.items())
        print(f"K={k}: {ops:,.0f} ops/step ({ops / plain_ops:.2f}x plain), {tokens / args.steps:.2f} tokens/step, "
              f"{ops * args.steps / tokens:,.0f} ops/token" + (f"; {split}" if split else ""))
        if timed:
            if k:  # the counting wrappers dispatch every op through Python: off for the timing
                del eng.runner._verify, eng.runner.drafter.run
            times = []
            for _ in range(timed):
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            plain_ms = plain_ms or ms
            at = 1 + ACCEPTANCE * k  # tokens per verification when each draft is kept at that rate
            print(f"K={k}: {ms:.2f} ms/step median of {timed} ({ms / plain_ms:.2f}x plain)"
                  + (f"; at acceptance {ACCEPTANCE} ({at:.1f} tokens/step): {at * plain_ms / ms:.2f}x plain tokens/s"
                     if k else ""))


if __name__ == "__main__":
    main()
