"""Where one batch-1 decode step's time goes, fp32 against int4 (W4A16, rest fp32), on `small` (`--dtype bf16`: bf16 against int4 with the rest bf16).

Each model decodes one prompt through `LLMEngine` (eager, batch 1) under `torch.profiler`; the
decode steps' CPU time is split two ways:

- by op kind (the ops' self time): int4 kernel calls, float matmuls, `index_select` (the int4
  experts' operand gathers and the cache's page reads), the other tensor ops (elementwise, norms,
  reshapes, cache reads), and what no op accounts for: Python, module calls and dispatch between
  the ops;
- by part of the model (inclusive time of the module's forward): KDA attention, MLA/DSA
  attention, MoE router, routed experts, shared expert, latent projections, dense MLP, norms,
  lm_head, and the glue around them (AttnRes mixes, residuals, the engine's step).

The int4 kernel and the float matmuls read the weights (the part int4 shrinks); everything else
is per-op overhead both models pay alike. The profiler adds its own cost to every op (about a
microsecond) and times by the wall clock, so the split is read as shares; the unprofiled step's
CPU time is printed beside it. Op event counts include ops called inside other ops. A compiled
step (`--compile`) is split by op kind only: its fused kernels count as the regions' own code.

    OMP_NUM_THREADS=1 python bench/quant_step_split.py [--steps 16] [--compile [--form parts|whole]] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from deltamoe.model.ffn import MoE
from deltamoe.model.load import load_model
from deltamoe.model.quant_scheme import make_scheme
from deltamoe.quantize.checkpoint import quantize_checkpoint
from deltamoe.serve.engine.compiled_decode import FORMS, CompiledDecode
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams

PROMPT = [256] + list(range(65, 65 + 15))
STEP = "decode_step"
INT4_OPS = ("aten::_weight_int4pack_mm_for_cpu", "deltamoe_int4::matvec")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::mv", "aten::dot")
GATHER_OPS = ("aten::index_select",)
# Model parts by module class name (and, for a MoE's children, the attribute that holds them).
PARTS = {"KimiDeltaAttention": "KDA attention", "LatentAttention": "MLA/DSA attention",
         "Router": "MoE router", "DenseMLP": "dense MLP", "RMSNorm": "norms (RMSNorm)"}
MOE_CHILDREN = {"routed_expert_down_proj": "latent down/up",
                "routed_expert_up_proj": "latent down/up", "shared_experts": "shared expert"}


class _Restore:
    """A handle that puts a MoE's own dispatcher back."""

    def __init__(self, moe: MoE, dispatcher) -> None:
        self.moe, self.dispatcher = moe, dispatcher

    def remove(self) -> None:
        self.moe.dispatcher = self.dispatcher


