"""Where a speculative step's time goes at batch 1, against a plain decode step's.

Same setting as `spec_step_ops.py` (random-weight preset, drafts replaced by the plain greedy
continuation: every draft right). Times are the thread's CPU time (`decode_step_split.PhaseClock`:
what a busy machine's other jobs take is not counted). Each mode's engine runs `--rounds` rounds
of `--steps` steps, the modes interleaved; per part its mean per step in the mode's fastest round
(the round least disturbed by other jobs; on a quiet machine every round is about the same).
Also printed: the first four steps' wall time (prefill, first drafts, and when compiled the graphs
batch 1 needs: on an empty inductor cache, `TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)`, a first start's
compile). Parts of a speculative step:
- verify forward: the target model over the pending token and the K drafts (T = K + 1), the
  KDA checkpoints included;
- verify host: acceptance, logprobs, block trimming, results (`_verify` less its forward);
- draft MTP layer: the MTP layer's calls (the catch-up pass and K - 1 chained draft passes);
- draft host: the drafter's picks, logits and packing (`drafter.run` less its layer calls);
- rest: the engine around the runner (scheduling, `emit_speculative`, detokenizing).
A plain step is split into its forward and the rest.

Settings (`--settings`, each a plain engine and one per K, all interleaved in one run):
- eager: no compiled call anywhere;
- compiled-plain: `--compile` before speculative steps had compiled forms (plain decodes through
  the compiled regions, verifications and drafts eager), against the same compiled plain step;
- compiled: `--compile` now (verifications and drafts through their compiled regions too,
  `serve/spec_decode/compiled_verify.py`, `compiled_draft.py`).

    python bench/spec_step_split.py [--preset tiny] [--rounds 7] [--steps 10] [--k 1,2,3]
        [--settings eager,compiled-plain,compiled]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
import sys

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step_split import PhaseClock  # noqa: E402
from spec_step_ops import PROMPT, RightDrafter  # noqa: E402

from deltamoe.config import load_preset  # noqa: E402
from deltamoe.model.load import build_model  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402


SETTINGS = ("eager", "compiled-plain", "compiled")


def spec_engine(model, k: int, continuation: list[int], setting: str, clock: PhaseClock) -> LLMEngine:
    config = EngineConfig(cache_memory="64MiB", speculative="mtp" if k else None, num_draft_tokens=k or 1,
                          spec_min_acceptance=0.0, compile_decode=setting != "eager")
    eng = LLMEngine(model, config=config)
    runner = eng.runner
    if k:
        compiled_draft = runner.drafter.compiled
        if setting == "compiled-plain":
            runner._compiled_verify, compiled_draft = None, None
        runner.drafter = RightDrafter(model, eng.cache, k, continuation, compiled_draft)
        runner._verify = clock.wrap("verify", runner._verify)
        runner.verify_forward = clock.wrap("verify forward", runner.verify_forward)
        runner.drafter.run = clock.wrap("draft", runner.drafter.run)
        runner.drafter._call = clock.wrap("draft MTP layer", runner.drafter._call)
    else:
        runner.forward = clock.wrap("forward", runner.forward)
    return eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="steps per mode and round")
    ap.add_argument("--k", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 3])
    ap.add_argument("--settings", type=lambda v: v.split(","), default=list(SETTINGS),
                    help="comma-separated, of " + ", ".join(SETTINGS))
    args = ap.parse_args()
    if set(args.settings) - set(SETTINGS):
        ap.error(f"--settings: expected some of {', '.join(SETTINGS)}, got {','.join(args.settings)}")
    torch.set_num_threads(1)
    model = build_model(load_preset(args.preset), seed=3).eval()
    steps = args.rounds * args.steps + 8
    greedy = SamplingParams(max_tokens=4 * steps + 8, temperature=0.0, ignore_eos=True)
    continuation = LLMEngine(model, config=EngineConfig(cache_memory="64MiB")).generate(
        [PROMPT], greedy, progress=False)[0].token_ids
    modes = [(setting, k) for setting in args.settings for k in [0, *args.k]]
    clocks = {mode: PhaseClock() for mode in modes}
    engines = {mode: spec_engine(model, mode[1], continuation, mode[0], clocks[mode]) for mode in modes}
    starts = {}
    for mode, eng in engines.items():
        eng.add_request(PROMPT, greedy)
        t0 = time.perf_counter()
        for _ in range(4):  # prefill, first drafts, first compiles
            eng.step()
        starts[mode] = time.perf_counter() - t0
    rounds: dict[tuple[str, int], list[dict[str, float]]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, eng in engines.items():
            clocks[mode].seconds.clear()
            tokens = 0
            t0 = time.thread_time()
            for _ in range(args.steps):
                tokens += sum(len(o.delta_token_ids) for o in eng.step())
            parts = {name: s / args.steps for name, s in clocks[mode].seconds.items()}
            parts["step"] = (time.thread_time() - t0) / args.steps
            parts["tokens"] = tokens / args.steps
            rounds[mode].append(parts)
    best = {mode: min(rounds[mode], key=lambda r: r["step"]) for mode in modes}
    for setting in args.settings:
        p = best[(setting, 0)]
        plain = p["step"]
        print(f"[{setting}] plain: {plain * 1e3:.2f} ms/step (forward {p['forward'] * 1e3:.2f}, rest "
              f"{(plain - p['forward']) * 1e3:.2f}); first 4 steps (compiles included) "
              + ", ".join(f"{'plain' if k == 0 else f'K={k}'} {starts[(setting, k)]:.1f} s" for k in [0, *args.k]))
        for k in args.k:
            m = best[(setting, k)]
            parts = {"verify forward": m["verify forward"], "verify host": m["verify"] - m["verify forward"],
                     "draft MTP layer": m["draft MTP layer"], "draft host": m["draft"] - m["draft MTP layer"],
                     "rest": m["step"] - m["verify"] - m["draft"]}
            split = ", ".join(f"{name} {s * 1e3:.2f} ({s / plain:.2f})" for name, s in parts.items())
            print(f"[{setting}] K={k}: {m['step'] * 1e3:.2f} ms/step = {m['step'] / plain:.2f}x plain, "
                  f"{m['tokens']:.2f} tokens/step; {split}")


if __name__ == "__main__":
    main()
