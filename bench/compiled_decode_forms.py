"""Compiled decode forms side by side on the offline benchmark's model: eager, regions (the default), the whole call (C++ and Python launcher) and one call over `nested_compile_region` layer bodies.

Backs docs/serving-compiled.md ("Ways to cut that cost"): each form's warm-up (`LLMEngine.warm_up`, every
graph class; CPU seconds of the process, inductor's compiles included) and its decode rate over
`--prompts` x `--new` tokens (best of `--rounds`, wall and CPU; a first round may still include a
compile, so keep two rounds or more). All forms run in one process on one fresh inductor cache, in
the order listed below whatever the command line's, so a later form may find kernels an earlier
one compiled. The forms other than `regions` and `whole` are served nowhere: this script builds
them from `compiled_decode`'s parts to measure them.
- `whole-py`: the whole call, inductor's Python launcher instead of `cpp_wrapper`, batch 1 as
  two rows;
- `nested`: the whole call (Python launcher: the C++ one cannot emit the subgraphs) with each
  layer's attention and MoE marked `torch.compiler.nested_compile_region`; it traces only with
  the config's floats specialised and the MoE's expert-load count out of place (both set here);
- `regions-skip-guards`: the regions' graphs run under `set_stance(skip_guard_eval_unsafe=True)`.

    .venv/bin/python bench/compiled_decode_forms.py [FORM ...] [--rounds 3]   (default: every form)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

FORMS = ("eager", "regions", "regions-skip-guards", "whole", "whole-py", "nested")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("forms", nargs="*", default=list(FORMS), choices=FORMS)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))

    import torch
    from torch.fx.experimental import _config as shape_config

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_serve_offline import hf_model, make_prompts

    from deltamoe.model import ffn
    from deltamoe.model.load import load_model
    from deltamoe.serve.engine import compiled_decode, compiled_regions
    from deltamoe.serve.engine.config import EngineConfig
    from deltamoe.serve.engine.decode_matvec_pass import DecodeMatvecPass
    from deltamoe.serve.engine.llm_engine import LLMEngine
    from deltamoe.serve.engine.sampling import SamplingParams

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model().save_pretrained(tmp)
        model = load_model(tmp)
    prompts = make_prompts(args.prompts)
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)

    def python_launcher_call():
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "cpp_wrapper": False,
                   "post_grad_custom_post_pass": DecodeMatvecPass()}
        return shape_config.patch(use_duck_shape=False)(torch.compile(
            compiled_decode._decode_call, dynamic=True, recompile_limit=compiled_decode.RECOMPILE_LIMIT, options=options))

    def engine_for(form: str) -> LLMEngine:
        engine = LLMEngine(model, config=EngineConfig(cache_memory="1GiB", max_num_seqs=64, max_num_batched_tokens=2048,
                                                      compile_decode=form != "eager"))
        if form in ("whole", "whole-py", "nested"):
            call = compiled_decode.CompiledDecode(model, form="whole")
            if form != "whole":
                call.min_rows, call._call = 2, python_launcher_call()
            if form == "nested":  # changes process-wide settings: runs last (see main)
                torch._dynamo.config.specialize_float = True
                ffn.expert_load = lambda indices, n: torch.zeros(n, dtype=torch.long).scatter_add(
                    0, indices.reshape(-1), torch.ones_like(indices.reshape(-1)))
                call._model = compiled_decode.decode_form(model, call._key)  # the regions' module tree,
                attention = torch.compiler.nested_compile_region(compiled_regions._attention_call)
                moe = torch.compiler.nested_compile_region(compiled_regions._ffn_call)
                for layer in call._model.model.layers:  # its regions traced inside the one call
                    layer.self_attn.forward.call = attention
                    if layer.is_moe:
                        layer.block_sparse_moe.forward.call = moe
            engine.runner._compiled_decode = call
        return engine

    def cpu_s() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    args.forms = sorted(set(args.forms), key=FORMS.index)  # nested last: it changes process-wide settings
    engines, warm = {}, {}
    for form in args.forms:
        wall, cpu = time.perf_counter(), cpu_s()
        engines[form] = engine_for(form)
        # A few real prompts first: without them the first timed round under the skip-guards
        # stance fails with "Recompilation triggered" (the normal stance does not recompile there).
        engines[form].generate(prompts[:3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), progress=False)
        if form != "eager":
            engines[form].warm_up()
        warm[form] = (time.perf_counter() - wall, cpu_s() - cpu)
        print(f"{form}: warm-up {warm[form][0]:.1f} s wall, {warm[form][1]:.1f} s CPU", flush=True)
    best = {form: (float("inf"), float("inf")) for form in args.forms}
    outputs = {}
    for _ in range(args.rounds):
        for form in args.forms:
            stance = (torch.compiler.set_stance(skip_guard_eval_unsafe=True) if form == "regions-skip-guards"
                      else contextlib.nullcontext())
            wall, cpu = time.perf_counter(), time.process_time()
            with stance:
                outputs[form] = engines[form].generate(prompts, params, progress=False)
            best[form] = (min(best[form][0], time.perf_counter() - wall), min(best[form][1], time.process_time() - cpu))
    tokens = args.prompts * args.new
    first = args.forms[0]
    for form in args.forms:
        same = sum(a.token_ids == b.token_ids for a, b in zip(outputs[form], outputs[first])) / args.prompts
        print(f"{form}: {tokens / best[form][0]:,.0f} tok/s wall, {tokens / best[form][1]:,.0f} tok per CPU s; "
              f"warm-up {warm[form][1]:.1f} CPU s; greedy tokens equal to {first}'s: {same:.0%}")


if __name__ == "__main__":
    main()
