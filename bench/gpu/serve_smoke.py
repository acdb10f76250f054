"""GPU smoke check of the serving executors, for when a CUDA device is lent: one GPU, under 5 minutes.

    python bench/gpu/serve_smoke.py --device cuda [--model tiny]

On one CUDA GPU, with the `tiny` preset (seeded random weights) in float32:
1. the one-process engine (`UniprocExecutor`) generates greedy tokens for 8 prompts: the reference;
2. the multi-process executor at tp 1 (`start_replica`: a one-rank replica whose process group is
   gloo for control and NCCL for CUDA tensors, as `deltamoe serve --tp N` builds it) must give the
   same tokens; an NCCL all-reduce on the group proves the NCCL communicator works; the same replica
   with async scheduling (rank 0's device thread broadcasting each step and its sampled ids over
   NCCL, `MultiprocExecutor.execute_ahead`) must give them too;
3. async scheduling (`EngineConfig(async_scheduling=True)`) on CUDA must give the one-step engine's
   tokens, greedy and seeded sampling with stop tokens, and the script prints both engines' output
   tokens/s on 32 prompts x 64 tokens (informational: no pass mark).
Any difference or error exits non-zero with a message saying which check failed; the last line is
"serve smoke: OK" when every check passed. `--device cpu` runs the same checks on a CPU (gloo only).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch


def fail(message: str) -> None:
    print(f"serve smoke: FAILED: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(4, 40, (n,), generator=g)]


def tokens(engine, ps, params) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(ps, params, progress=False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="tiny", help="preset or checkpoint folder")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {args.device} but torch sees no CUDA device (torch {torch.__version__})")

    import torch.distributed as dist

    from deltamoe.model.load import load_model
    from deltamoe.serve.engine.config import EngineConfig
    from deltamoe.serve.engine.llm_engine import LLMEngine
    from deltamoe.serve.engine.sampling import SamplingParams
    from deltamoe.serve.executor.config import WorkerConfig
    from deltamoe.serve.executor.launch import start_replica
    from deltamoe.serve.executor.multiproc import MultiprocExecutor

    start = time.perf_counter()
    config = EngineConfig(cache_memory="256MiB", max_num_seqs=32, max_num_batched_tokens=1024)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ps = prompts(8, seed=1)
    print(f"device {args.device}: {torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}; "
          f"model {args.model}", flush=True)

    # 1. one process: the reference
    model = load_model(args.model, device=args.device)
    one = LLMEngine(model, config=config)
    reference = tokens(one, ps, greedy)
    if any(len(t) != 16 for t in reference):
        fail("the one-process engine returned short outputs")
    print(f"[1/3] one process: {len(ps)} prompts x 16 greedy tokens", flush=True)

    # 2. the multi-process executor, one rank, NCCL for CUDA tensors
    started = start_replica(args.model, config, WorkerConfig(), torch.float32, args.device)
    if started is None:
        fail("start_replica returned no shard on rank 0")
    shard, group = started
    probe = torch.ones(1, device=group.device)
    dist.all_reduce(probe)  # NCCL on CUDA (gloo on a CPU): fails here if the communicator cannot start
    if probe.item() != 1.0:
        fail(f"all-reduce over one rank gave {probe.item()}, expected 1.0")
    replica = LLMEngine(shard, config=config, group=group)
    replica_ahead = LLMEngine(shard, config=dataclasses.replace(config, async_scheduling=True), group=group)
    try:
        if not isinstance(replica.executor, MultiprocExecutor):
            fail(f"expected the multi-process executor, got {type(replica.executor).__name__}")
        backend = dist.get_backend()
        got = tokens(replica, ps, greedy)
        got_ahead = tokens(replica_ahead, ps, greedy)
    finally:
        replica_ahead.shutdown()
        replica.shutdown()
    for name, out in (("", got), (" with async scheduling", got_ahead)):
        if out != reference:
            fail(f"multi-process executor{name} (tp 1, backend {backend}) differs from one process: "
                 f"{sum(a != b for a, b in zip(out, reference))} of {len(ps)} prompts")
    print(f"[2/3] multi-process executor, tp 1, backend {backend}: same greedy tokens, async scheduling too",
          flush=True)

    # 3. async scheduling on this device
    overlapped = LLMEngine(model, config=dataclasses.replace(config, async_scheduling=True))
    mixed = [SamplingParams(max_tokens=4 + i % 12, temperature=0.8 if i % 2 else 0.0, seed=i, stop_token_ids=[7])
             for i in range(len(ps))]
    for name, params in (("greedy", greedy), ("seeded sampling with stops", mixed)):
        ahead, step = tokens(overlapped, ps, params), tokens(one, ps, params)
        if ahead != step:
            fail(f"async scheduling differs from one step at a time ({name}): "
                 f"{sum(a != b for a, b in zip(ahead, step))} of {len(ps)} prompts")
    many, long = prompts(32, seed=2), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rates = {}
    for name, engine in (("one step at a time", one), ("async scheduling", overlapped)):
        tokens(engine, many[:4], greedy)  # warm-up
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = tokens(engine, many, long)
        rates[name] = sum(map(len, out)) / (time.perf_counter() - t0)
    overlapped.shutdown()
    print(f"[3/3] async scheduling: same tokens (greedy, seeded sampling with stops); 32 x 64 tokens: "
          + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in rates.items()), flush=True)
    print(f"serve smoke: OK in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