def label_parts(model: torch.nn.Module, parts: bool = True) -> list:
    """Hooks that wrap each decode step, and (`parts`) each part's forward, in a `record_function`
    named after it. A compiled step labels only the step (hooks inside a region would be traced)."""
    handles = []

    def wrap(module: torch.nn.Module, name: str) -> None:
        def pre(_m, _args):
            _m._profile_range = record_function(name)
            _m._profile_range.__enter__()

        def post(_m, _args, _out):
            _m._profile_range.__exit__(None, None, None)

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    for module in model.modules() if parts else ():
        if isinstance(module, MoE):  # the routed experts run in the dispatcher (fp32: no module call)
            dispatch = module.dispatcher

            def labelled(*args, _dispatch=dispatch):
                with record_function("routed experts"):
                    return _dispatch(*args)

            module.dispatcher = labelled
            handles.append(_Restore(module, dispatch))
    for name, module in model.named_modules() if parts else ():
        leaf = name.rsplit(".", 1)[-1]
        if name == "lm_head":
            wrap(module, "lm_head")
        elif name.endswith("embed_tokens"):
            wrap(module, "embedding")
        elif ".block_sparse_moe." in f"{name}." and leaf in MOE_CHILDREN and name.count(".") == 4:
            wrap(module, MOE_CHILDREN[leaf])
        elif type(module).__name__ in PARTS and not name.endswith("shared_experts") and ".self_attn." not in name:
            # (an attention layer's own norms count in its attention)
            wrap(module, PARTS[type(module).__name__])

    def step_pre(_m, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        _m._step_range = record_function(STEP) if ids.shape[-1] == 1 else None
        if _m._step_range is not None:
            _m._step_range.__enter__()

    def step_post(_m, _args, _kwargs, _out):
        if _m._step_range is not None:
            _m._step_range.__exit__(None, None, None)

    handles.append(model.register_forward_pre_hook(step_pre, with_kwargs=True))
    handles.append(model.register_forward_hook(step_post, with_kwargs=True))
    return handles


def split(model: torch.nn.Module, steps: int, compiled: bool, form: str = FORMS[0]) -> dict:
    engine = LLMEngine(model, config=EngineConfig(cache_memory="64MiB", max_num_seqs=1, compile_decode=compiled))
    if compiled and form != FORMS[0]:
        engine.runner._compiled_decode = CompiledDecode(model, form=form)
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    engine.generate([PROMPT], params, progress=False)  # warm-up (and compile)
    t0 = time.process_time()
    engine.generate([PROMPT], params, progress=False)
    t_all = time.process_time() - t0
    t0 = time.process_time()
    engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), progress=False)
    step_ms = (t_all - (time.process_time() - t0)) / steps * 1e3
    handles = label_parts(model, parts=not compiled)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate([PROMPT], params, progress=False)
    finally:
        for h in handles:
            h.remove()
    events = prof.events()
    windows = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP)

    def inside(e) -> bool:
        return any(s <= e.time_range.start and e.time_range.end <= t for s, t in windows)

    total = sum(t - s for s, t in windows)
    kinds: dict[str, float] = defaultdict(float)
    parts: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        if not inside(e) or e.name == STEP:
            continue
        if e.name.startswith("aten::") or e.name.startswith("deltamoe"):
            kind = ("int4 kernel" if e.name in INT4_OPS else "float matmul" if e.name in MATMUL_OPS
                    else "index_select (expert operands, cache pages)" if e.name in GATHER_OPS else "other tensor ops")
            kinds[kind] += e.self_cpu_time_total
            calls[kind] += 1
        elif e.name in set(PARTS.values()) | set(MOE_CHILDREN.values()) | {"lm_head", "embedding", "routed experts"}:
            parts[e.name] += e.cpu_time_total
    kinds["Python / dispatch between ops"] = total - sum(kinds.values())
    if compiled:  # the compiled regions' own kernels run outside any aten op: count them apart
        regions = sum(e.self_cpu_time_total for e in events if inside(e) and "Compiled" in e.name
                      and not e.name.startswith("aten::"))
        kinds["Python / dispatch between ops"] -= regions
        kinds["compiled region code (fused kernels, guards)"] = regions
    n = len(windows)
    covered = sum(parts.values())
    parts["glue (AttnRes mixes, residuals, MoE bookkeeping, cache views)"] = total - covered
    return {"steps": n, "unprofiled_step_ms": step_ms, "profiled_step_ms": total / n / 1e3,
            "kinds_ms": {k: v / n / 1e3 for k, v in kinds.items()},
            "calls_per_step": {k: c / n for k, c in calls.items()},
            "parts_ms": {k: v / n / 1e3 for k, v in parts.items()}}


def show(name: str, r: dict) -> None:
    total = r["profiled_step_ms"]
    print(f"\n{name}: step {r['unprofiled_step_ms']:.2f} ms CPU unprofiled, {total:.2f} ms profiled")
    for k, v in sorted(r["kinds_ms"].items(), key=lambda kv: -kv[1]):
        c = r["calls_per_step"].get(k)
        print(f"  {k:<40} {v:7.2f} ms  {100 * v / total:5.1f}%" + (f"  ({c:.0f} op events)" if c else ""))
    if len(r["parts_ms"]) > 1:  # (a compiled step is not split by part)
        print("  by part:")
    for k, v in sorted(r["parts_ms"].items(), key=lambda kv: -kv[1]) if len(r["parts_ms"]) > 1 else ():
        print(f"  {k:<40} {v:7.2f} ms  {100 * v / total:5.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--compile", action="store_true", help="profile the compiled decode step instead")
    ap.add_argument("--form", default=FORMS[0], choices=FORMS, help="the compiled call's form (with --compile)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                    help="the float model's dtype and the int4 model's unquantized rest")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "int4"
        quantize_checkpoint(args.preset, path, make_scheme("int4"), dtype=dtype)
        models = {args.dtype: load_model(args.preset, dtype=dtype),
                  f"int4 (rest {args.dtype})": load_model(path, dtype=dtype)}
        for name, model in models.items():
            show(name + (f" compiled ({args.form})" if args.compile else " eager"),
                 split(model, args.steps, args.compile, args.form))


if __name__ == "__main__":
    main()
