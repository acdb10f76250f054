"""RL weight sync: seconds to push a policy into a serving engine vs model size (tiny, small, K3-shaped
tensors), bucketed vs per-tensor, and rollout tokens/s inside the GRPO loop vs the engine alone.

- in-process: a colocated trainer hands its tensors to the engine (stage, then swap);
- gloo: the trainer broadcasts over a `TransferGroup` to an engine receiving in another thread (the
  same TCP loopback path as two processes on one host), 512 MiB buckets vs one tensor per broadcast;
- K3-shaped: random bf16 tensors with the shapes of one Kimi K3 MoE layer (cut to `--k3-bytes`: one
  such layer alone is 60 GB), transport only (no engine holds a K3 layer on a CPU); the whole-model figure is
  that throughput applied to K3's bf16 bytes (an extrapolation, labelled as one);
- rollouts: tokens/s of the loop's rollout phase (`deltamoe rl`, tiny) vs the same requests on the
  engine alone.
Run: python bench/bench_rl_weight_sync.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, result_name, write_result  # noqa: E402

from deltamoe.config import ModelConfig, load_preset  # noqa: E402
from deltamoe.model.load import build_model  # noqa: E402
from deltamoe.model.model import DeltaMoEForCausalLM  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.weight_transfer import (DEFAULT_BUCKET_BYTES, TransferGroup, bucket_sizes, layout,  # noqa: E402
                                                   plan_buckets, unpack)
from deltamoe.serve.engine.weight_update import WeightUpdater  # noqa: E402
from deltamoe.train.rl.weight_push import policy_tensors, push_in_process, send_over_group, specs_of  # noqa: E402

PER_TENSOR = 0  # bucket_bytes <= 0: one broadcast per tensor


def _engine(model: DeltaMoEForCausalLM) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(cache_memory="64MiB", max_num_seqs=4))


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _pair() -> tuple[TransferGroup, TransferGroup]:
    trainer = TransferGroup("127.0.0.1", 0, 0, 2)
    engine = TransferGroup("127.0.0.1", trainer.port, 1, 2)
    joined = threading.Thread(target=engine.connect)
    joined.start()
    trainer.connect()
    joined.join()
    return trainer, engine


def sync_seconds(config: ModelConfig, repeats: int) -> dict:
    trainer = build_model(config, seed=1)
    engine = _engine(build_model(config, seed=2).eval())
    updater = WeightUpdater(engine)
    tensors = policy_tensors(trainer)
    out = {"params": sum(t.numel() for t in trainer.parameters()), "bytes": _nbytes(tensors), "tensors": len(tensors)}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        push_in_process(updater, policy_tensors(trainer))
        times.append(time.perf_counter() - t0)
    out["in_process_s"] = statistics.median(times)
    sender, receiver = _pair()
    updater.group = receiver
    for label, bucket in (("gloo_bucketed_s", DEFAULT_BUCKET_BYTES), ("gloo_per_tensor_s", PER_TENSOR)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            updater.start_weight_update()
            engine_side = threading.Thread(target=updater.update_weights, args=(specs_of(tensors), bucket))
            engine_side.start()
            send_over_group(sender, tensors, bucket)
            engine_side.join()
            updater.finish_weight_update()
            times.append(time.perf_counter() - t0)
        out[label] = statistics.median(times)
    assert all(torch.equal(engine.runner.model.state_dict()[k], v) for k, v in trainer.state_dict().items())
    return out


def k3_tensors(budget: int) -> tuple[dict[str, torch.Tensor], int]:
    """Random bf16 tensors shaped like K3's first MoE layer, in state-dict order until `budget` bytes (the
    tensor that would overflow it cut to fewer rows: the same row width, so the same bytes per row); and
    the bf16 bytes of the whole K3 model (from a meta-device build)."""
    config = load_preset("kimi-k3").replace(num_nextn_predict_layers=0)
    with torch.device("meta"):
        whole = DeltaMoEForCausalLM(config).state_dict()
    total = sum(t.numel() for t in whole.values()) * 2
    layer = f"model.layers.{config.first_k_dense_replace}."
    out, left = {}, budget
    for name, t in whole.items():
        if not name.startswith(layer) or left <= 0:
            continue
        shape = list(t.shape)
        row = torch.Size(shape[1:]).numel() * 2
        shape[0] = max(1, min(shape[0], left // max(row, 1)))
        out[name] = torch.randn(shape, dtype=torch.bfloat16)
        left -= torch.Size(shape).numel() * 2
    return out, total


def k3_transport(budget: int, repeats: int) -> dict:
    tensors, total = k3_tensors(budget)
    specs = specs_of(tensors)
    sender, receiver = _pair()

    def receive(bucket_bytes: int) -> None:
        for bucket in plan_buckets(specs, bucket_bytes):
            part = [specs[i] for i in bucket]
            buffer = torch.empty(layout(part)[1], dtype=torch.uint8)
            receiver.broadcast(buffer, src=0)
            for t in unpack(buffer, part):
                t.clone()  # the stage copy an engine makes

    out = {"bytes": _nbytes(tensors), "tensors": len(tensors), "k3_bf16_bytes": total}
    for label, bucket in (("bucketed", DEFAULT_BUCKET_BYTES), ("per_tensor", PER_TENSOR)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine_side = threading.Thread(target=lambda b=bucket: (receiver.agree(True, bucket_sizes(specs, b)),
                                                                    receive(b)))
            engine_side.start()
            send_over_group(sender, tensors, bucket)
            engine_side.join()
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        out[f"gloo_{label}_s"] = seconds
        out[f"gloo_{label}_gb_per_s"] = out["bytes"] / seconds / 1e9
        out[f"k3_whole_model_{label}_s_extrapolated"] = total / (out["bytes"] / seconds)
    return out


def rollout_throughput(steps: int, prompts: int, group: int) -> dict:
    from deltamoe.serve.engine.sampling import SamplingParams
    from deltamoe.train.rl.config import RLConfig
    from deltamoe.train.rl.loop import RLRun

    with tempfile.TemporaryDirectory() as tmp:
        run = RLRun(RLConfig(preset="tiny", steps=steps, prompts_per_step=prompts, group_size=group, eval_every=0,
                             eval_prompts=8, save_every=0, out=tmp, progress=False, plot=False,
                             threads=torch.get_num_threads()))
        result = run.run()
        in_loop = [r["tokens_per_s"] for r in result.records if r["step"] > 0]
        # The same requests (the last step's prompts, G seeded samples each) on the engine alone.
        batch = run.prompts.batch("train", (steps - 1) * prompts, prompts)
        params = [SamplingParams(**{**vars(run.params(p, 1.0, logprobs=0)), "seed": i * group + j})
                  for i, p in enumerate(batch) for j in range(group)]
        ids = [p.token_ids for p in batch for _ in range(group)]
        times, tokens = [], 0
        for _ in range(3):
            t0 = time.perf_counter()
            done = run.engine.generate(ids, params, progress=False)
            times.append(time.perf_counter() - t0)
            tokens = sum(len(c.token_ids) for c in done)
    alone = tokens / statistics.median(times)
    loop = statistics.median(in_loop)
    return {"steps": steps, "prompts_per_step": prompts, "group_size": group, "in_loop_tokens_per_s": loop,
            "engine_alone_tokens_per_s": alone, "in_loop_vs_alone": loop / alone}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny only, a 64 MiB K3 slice, two loop steps")
    ap.add_argument("--k3-bytes", type=int, default=1 << 30, help="bytes of K3-shaped tensors to move")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 1 if args.quick else 3
    presets = ["tiny"] if args.quick else ["tiny", "small"]
    sizes = {name: sync_seconds(load_preset(name), repeats) for name in presets}
    k3 = k3_transport(64 << 20 if args.quick else args.k3_bytes, repeats)
    rollouts = rollout_throughput(2 if args.quick else 6, 4 if args.quick else 8, 8)
    rows = [[name, f"{d['params'] / 1e6:.1f} M", f"{d['bytes'] / 2**20:.0f} MiB", f"{d['in_process_s']:.3f}",
             f"{d['gloo_bucketed_s']:.3f}", f"{d['gloo_per_tensor_s']:.3f}"] for name, d in sizes.items()]
    rows.append([f"K3-shaped ({k3['tensors']} tensors of an MoE layer)", "", f"{k3['bytes'] / 2**20:.0f} MiB", "",
                 f"{k3['gloo_bucketed_s']:.3f}", f"{k3['gloo_per_tensor_s']:.3f}"])
    print(markdown_table(["model", "params", "bytes", "in-process s", "gloo bucketed s", "gloo per-tensor s"], rows))
    print(f"K3 whole model (bf16, {k3['k3_bf16_bytes'] / 2**40:.2f} TiB) at the measured gloo rate: "
          f"{k3['k3_whole_model_bucketed_s_extrapolated']:,.0f} s bucketed (extrapolated)")
    print(f"rollout tokens/s: in the loop {rollouts['in_loop_tokens_per_s']:,.0f}, engine alone "
          f"{rollouts['engine_alone_tokens_per_s']:,.0f} ({rollouts['in_loop_vs_alone']:.2f}x)")
    path = write_result(result_name("rl_weight_sync", args.quick),
                        {"quick": args.quick, "sizes": sizes, "k3_shaped": k3, "rollouts": rollouts,
                         "bucket_bytes": DEFAULT_BUCKET_BYTES})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
