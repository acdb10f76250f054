"""Where a speculative step's time goes at batch 1, against a plain decode step's.

Same setting as `spec_step_ops.py` (random-weight preset, drafts replaced by the plain greedy
continuation: every draft right). Each mode's engine runs `--rounds` rounds of `--steps` steps,
the modes interleaved so that a load change hits them all; per part the median over rounds of
the mean per step; the first four steps' time (prefill, first drafts, and with `--compile` the
graphs batch 1 needs: on an empty inductor cache, `TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)`, that is
a first start's compile). Parts of a speculative step:
- verify forward: the target model over the pending token and the K drafts (T = K + 1), the
  KDA checkpoints included;
- verify host: acceptance, logprobs, block trimming, results (`_verify` less its forward);
- draft MTP layer: the MTP layer's calls (the catch-up pass and K - 1 chained draft passes);
- draft host: the drafter's picks, logits and packing (`drafter.run` less its layer calls);
- rest: the engine around the runner (scheduling, `emit_speculative`, detokenizing).
A plain step is split into its forward and the rest. `--compile`: plain decodes and verifications
through the compiled regions (`serve/spec_decode/compiled_verify.py`).

    python bench/spec_step_split.py [--preset tiny] [--rounds 7] [--steps 10] [--k 1,2,3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path
import sys

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_step_ops import PROMPT, RightDrafter  # noqa: E402

from deltamoe.config import load_preset  # noqa: E402
from deltamoe.model.load import build_model  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402


class PartTimer:
    """Wall time spent inside wrapped methods, by part name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, part: str) -> None:
        method = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0

        setattr(obj, name, timed)


def spec_engine(model, k: int, continuation: list[int], compile_decode: bool, timer: PartTimer) -> LLMEngine:
    config = EngineConfig(cache_memory="64MiB", speculative="mtp" if k else None, num_draft_tokens=k or 1,
                          spec_min_acceptance=0.0, compile_decode=compile_decode)
    eng = LLMEngine(model, config=config)
    runner = eng.runner
    if k:
        runner.drafter = RightDrafter(model, eng.cache, k, continuation, runner.drafter.compiled)
        timer.wrap(runner, "_verify", "verify")
        timer.wrap(runner, "verify_forward", "verify forward")
        timer.wrap(runner.drafter, "run", "draft")
        timer.wrap(runner.drafter, "_call", "draft MTP layer")
    else:
        timer.wrap(runner, "forward", "forward")
    return eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="steps per mode and round")
    ap.add_argument("--k", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 3])
    ap.add_argument("--compile", action="store_true", help="plain decodes and verifications through compiled regions")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model(load_preset(args.preset), seed=3).eval()
    steps = args.rounds * args.steps + 8
    greedy = SamplingParams(max_tokens=4 * steps + 8, temperature=0.0, ignore_eos=True)
    continuation = LLMEngine(model, config=EngineConfig(cache_memory="64MiB")).generate(
        [PROMPT], greedy, progress=False)[0].token_ids
    modes = [0, *args.k]
    timers = {k: PartTimer() for k in modes}
    engines = {k: spec_engine(model, k, continuation, args.compile, timers[k]) for k in modes}
    starts = {}
    for k, eng in engines.items():
        eng.add_request(PROMPT, greedy)
        t0 = time.perf_counter()
        for _ in range(4):  # prefill, first drafts, first compiles
            eng.step()
        starts[k] = time.perf_counter() - t0
    rounds: dict[int, list[dict[str, float]]] = {k: [] for k in modes}
    for _ in range(args.rounds):
        for k, eng in engines.items():
            timers[k].seconds.clear()
            tokens = 0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                tokens += sum(len(o.delta_token_ids) for o in eng.step())
            parts = {name: s / args.steps for name, s in timers[k].seconds.items()}
            parts["step"] = (time.perf_counter() - t0) / args.steps
            parts["tokens"] = tokens / args.steps
            rounds[k].append(parts)
    med = {k: {name: statistics.median(r[name] for r in rounds[k]) for name in rounds[k][0]} for k in modes}
    plain = med[0]["step"]
    print(f"plain: {plain * 1e3:.2f} ms/step (forward {med[0]['forward'] * 1e3:.2f}, rest "
          f"{(plain - med[0]['forward']) * 1e3:.2f}); first 4 steps (compiles included) "
          + ", ".join(f"{'plain' if k == 0 else f'K={k}'} {s:.1f} s" for k, s in starts.items()))
    for k in args.k:
        m = med[k]
        parts = {"verify forward": m["verify forward"], "verify host": m["verify"] - m["verify forward"],
                 "draft MTP layer": m["draft MTP layer"], "draft host": m["draft"] - m["draft MTP layer"],
                 "rest": m["step"] - m["verify"] - m["draft"]}
        split = ", ".join(f"{name} {s * 1e3:.2f} ({s / plain:.2f})" for name, s in parts.items())
        print(f"K={k}: {m['step'] * 1e3:.2f} ms/step = {m['step'] / plain:.2f}x plain, {m['tokens']:.2f} tokens/step; "
              f"{split}")


if __name__ == "__main__":
    main()
