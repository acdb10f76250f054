"""Decode step of the compiled forms side by side: CPU ms per step at batch 1 / 16 / 64, one process, the forms interleaved.

Backs docs/serving-compiled.md ("Whole-layer regions"): each variant is an engine of its own on its own
copy of the preset (so no graph is shared between variants), warmed up (`LLMEngine.warm_up`, every
graph class), then timed round after round, the variants in turn, so a loaded machine disturbs
them alike; the best round of each is kept. One torch thread; CPU time of the process
(`time.process_time`). Variants: `layers` (the default form), `parts`, `whole`, `eager`, and
`layers-2rows` (whole layers with batch 1 as two rows, `CompiledDecode.min_rows` = 2: the
gathered-experts graphs built too; what `rows_skipping_expert_gather` saves at a first start and
costs at batch 1).

    .venv/bin/python bench/compiled_forms_step.py [VARIANT ...] [--preset tiny] [--rounds 3] [--steps 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

VARIANTS = ("layers", "layers-2rows", "parts", "whole", "eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=["layers", "layers-2rows", "parts"], choices=VARIANTS)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size and round")
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))

    import torch

    from deltamoe import load_model
    from deltamoe.serve.engine.config import EngineConfig
    from deltamoe.serve.engine.llm_engine import LLMEngine
    from deltamoe.serve.engine.sampling import SamplingParams

    torch.set_num_threads(1)
    engines: dict[str, LLMEngine] = {}
    for name in args.variants:
        model = load_model(args.preset).eval()
        compiled = name != "eager"
        engine = LLMEngine(model, config=EngineConfig(max_num_seqs=64, compile_decode=compiled,
                                                      compile_form=name.split("-")[0] if compiled else "layers"))
        if name == "layers-2rows":
            engine.runner._compiled_decode.min_rows = 2
        if compiled:
            started = time.process_time()
            engine.warm_up()
            print(f"{name}: warm-up {time.process_time() - started:.1f} CPU s of this process (the C++ builds not counted)",
                  flush=True)
        engines[name] = engine

    best = {name: {batch: float("inf") for batch in (1, 16, 64)} for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            for batch in (1, 16, 64):
                params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
                for i in range(batch):
                    engine.add_request([1 + i, 2, 3, 4], params)
                while any(s.num_computed < len(s.token_ids) - 1 for s in engine.scheduler.running) \
                        or engine.scheduler.waiting:
                    engine.step()  # prefills and the first decode untimed
                started, steps = time.process_time(), 0
                stance = "default" if name == "eager" else "fail_on_recompile"  # the warm-up compiled every class
                with torch.compiler.set_stance(stance):
                    while engine.has_unfinished():
                        engine.step()
                        steps += 1
                best[name][batch] = min(best[name][batch], 1000 * (time.process_time() - started) / steps)
    print(f"\nCPU ms per decode step ({args.preset}, one thread, best of {args.rounds} rounds)")
    print("| variant | batch 1 | batch 16 | batch 64 |\n|---|---|---|---|")
    for name, ms in best.items():
        print(f"| {name} | " + " | ".join(f"{ms[b]:.2f}" for b in (1, 16, 64)) + " |")


if __name__ == "__main__":
    main()
