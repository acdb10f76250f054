"""Compiled decode's first start: wall and CPU time of `LLMEngine.warm_up`, per graph class.

CPU time is the process's and its children's (inductor's C++ compiler runs) user + system time
(`os.times()`), so the figure means something on a shared machine too; wall time is only
meaningful on a quiet one. Each run uses a fresh, empty inductor cache directory (a first start)
unless `--keep-cache DIR` names one (run twice with the same DIR to time a start from the disk
cache). Then the decode step's CPU time per step at batch 1 and `--batch`, compiled, after the warm-up.

    TORCHINDUCTOR_COMPILE_THREADS=1 .venv/bin/python bench/bench_compile_start.py [--preset tiny] [--threads 2]
        [--no-cpp-wrapper]

To compare two checkouts, run the same script with PYTHONPATH set to each, one after the other.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="the batched step's rows")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument("--keep-cache", default=None, help="inductor cache directory (default: a fresh one)")
    parser.add_argument("--no-cpp-wrapper", action="store_true",
                        help="compile with inductor's Python launcher instead of the C++ wrapper, to compare")
    parser.add_argument("--quick", action="store_true", help="4 sequences at most, 4 timed steps (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.max_num_seqs, args.batch, args.steps = 4, 4, 4
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.keep_cache or tempfile.mkdtemp(prefix="inductor-")

    import torch  # after the cache directory is set: inductor reads it on import

    from deltamoe import load_model
    from deltamoe.serve.engine.config import EngineConfig
    from deltamoe.serve.engine.llm_engine import LLMEngine
    from deltamoe.serve.engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    if args.no_cpp_wrapper:  # the option compiled_decode passes, overridden for this run only
        compile_ = torch.compile

        def without_cpp_wrapper(fn, **kwargs):
            return compile_(fn, **{**kwargs, "options": {**kwargs.get("options", {}), "cpp_wrapper": False}})

        torch.compile = without_cpp_wrapper
    model = load_model(args.preset).eval()
    engine = LLMEngine(model, config=EngineConfig(compile_decode=True, max_num_seqs=args.max_num_seqs))
    run_round = engine._run_warm_up_round

    def timed(round_) -> None:
        wall, cpu = time.perf_counter(), cpu_seconds()
        run_round(round_)
        print(f"  {round_.graph}: wall {time.perf_counter() - wall:.1f} s, cpu {cpu_seconds() - cpu:.1f} s", flush=True)

    engine._run_warm_up_round = timed
    print(f"warm-up of {args.preset} (torch threads {args.threads}, compile threads "
          f"{os.environ.get('TORCHINDUCTOR_COMPILE_THREADS', 'default')}):")
    wall, cpu = time.perf_counter(), cpu_seconds()
    engine.warm_up()
    print(f"total: wall {time.perf_counter() - wall:.1f} s, cpu {cpu_seconds() - cpu:.1f} s", flush=True)

    for batch in (1, args.batch):
        params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request([1 + i, 2, 3, 4], params)
        while any(s.num_computed < len(s.token_ids) - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefills and the first decode untimed
        cpu, steps = cpu_seconds(), 0
        with torch.compiler.set_stance("fail_on_recompile"):  # the warm-up compiled every class
            while engine.has_unfinished():
                engine.step()
                steps += 1
        print(f"decode step, batch {batch}: cpu {1000 * (cpu_seconds() - cpu) / steps:.2f} ms over {steps} steps")


if __name__ == "__main__":
    main()
