"""Decode step time vs context length: K3.1-style DSA (lightning indexer + top-k 256) vs dense MLA.

A tiny model with K3.1's proportions: the indexer costs about 1/25 of the MLA it serves per past
token (K3.1: 32 x 128 index dims vs 96 heads x (576 + 512) absorbed MLA dims; here 8 x 32 vs
24 x (144 + 128)), 3 KDA layers per attention layer. The engine's HybridCache is filled
directly with random latents, indexer keys and KDA states at 1k / 8k / 32k tokens of context;
only the decode step (`ModelRunner.execute`, T = 1) is timed, the two models alternating, best
of N runs each; the attention layer's own forward is timed within the same steps. Three curves:
- one sequence whose blocks are consecutive (a fresh pool): attention reads a slice of the pages;
  the target is judged here, where the model's fixed per-step cost weighs most;
- one sequence whose blocks are scattered (the pool's free list shuffled, as in a long-running
  server): dense MLA first gathers every latent row, DSA only its top-k rows;
- `--batch` sequences (default 8) with consecutive blocks: a server's decode batch.
Each curve is measured twice: with the decode step compiled (`EngineConfig(compile_decode=True)`,
both models, graphs compiled in untimed warm-up steps) and eagerly. The attention layer's own time
is measured in the eager runs only (its timing hooks would split a compiled graph).

    .venv/bin/python bench/bench_serve_dsa_decode.py [--quick] [--batch N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, result_name, write_result  # noqa: E402

from deltamoe.config import load_preset  # noqa: E402
from deltamoe.model.load import build_model  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402
from deltamoe.serve.engine.scheduler import ScheduledBatch  # noqa: E402

MAX_CONTEXT = 32 * 1024


def config(attention: str):
    return load_preset("tiny").replace(
        hidden_size=256, num_hidden_layers=4, layer_types=("kda", "kda", "kda", attention),
        kda_num_heads=4, kda_head_dim=32, num_attention_heads=24, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_num_heads=8, index_head_dim=32,
        index_topk=256, intermediate_size=512, num_experts=8, num_experts_per_token=2, moe_intermediate_size=128,
        latent_moe_size=128, attn_res_block_size=2, num_nextn_predict_layers=0,
        max_position_embeddings=MAX_CONTEXT + 64)


def cost_ratio(cfg) -> float:
    """Absorbed MLA multiply-adds per past token (scores + values, all heads) / indexer's."""
    mla = cfg.num_attention_heads * (cfg.latent_cache_dim + cfg.kv_lora_rank)
    return mla / (cfg.index_num_heads * cfg.index_head_dim)


def scatter_free_blocks(engine: LLMEngine, seed: int = 0) -> None:
    """Put the pool's free blocks in a random order, as a long-running server's are after
    sequences of all lengths have finished: a new sequence's blocks are then scattered, and
    attention can no longer read one slice of the pages."""
    blocks = engine.cache.blocks
    taken = [blocks.allocate() for _ in range(blocks.num_free)]
    for i in torch.randperm(len(taken), generator=torch.Generator().manual_seed(seed)).tolist():
        blocks.release(taken[i])


def decode_step(engine: LLMEngine, context: int, batch: int = 1):
    """`batch` sequences with `context` tokens already in the cache (random contents) and their decode step."""
    cache = engine.cache
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(batch):
        seq = engine.make_sequence([i % 256 for i in range(context + 1)], SamplingParams(max_tokens=1, temperature=0))
        assert cache.admit(seq) and cache.grow(seq, context + 1)
        bs = cache.block_size
        rows = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in seq.block_table])[:context]
        cache.latent[:, rows] = torch.randn(cache.latent[:, rows].shape, generator=g)
        cache.index_keys[:, rows] = torch.randn(cache.index_keys[:, rows].shape, generator=g)
        cache.recurrent[:, seq.slot] = 0.1 * torch.randn(cache.recurrent[:, seq.slot].shape, generator=g)
        seqs.append(seq)
    scheduled = ScheduledBatch([(seq, 1) for seq in seqs])

    def step() -> None:
        for seq in seqs:
            seq.num_computed = context  # re-run the same step: position `context` is simply rewritten
        engine.runner.execute(scheduled)

    return seqs, step


class LayerTimer:
    """Wall time of one module's forward in the last step (forward hooks): the attention layer
    alone, apart from the rest of the step (three KDA layers, MoE, head, engine bookkeeping)."""

    def __init__(self, module: torch.nn.Module):
        self.last = float("nan")
        self._handles = [module.register_forward_pre_hook(self._start), module.register_forward_hook(self._stop)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _start(self, *_: object) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, *_: object) -> None:
        self.last = time.perf_counter() - self._t0


