"""Where a compiled decode step's time goes, per form of the compiled call, at batch 1, 16 and 64.

The offline benchmark's model (bench_serve_offline.py: a random Kimi Linear, 4 layers) or a preset
(`--preset tiny`) decodes `--steps` steps at each batch size through `LLMEngine.step`, after a
warm-up that compiled every graph. Each phase of the step is timed by the thread's CPU clock
(`time.thread_time`: with one torch thread the compiled kernels run on this thread too, and a
loaded machine's waits count for nothing):

- schedule: `Scheduler.schedule`;
- input prep: `ModelRunner.forward` outside the compiled call (token ids, `PagedBatchView`, the
  two-row copy of batch 1);
- region calls: the compiled regions' calls, entry (dynamo's frame wrapper, guards, gathering the
  inputs, the AOT and inductor wrappers) and compiled code together (the whole call: the graph);
- eager glue: the compiled call outside its regions (embedding, per-layer cache views, the bank,
  norms and residuals between regions, the LM head where eager);
- sampling: `ModelRunner._sample`; postprocess: `LLMEngine._postprocess` (token bookkeeping,
  detokenizer, stop checks, the cache's commit); other: the rest of `LLMEngine.step`.

    OMP_NUM_THREADS=1 .venv/bin/python bench/decode_step_split.py [--preset tiny] [--forms parts layers whole]

Writes bench/results/decode_step_split.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, write_result  # noqa: E402

from deltamoe.model.load import load_model  # noqa: E402
from deltamoe.serve.engine import compiled_regions  # noqa: E402
from deltamoe.serve.engine.compiled_decode import CompiledDecode  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402

PHASES = ("schedule", "input prep", "region calls", "eager glue", "sampling", "postprocess", "other")


class PhaseClock:
    """Thread CPU seconds and calls per phase; `wrap` times a callable into a phase (nested phases
    are subtracted by the caller's arithmetic in `split`; a phase entered again from inside itself,
    as `_postprocess` is for a multi-step window's tokens, counts once)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._depth: dict[str, int] = defaultdict(int)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            self._depth[phase] += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[phase] -= 1
                if not self._depth[phase]:
                    self.seconds[phase] += time.thread_time() - start
                    self.calls[phase] += 1
        return timed


def instrument(engine: LLMEngine, clock: PhaseClock) -> None:
    runner, compiled = engine.runner, engine.runner._compiled_decode
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    runner.forward = clock.wrap("forward", runner.forward)
    runner.sample_rows = clock.wrap("sampling", runner.sample_rows)
    engine._postprocess = clock.wrap("postprocess", engine._postprocess)
    compiled._call = clock.wrap("compiled call", compiled._call)
    if compiled.form == "whole":
        return
    for module in compiled._model.modules():
        region = module.__dict__.get("forward")
        if isinstance(region, (compiled_regions.AttentionRegion, compiled_regions.FFNRegion,
                               compiled_regions.LayerRegionTrunk)):
            region.call = clock.wrap("region calls", region.call)


def split(clock: PhaseClock, total: float, steps: int) -> dict[str, float]:
    s = clock.seconds
    whole = s["region calls"] == 0.0
    parts = {"schedule": s["schedule"], "input prep": s["forward"] - s["compiled call"],
             "region calls": s["compiled call"] if whole else s["region calls"],
             "eager glue": 0.0 if whole else s["compiled call"] - s["region calls"],
             "sampling": s["sampling"], "postprocess": s["postprocess"]}
    parts["other"] = total - sum(parts.values())
    return {name: 1000 * seconds / steps for name, seconds in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=None, help="a preset instead of the offline benchmark's model")
    parser.add_argument("--forms", nargs="+", default=["parts", "layers", "whole"], choices=("parts", "layers", "whole"))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=48, help="timed decode steps per batch size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.preset is None:
        from bench_serve_offline import hf_model

        with tempfile.TemporaryDirectory() as tmp:
            hf_model().save_pretrained(tmp)
            model = load_model(tmp)
    else:
        model = load_model(args.preset).eval()
    results: dict[str, dict[str, dict[str, float]]] = {}
    rows = []
    for form in args.forms:
        engine = LLMEngine(model, config=EngineConfig(cache_memory="1GiB", max_num_seqs=max(args.batches),
                                                      compile_decode=True))
        engine.runner._compiled_decode = CompiledDecode(model, form=form)
        engine.warm_up()
        clock = PhaseClock()
        instrument(engine, clock)
        results[form] = {}
        for batch in args.batches:
            params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                engine.add_request([1 + i % 200, 2, 3, 4, 5], params)
            while any(s.num_computed < len(s.token_ids) - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
                engine.step()  # prefills and the first decode, untimed
            clock.seconds.clear()
            start, steps = time.thread_time(), 0
            with torch.compiler.set_stance("fail_on_recompile"):
                while engine.has_unfinished():
                    engine.step()
                    steps += 1
            total = time.thread_time() - start
            phases = split(clock, total, steps)
            results[form][str(batch)] = {"step_ms": 1000 * total / steps, **phases}
            rows.append([form, str(batch), f"{1000 * total / steps:.2f}", *(f"{phases[p]:.2f}" for p in PHASES)])
            print(rows[-1], flush=True)
    print(markdown_table(["form", "batch", "step ms", *PHASES], rows))
    path = write_result("decode_step_split" + (f"_{args.preset}" if args.preset else ""), {
        "config": {"model": args.preset or "offline benchmark (Kimi Linear, 4 layers)", "steps": args.steps,
                   "clock": "thread CPU", "threads": 1},
        "ms_per_step": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
