"""Compiled int4 (W4A16) decode at a few batch sizes, with the expert stacks' many-row form chosen
by the budget (`ops.int4_experts.all_experts_budget`: every expert on every row up to it, the
expert-by-expert loop as one op past it) against every expert on every row at any batch (the
form before the budget).

A random-weight preset is saved and quantized (int4, group 128) under `--work-dir` once; each
form then runs `--batch` requests of 16 prompt tokens and `--new-tokens` greedy tokens through a
compiled engine (one warm-up run compiles, the best of `--rounds` timed runs counts). Prints
output tokens/s per form and batch and the ratio.

    python bench/int4_expert_forms.py [--preset small] [--batches 16,32,64] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from deltamoe.config import load_preset
from deltamoe.model.load import build_model, load_model
from deltamoe.model.quant_scheme import make_scheme
from deltamoe.model.weights import save_checkpoint
from deltamoe.ops import int4_experts
from deltamoe.ops.moe import static_expert_form
from deltamoe.quantize.checkpoint import quantize_checkpoint
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams

EVERY_EXPERT = 1 << 60  # a per-thread budget no batch reaches: the form before


def int4_checkpoint(preset: str, work_dir: Path) -> Path:
    out = work_dir / f"{preset}-int4"
    if not (out / "config.json").exists():
        save_checkpoint(build_model(load_preset(preset), seed=0).eval(), work_dir / f"{preset}-fp32")
        quantize_checkpoint(work_dir / f"{preset}-fp32", out, make_scheme("int4", 128), dtype=torch.float32)
    return out


def tokens_per_second(model, batch: int, new_tokens: int, rounds: int) -> float:
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, model.config.vocab_size, (16,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(model, config=EngineConfig(cache_memory="512MiB", compile_decode=True, max_num_seqs=batch))
    engine.generate(prompts, params, progress=False)  # compiles this batch's graphs
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, progress=False)
        best = min(best, time.perf_counter() - start)
    return sum(len(c.token_ids) for c in outputs) / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batches", default="16,32,64", help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "deltamoe-int4-expert-forms")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(int4_checkpoint(args.preset, args.work_dir))
    budget = int4_experts.ALL_EXPERTS_EXTRA_MACS_PER_EXPERT_PER_THREAD
    results: dict[tuple[str, int], float] = {}
    for form, per_thread in (("every expert", EVERY_EXPERT), ("budget", budget)):
        int4_experts.ALL_EXPERTS_EXTRA_MACS_PER_EXPERT_PER_THREAD = per_thread  # bound as each engine starts
        torch._dynamo.reset()
        for batch in map(int, args.batches.split(",")):
            results[form, batch] = tokens_per_second(model, batch, args.new_tokens, args.rounds)
            print(f"{form}, batch {batch}: {results[form, batch]:.1f} tok/s", flush=True)
    int4_experts.ALL_EXPERTS_EXTRA_MACS_PER_EXPERT_PER_THREAD = budget
    c = model.config
    for batch in map(int, args.batches.split(",")):
        form = static_expert_form(batch, c.num_experts_per_token, c.num_experts, c.expert_dim,
                                  c.moe_intermediate_size, int4_experts.all_experts_budget())
        print(f"batch {batch} ({form} under the budget at {args.threads} threads): "
              f"{results['budget', batch] / results['every expert', batch]:.2f}x every expert")


if __name__ == "__main__":
    main()