def interleaved_min_seconds(steps: dict[str, object], timers: dict[str, LayerTimer | None],
                            repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Alternate the contenders and keep each one's fastest step (and attention layer): on a shared
    machine the minimum is the least disturbed estimate, and alternating exposes both to the same
    background load. Each turn runs one untimed step first, so the timed step finds the CPU caches
    as a server's consecutive decode steps do, not emptied by the other model's step."""
    best = {name: float("inf") for name in steps}
    best_layer = dict(best)
    for _ in range(repeats):
        for name, fn in steps.items():
            fn()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
            if timers[name] is not None:
                best_layer[name] = min(best_layer[name], timers[name].last)
    return best, best_layer


def measure(models: dict, contexts: list[int], repeats: int, batch: int = 1, scattered: bool = False,
            compiled: bool = False) -> tuple[list[dict], list[list[str]]]:
    """Both models' decode step (and, eager, the attention layer) at each context: one row per context."""
    timers = {name: None if compiled else LayerTimer(model.model.layers[3].self_attn) for name, model in models.items()}
    try:
        return _measure(models, timers, contexts, repeats, batch, scattered, compiled)
    finally:
        for timer in timers.values():
            if timer is not None:
                timer.remove()


def _measure(models: dict, timers: dict, contexts: list[int], repeats: int, batch: int, scattered: bool,
             compiled: bool) -> tuple[list[dict], list[list[str]]]:
    results, rows = [], []
    for context in contexts:
        # A fresh cache per context. Consecutive blocks let attention read one slice of the pages;
        # `scattered` puts the free blocks in random order first, as in a long-running server.
        engines = {}
        for name, model in models.items():
            engines[name] = LLMEngine(model, config=EngineConfig(
                cache_memory=f"{max(512, 2 * batch * context // 1024)}MiB", max_num_seqs=batch, max_snapshots=0,
                enable_prefix_caching=False, compile_decode=compiled))
            if scattered:
                scatter_free_blocks(engines[name])
        steps = {name: decode_step(engine, context, batch)[1] for name, engine in engines.items()}
        for step in steps.values():
            step()  # compiled: the first step at a new shape class compiles (untimed)
        times, layer = interleaved_min_seconds(steps, timers, repeats)
        del engines, steps
        dsa, dense = times["dsa"], times["mla"]
        row = {"context": context, "dsa_ms": dsa * 1e3, "dense_mla_ms": dense * 1e3, "speedup": dense / dsa}
        if not compiled:
            row.update(dsa_layer_ms=layer["dsa"] * 1e3, dense_mla_layer_ms=layer["mla"] * 1e3,
                       layer_speedup=layer["mla"] / layer["dsa"])
        results.append(row)
        rows.append([f"{context:,}", f"{dsa * 1e3:.2f}", f"{dense * 1e3:.2f}", f"{dense / dsa:.1f}x",
                     "-" if compiled else f"{layer['dsa'] * 1e3:.2f} / {layer['mla'] * 1e3:.2f}",
                     "-" if compiled else f"{layer['mla'] / layer['dsa']:.1f}x"])
    return results, rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="1k and 8k only, fewer repeats, writes serve_dsa_decode_quick.json")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every side (1 keeps a shared machine's noise down)")
    parser.add_argument("--batch", type=int, default=8, help="decode batch of the batched curve")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [1024, 8192] if args.quick else [1024, 8192, MAX_CONTEXT]
    repeats = 3 if args.quick else 7
    models = {attention: build_model(config(attention), seed=0).eval() for attention in ("dsa", "mla")}
    curves = {"one sequence, consecutive blocks": dict(batch=1),
              "one sequence, scattered blocks": dict(batch=1, scattered=True),
              f"{args.batch} sequences, consecutive blocks": dict(batch=args.batch)}
    measured = {(compiled, name): measure(models, contexts, repeats, compiled=compiled, **kw)
                for compiled in (True, False) for name, kw in curves.items()}

    def mode(compiled: bool) -> dict:
        (results, _), (scattered, _), (batched, _) = (measured[compiled, name] for name in curves)
        return {"results": results, "scattered": scattered, "batched": {"batch": args.batch, "results": batched}}

    ratio = cost_ratio(config("dsa"))
    path = write_result(result_name("serve_dsa_decode", args.quick), {
        "config": {"index_topk": 256, "mla_to_indexer_cost_per_past_token": ratio, "layers": "kda,kda,kda,attn",
                   "batch": 1},
        **mode(False), "compiled": mode(True), "target": {"speedup": 4.0, "context": MAX_CONTEXT}})
    print(f"MLA / indexer cost per past token: {ratio:.1f}x (K3.1: 25.5x); top-k 256; threads "
          f"{torch.get_num_threads()}")
    for (compiled, name), (_, rows) in measured.items():
        print(f"\n{name}, {'compiled decode' if compiled else 'eager'}:\n")
        print(markdown_table(["context", "DSA decode step (ms)", "dense MLA decode step (ms)", "DSA speedup",
                              "attention layer alone, DSA / dense (ms)", "layer speedup"], rows))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
