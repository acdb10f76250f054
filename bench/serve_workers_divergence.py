"""Where a worker layout's greedy output leaves the one-process engine's, and why.

Runs `bench_serve_workers.py`'s workload (`small`, 64 prompts x 128 greedy tokens) on one process
and on `--tp/--ep` workers, and for each sequence that differs prints the first differing output
token and the full-sequence forward's top logits there: a small gap between the two tokens is a
near-tie that a different fp32 summation order flipped; a large one would be a wrong layout.

    .venv/bin/python bench/serve_workers_divergence.py --tp 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve_workers import make_prompts, timed_run  # noqa: E402

from deltamoe import load_model  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.executor.config import WorkerConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.prompts)
    config = dict(cache_memory="2GiB", max_num_seqs=64, max_num_batched_tokens=2048)
    outputs = []
    for tp, ep in ((1, 1), (args.tp, args.ep)):
        engine = LLMEngine.from_pretrained(args.model, EngineConfig(**config), workers=WorkerConfig(tp=tp, ep=ep))
        try:
            outputs.append(timed_run(engine, prompts, args.new_tokens)[2])
        finally:
            engine.shutdown()
    model = load_model(args.model).eval()
    differ = 0
    for i, (one, other) in enumerate(zip(*outputs)):
        if one == other:
            continue
        differ += 1
        j = next(k for k in range(len(one)) if one[k] != other[k])
        with torch.no_grad():
            logits = model(torch.tensor([prompts[i] + one[:j]])).logits[0, -1].double()
        top = torch.topk(logits, 2)
        gap = float(top.values[0] - top.values[1])
        print(f"sequence {i}: first differs at output token {j}: one process {one[j]}, tp{args.tp} x ep{args.ep} "
              f"{other[j]}; full forward's top two {top.indices.tolist()}, {gap:.2e} apart "
              f"({gap / float(top.values[0].abs()):.1e} relative)")
    print(f"{args.prompts - differ} of {args.prompts} sequences equal")


if __name__ == "__main__":
    main()
