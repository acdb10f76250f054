"""Training tokens/s: deltamoe's train step vs transformers KimiLinearForCausalLM, same config,
same weights, same batch, AdamW on both; CPU, fp32.

hidden 256, 8 layers (6 KDA + 2 MLA, MoE 16 experts top-4), batch 8 x 512. The transformers
model is built with random weights, saved with save_pretrained and loaded by deltamoe's
`load_model`, so both start from the same numbers. deltamoe runs its own training step
(`TrainStep`: LocalModel forward/backward, clipping, AdamW, router-bias update); transformers
runs forward(labels) / backward / clip / AdamW. The two alternate step by step so machine
noise hits both alike. `--profile` prints the top ops of one deltamoe step.
Run: python bench/bench_train_throughput.py [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_model_forward import kimi_linear_config  # noqa: E402  (the same model as the forward bench)
from common import markdown_table, result_name, write_result  # noqa: E402


def deltamoe_step(model, cfg):
    from deltamoe.parallel import LocalModel
    from deltamoe.train.optim import Optimizers
    from deltamoe.train.step import TrainStep

    pm = LocalModel(model)
    optimizers = Optimizers(pm.model_parts, cfg.optim, total_steps=1000)
    return TrainStep(pm, optimizers, None, cfg, torch.device("cpu"))


def transformers_step(model, cfg):
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                            weight_decay=cfg.optim.weight_decay)

    def step(ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch 2 x 256, 2 timed steps")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per model (after one warmup)")
    ap.add_argument("--profile", action="store_true", help="print the top ops of one deltamoe step")
    args = ap.parse_args()
    torch.set_num_threads(2)
    import transformers

    from deltamoe.model.load import load_model
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.data.rows import Rows

    batch, seq = (2, 256) if args.quick else (8, 512)
    steps = 2 if args.quick else args.steps
    cfg = TrainConfig.from_dict({"optim": {"lr": 1e-4, "warmup_steps": 0}})
    torch.manual_seed(0)
    ref = transformers.KimiLinearForCausalLM(kimi_linear_config(transformers)).train()
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        ours = load_model(Path(d)).train()
    ids = torch.randint(3, 4096, (batch, seq), generator=torch.Generator().manual_seed(1))
    ours_step, ref_step = deltamoe_step(ours, cfg), transformers_step(ref, cfg)
    rows = [Rows(ids, ids)]

    first = (ours_step(1, rows)["loss"], ref_step(ids))  # warmup, and the same starting loss
    t_ours, t_ref = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        ours_step(2 + s, rows)
        t_ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref_step(ids)
        t_ref.append(time.perf_counter() - t0)
    mo, mr = statistics.median(t_ours), statistics.median(t_ref)
    tokens = batch * seq
    result = {"batch": batch, "seq_len": seq, "hidden": 256, "layers": 8, "steps": steps,
              "first_loss": {"deltamoe": first[0], "transformers": first[1]},
              "step_s": {"deltamoe": t_ours, "transformers": t_ref},
              "tokens_per_s": {"deltamoe": tokens / mo, "transformers": tokens / mr}, "speedup": mr / mo,
              "target": {"speedup": 1.5}}
    path = write_result(result_name("train_throughput", args.quick), result)
    table = [["deltamoe (TrainStep)", f"{tokens / mo:,.0f}", f"{mo:.2f}", f"{mr / mo:.2f}x"],
             ["transformers KimiLinear (torch fallbacks)", f"{tokens / mr:,.0f}", f"{mr:.2f}", "1.00x"]]
    print(markdown_table([f"train step, hidden 256, 8 layers, {batch}x{seq}, AdamW", "tokens/s", "s/step",
                          "speedup"], table))
    print(f"first-step loss: deltamoe {first[0]:.5f}, transformers {first[1]:.5f}; results: {path}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ours_step(100, rows)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
