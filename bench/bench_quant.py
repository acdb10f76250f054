"""Quantized execution on the CPU, side by side: fp32, bf16, int4 weight-only, W4A8 (fp8 and int8
activations) and MXFP4 experts.

Speed and memory: the `small` preset (random weights, ~0.5 B-class shape at 512 wide) is
quantized with `deltamoe quantize`'s code (group 128), loaded with `load_model`, and one
prompt is decoded greedily at batch 1 through `LLMEngine` (EOS ignored); decode tokens/s is
the generated tokens over the time after the first token, best of alternating rounds over all
formats (one torch thread). Resident weight bytes count every
parameter, buffer and packed weight the model holds. Two int4 rows: the unquantized rest
(embeddings, norms, lm_head, the Linears the scheme skips) in bf16, as published int4
checkpoints store it, and the same weights with that rest in fp32 (a CPU without fast bf16
matmuls runs it faster); both are compared with fp32 and with bf16, and the goal is 2x the
faster of the two. `--compile` adds the same rows decoded through the compiled regions
(`EngineConfig.compile_decode`, the default of `generate`/`serve`) for the formats that have a
compiled form (fp32, bf16, int4 W4A16), each compared with the compiled fp32 and bf16 rows. The
compiled engine runs batch 1 of `small` (fp32, bf16 and int4 alike) as one row through graphs of
its own (serve/engine/compiled_decode.py, `batch_one_rows`); fp32 and bf16 are also timed with
batch 1 as two copies of its row (`compiled, two rows`: how the engine ran them before), and
every row is read against eager fp32 too.

Accuracy: a trained checkpoint (`--checkpoint`, with the `--train-config` of its run; default:
the tiny model trained here for `--train-steps` steps on the recall task) is quantized per
format (group 32, so the tiny model's 96-wide experts are quantized too; unquantized tensors
kept fp32) and scored on its held-out task rows: logit error against the fp32 model, eval
loss / perplexity delta, argmax agreement and task accuracy (bound: within 0.02 of fp32).

KV cache: latent-KV + indexer-key bytes per token, bf16 pages vs `--kv-cache-dtype fp8`.

    .venv/bin/python bench/bench_quant.py [--quick] [--formats int4,int4-rest-fp32]
                                          [--checkpoint DIR --train-config JSON] [--speed-only]
                                          [--clock wall|cpu] [--compile]
    .venv/bin/python bench/bench_quant.py --speed-only --preset medium --formats int4 --compile
        # the speed rows on a width where weight reads dominate a batch-1 step: quant_speed_medium.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, markdown_table, result_name, write_result  # noqa: E402

from deltamoe.model.load import load_model  # noqa: E402
from deltamoe.model.quant_scheme import make_scheme  # noqa: E402
from deltamoe.model.quantize_modules import resident_weight_bytes  # noqa: E402
from deltamoe.ops import int4_matvec  # noqa: E402
from deltamoe.quantize.checkpoint import quantize_checkpoint  # noqa: E402
from deltamoe.serve.engine.config import COMPILE_FORMS, EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402

# key: (label, format args for make_scheme or None for float, dtype of the unquantized rest)
SPEED_FORMATS = {
    "fp32": ("fp32", None, torch.float32),
    "bf16": ("bf16", None, torch.bfloat16),
    "int4": ("int4 (W4A16)", ("int4", None, None), torch.bfloat16),
    "int4-rest-fp32": ("int4 (W4A16), rest fp32", ("int4", None, None), torch.float32),
    # The same int4 model with one-row matmuls on torch's kernel (ops.int4_matvec turned off): the
    # form before our one-row kernel, timed beside it.
    "int4-torch-kernel": ("int4 (W4A16), torch's kernel", ("int4", None, None), torch.bfloat16),
    "w4a8-fp8": ("w4a8 fp8", ("w4a8", None, "fp8"), torch.bfloat16),
    "w4a8-int8": ("w4a8 int8", ("w4a8", None, "int8"), torch.bfloat16),
    "mxfp4": ("mxfp4 experts", ("mxfp4", None, None), torch.bfloat16),
}
BASELINES = ("fp32", "bf16")  # always timed
COMPILED_FORMATS = ("fp32", "bf16", "int4", "int4-rest-fp32", "int4-torch-kernel")
TORCH_KERNEL = SPEED_FORMATS["int4-torch-kernel"][0]  # the formats compiled decode runs
TWO_ROWS = "compiled, two rows"  # the baselines' compiled batch 1 as two copies of its row (`decode_rate`)
ACCURACY_FORMATS = [("int4", ("int4", 32, None)), ("w4a8 fp8", ("w4a8", 32, "fp8")),
                    ("w4a8 int8", ("w4a8", 32, "int8")), ("mxfp4 experts", ("mxfp4", None, None))]


def decode_rate(model, new_tokens: int, rounds: int, clock=time.perf_counter, compiled: bool = False,
                two_rows: bool = False, form: str = COMPILE_FORMS[0]) -> float:
    """Batch-1 greedy decode tokens/s: (new_tokens - 1) over the time a `new_tokens` run takes
    beyond a 1-token run (prefill and first token), best of `rounds`. `clock`: wall time, or
    `time.process_time` (this process's CPU time: on a loaded machine it leaves out the time
    other processes hold the core). `compiled`: through the compiled decode regions (compiled
    by the warm-up run; a process keeps them for later engines on the same model). `two_rows`: the
    compiled batch 1 as two copies of its row (`CompiledDecode.min_rows` = 2, sharing the batches'
    graphs) instead of the one row the engine runs: the form before, for comparison."""
    engine = LLMEngine(model, config=EngineConfig(cache_memory="64MiB", max_num_seqs=1, compile_decode=compiled,
                                                  compile_form=form))
    if two_rows:
        engine.runner._compiled_decode.min_rows = 2
    prompt = [256] + list(range(65, 65 + 15))

    def run(n: int) -> float:
        t0 = clock()
        engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), progress=False)
        return clock() - t0

    run(2)  # warm-up
    return max((new_tokens - 1) / (run(new_tokens) - run(1)) for _ in range(rounds))


def speed(preset: str, new_tokens: int, rounds: int, tmp: Path, keys: list[str], clock=time.perf_counter,
          compiled_keys: tuple[str, ...] = (), form: str = COMPILE_FORMS[0]) -> list[dict]:
    """The formats `keys` names loaded side by side, then timed in alternating rounds (best of
    `rounds` each), so a shared machine's load swings reach every format alike; `compiled_keys`
    are timed again through the compiled decode regions, compared with the compiled baselines."""
    formats = [SPEED_FORMATS[k] for k in keys]
    models = {}
    for key, (label, fmt, dtype) in zip(keys, formats):
        if fmt is None:
            models[label] = load_model(preset, dtype=dtype)
        else:
            path = tmp / key
            quantize_checkpoint(preset, path, make_scheme(*fmt), dtype=dtype)
            models[label] = load_model(path, dtype=dtype)
    # Decode modes: eager; compiled (batch 1 as the engine runs it); the baselines compiled with
    # batch 1 as two copies of its row (the form before `batch_one_rows`).
    runs = [(label, "eager") for label in models] + [(SPEED_FORMATS[k][0], "compiled") for k in keys
                                                     if k in compiled_keys]
    if compiled_keys:
        runs += [(SPEED_FORMATS[k][0], TWO_ROWS) for k in BASELINES]
    best = {run: 0.0 for run in runs}
    for r in range(rounds):
        for label, mode in runs:
            # (a compiled graph keeps the form it was traced with: this model's graphs are its own)
            with int4_matvec.turned_off() if label == TORCH_KERNEL else contextlib.nullcontext():
                rate = decode_rate(models[label], new_tokens, 1, clock, mode != "eager", mode == TWO_ROWS, form)
            best[label, mode] = max(best[label, mode], rate)
            print(f"round {r}: {label} {mode} {best[label, mode]:.2f} tok/s", flush=True)
    dtypes = {label: dtype for label, _, dtype in formats}
    rows = [{"format": label, "decode": mode,
             "rest_dtype": str(dtypes[label]).removeprefix("torch."), "decode_tok_s": round(best[label, mode], 2),
             "weight_bytes": resident_weight_bytes(models[label])} for label, mode in runs]
    base = {(r["format"], r["decode"]): r for r in rows}
    for r in rows:
        r["speedup_vs_bf16"] = round(r["decode_tok_s"] / base["bf16", r["decode"]]["decode_tok_s"], 2)
        r["speedup_vs_fp32"] = round(r["decode_tok_s"] / base["fp32", r["decode"]]["decode_tok_s"], 2)
        r["speedup_vs_fp32_eager"] = round(r["decode_tok_s"] / base["fp32", "eager"]["decode_tok_s"], 2)
        r["memory_vs_bf16"] = round(r["weight_bytes"] / base["bf16", "eager"]["weight_bytes"], 3)
    return rows


def kv_cache_bytes() -> list[dict]:
    """Latent-KV + indexer-key bytes per token of context: bf16 pages vs fp8 (e4m3 + per-tile scales)."""
    from deltamoe.config import load_preset
    from deltamoe.serve.engine.cache_layout import CacheLayout

    rows = []
    for preset in ("small", "kimi-k3", "kimi-k3.1-pro"):
        config = load_preset(preset)
        bf16 = CacheLayout.from_config(config, dtype=torch.bfloat16).bytes_per_token
        fp8 = CacheLayout.from_config(config, dtype=torch.bfloat16, kv_fp8=True).bytes_per_token
        rows.append({"preset": preset, "bf16_bytes_per_token": bf16, "fp8_bytes_per_token": fp8,
                     "fp8_vs_bf16": round(fp8 / bf16, 4)})
    return rows


def train_tiny(steps: int, out: Path) -> tuple[Path, Path]:
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.trainer import train

    settings = {"model": {"preset": "tiny"},
                "data": {"task": "recall", "num_pairs": 8, "num_queries": 8, "seq_len": 40, "batch_size": 32,
                         "eval_rows": 128},
                "optim": {"lr": 3e-3, "warmup_steps": 20, "min_lr_ratio": 0.1},
                "run": {"steps": steps, "eval_every": steps, "threads": 2, "out": str(out)}}
    cfg = TrainConfig.from_dict(settings).validate()
    train(cfg)
    config_file = out / "bench_train_config.json"
    config_file.write_text(json.dumps(settings))
    return out / "model", config_file


@torch.no_grad()
def accuracy(checkpoint: Path, train_config: Path, tmp: Path) -> list[dict]:
    from deltamoe.hf_config import load_config
    from deltamoe.train.config import TrainConfig
    from deltamoe.train.data import build_data
    from deltamoe.train.evaluate import evaluate, next_token_logits, summarize

    settings = json.loads(Path(train_config).read_text())
    cfg = TrainConfig.from_dict(settings).validate()
    data = build_data(cfg, load_config(checkpoint))
    rows_eval = data.rows("eval", 0, data.eval_rows)

    def score(model) -> tuple[dict, torch.Tensor]:
        s = summarize(evaluate(model, data, 0, 1, batch_rows=32), data.scores_answers)
        return s, next_token_logits(model, rows_eval.input_ids).float()

    ref_model = load_model(checkpoint)
    ref, ref_logits = score(ref_model)
    out = [{"format": "fp32", "loss": round(ref["loss"], 4), "ppl": round(math.exp(ref["loss"]), 4),
            "accuracy": ref["accuracy"], "weight_bytes": resident_weight_bytes(ref_model)}]
    for label, fmt in ACCURACY_FORMATS:
        path = tmp / ("acc-" + label.replace(" ", "-"))
        quantize_checkpoint(checkpoint, path, make_scheme(*fmt), dtype=torch.float32)
        model = load_model(path)
        s, logits = score(model)
        err = logits - ref_logits
        out.append({"format": label, "loss": round(s["loss"], 4), "ppl": round(math.exp(s["loss"]), 4),
                    "ppl_delta": round(math.exp(s["loss"]) - math.exp(ref["loss"]), 4),
                    "accuracy": s["accuracy"],
                    "accuracy_delta": None if s["accuracy"] is None else round(s["accuracy"] - ref["accuracy"], 4),
                    "logit_max_abs_err": round(err.abs().max().item(), 4),
                    "logit_rms_err_rel": round((err.pow(2).mean().sqrt() / ref_logits.pow(2).mean().sqrt()).item(), 4),
                    "argmax_agreement": round((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(), 4),
                    "weight_bytes": resident_weight_bytes(model)})
        print(out[-1], flush=True)
    return out


def kept_accuracy(name: str) -> tuple[list[dict], str | None]:
    """The accuracy rows and their source from the results file `name` (`--skip-accuracy`: a speed
    rerun does not retrain tiny, nor drop the figures an earlier run measured); none without one."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return [], None
    data = json.loads(path.read_text())
    return data.get("accuracy", []), data.get("accuracy_source")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny preset, few tokens (a smoke run)")
    ap.add_argument("--preset", default="small",
                    help="model preset of the speed rows (medium: 4x small's width, weight reads dominate a step; "
                         "its rows go to quant_speed_medium.json with --speed-only)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--formats", default=",".join(SPEED_FORMATS),
                    help=f"comma-separated speed rows, of {','.join(SPEED_FORMATS)} (fp32 and bf16 always run)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (best of)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="trained checkpoint for the accuracy part")
    ap.add_argument("--train-config", type=Path, default=None, help="the train_config.json of that run")
    ap.add_argument("--train-steps", type=int, default=300, help="without --checkpoint: train tiny this long")
    ap.add_argument("--skip-accuracy", action="store_true",
                    help="no accuracy part: the accuracy rows (and their source) of the existing results file are kept")
    ap.add_argument("--speed-only", action="store_true",
                    help="only the decode speed and memory rows (no accuracy, no KV cache table): quant_speed.json")
    # One thread: on a shared machine, OpenMP barriers of a 2-thread run wait on descheduled
    # threads and swamp the per-token times being compared.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time decode by the wall clock, or by this process's CPU time (a loaded machine)")
    ap.add_argument("--compile", action="store_true",
                    help=f"also time {', '.join(COMPILED_FORMATS)} through the compiled decode regions")
    ap.add_argument("--compile-form", default=COMPILE_FORMS[0], choices=COMPILE_FORMS,
                    help="what one compiled graph covers (EngineConfig.compile_form; 'whole': the step in one call)")
    args = ap.parse_args()
    keys = [k for k in args.formats.split(",") if k]
    unknown = sorted(set(keys) - set(SPEED_FORMATS))
    if unknown:
        ap.error(f"--formats: unknown {unknown}; expected some of {list(SPEED_FORMATS)}")
    keys = [k for k in SPEED_FORMATS if k in BASELINES or k in keys]
    torch.set_num_threads(args.threads)
    preset = "tiny" if args.quick else args.preset
    if preset not in ("small", "tiny") and not args.speed_only:
        ap.error("--preset: the full run (accuracy, KV table) is small's; use --speed-only for another preset")
    new_tokens = 8 if args.quick else args.new_tokens
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        speed_rows = speed(preset, new_tokens, 1 if args.quick else args.rounds, tmp, keys, clock,
                           COMPILED_FORMATS if args.compile else (), args.compile_form)
        acc_rows, source = kept_accuracy(result_name("quant", args.quick)) if args.skip_accuracy else ([], None)
        if not (args.skip_accuracy or args.speed_only):
            if args.checkpoint is None:
                ckpt, tcfg = train_tiny(20 if args.quick else args.train_steps, tmp / "train")
                source = f"tiny trained here for {20 if args.quick else args.train_steps} steps (recall)"
            else:
                ckpt, tcfg = args.checkpoint, args.train_config
                source = str(args.checkpoint)
            acc_rows = accuracy(ckpt, tcfg, tmp)
    print(markdown_table(["format", "rest", "decode", "decode tok/s (batch 1)", "x bf16", "x fp32",
                          "x fp32 eager", "weight MiB", "x bf16 bytes"],
                         [[r["format"], r["rest_dtype"], r["decode"], r["decode_tok_s"], r["speedup_vs_bf16"],
                           r["speedup_vs_fp32"], r["speedup_vs_fp32_eager"],
                           round(r["weight_bytes"] / 2**20, 1), r["memory_vs_bf16"]] for r in speed_rows]))
    if acc_rows:
        print(markdown_table(["format", "eval loss", "ppl", "ppl delta", "task acc", "acc delta", "logit max err",
                              "logit rms err (rel)", "argmax agree"],
                             [[r["format"], r["loss"], r["ppl"], r.get("ppl_delta", ""), r["accuracy"],
                               r.get("accuracy_delta", ""), r.get("logit_max_abs_err", ""),
                               r.get("logit_rms_err_rel", ""), r.get("argmax_agreement", "")] for r in acc_rows]))
    cache_rows = [] if args.speed_only else kv_cache_bytes()
    if cache_rows:
        print(markdown_table(["preset", "KV bytes/token bf16", "fp8", "fp8 / bf16"],
                             [[r["preset"], r["bf16_bytes_per_token"], r["fp8_bytes_per_token"], r["fp8_vs_bf16"]]
                              for r in cache_rows]))
    stem = "quant_speed" if args.speed_only else "quant"
    write_result(result_name(stem if preset in ("small", "tiny") else f"{stem}_{preset}", args.quick), {
        "preset": preset, "new_tokens": new_tokens, "threads": args.threads, "clock": args.clock,
        "compiled": args.compile, "compile_form": args.compile_form, "speed": speed_rows,
        "accuracy_source": source, "accuracy": acc_rows, "kv_cache": cache_rows,
        "target": {"int4_decode_vs_bf16": 2.0, "int4_decode_vs_fp32": 2.0, "accuracy_delta_abs": 0.02,
                   "fp8_kv_vs_bf16": 0.56}})


if __name__ == "__main__":
    main()
