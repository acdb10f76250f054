"""Where the offline benchmark's eager prefill goes: its prompts (64 of 16..64 tokens on the tiny
Kimi Linear of `bench_serve_offline.py`) through `LLMEngine.generate` with one output token, and
the share of each KDA piece (the chunked op, the short conv, the decay gate, the gated norm) and of
the model's other blocks in it.

    OMP_NUM_THREADS=1 .venv/bin/python bench/kda_prefill_share.py [--rounds 5] [--chunk-size 64 16]

Times are the thread's CPU seconds (one torch thread: a loaded machine's waits count for nothing),
the best round of each setting. `--chunk-size` runs the KDA chunked op with each fixed longest
chunk besides its default (`kda.default_chunk_size`; where the fused kernel runs, as it does
here, `kda_fused.DEFAULT_CHUNK`), rounds interleaved: 64 is the chunk length
the model ran before the default followed the head size. Writes bench/results/kda_prefill_share.json.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve_offline import hf_model, make_prompts  # noqa: E402
from common import markdown_table, write_result  # noqa: E402

from deltamoe.model import kda_layer  # noqa: E402
from deltamoe.model.load import load_model  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402

# The KDA layer's pieces, by the names kda_layer calls them under.
KDA_PIECES = ("chunk_kda", "causal_conv1d", "kda_gate", "gated_rms_norm")
# The model's blocks, by class name: a KDA layer's time includes its pieces.
BLOCKS = ("KimiDeltaAttention", "LatentAttention", "MoE", "DenseMLP")


def _timed(seconds: dict[str, float], name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.thread_time() - start
    return timed


@contextmanager
def pieces_timed(model: torch.nn.Module, seconds: dict[str, float], chunk_size: int | None) -> Iterator[None]:
    """Accumulate each piece's and block's CPU seconds into `seconds` while inside; the KDA layer
    runs its chunked op with `chunk_size` (None: the op's default). Everything is restored after."""
    saved = {name: getattr(kda_layer, name) for name in KDA_PIECES}
    forwards = [m for m in model.modules() if type(m).__name__ in BLOCKS]
    try:
        for name, fn in saved.items():
            if name == "chunk_kda" and chunk_size is not None:
                fn = functools.partial(fn, chunk_size=chunk_size)
            setattr(kda_layer, name, _timed(seconds, name, fn))
        for m in forwards:
            m.forward = _timed(seconds, type(m).__name__, m.forward)
        yield
    finally:
        for name, fn in saved.items():
            setattr(kda_layer, name, fn)
        for m in forwards:
            del m.forward  # back to the class's forward


def prefill_seconds(model: torch.nn.Module, prompts: list[list[int]], chunk_size: int | None) -> dict[str, float]:
    """One eager prefill of `prompts` (one output token each): {"total": s, piece or block: s}."""
    seconds: dict[str, float] = defaultdict(float)
    engine = LLMEngine(model, config=EngineConfig(cache_memory="1GiB", max_num_seqs=64, max_num_batched_tokens=2048,
                                                  compile_decode=False))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with pieces_timed(model, seconds, chunk_size):
        start = time.thread_time()
        engine.generate(prompts, params, progress=False)
        seconds["total"] = time.thread_time() - start
    engine.shutdown()
    return dict(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, nargs="*", default=[64],
                        help="fixed longest chunks to run besides the default")
    args = parser.parse_args()
    if args.rounds < 1 or args.prompts < 1 or any(c < 1 for c in args.chunk_size):
        parser.error("--rounds, --prompts and --chunk-size take positive integers")
    torch.set_num_threads(1)
    prompts = make_prompts(args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model().save_pretrained(tmp)
        model = load_model(tmp)
    settings: list[int | None] = [None, *args.chunk_size]
    prefill_seconds(model, prompts, None)  # warm-up
    runs: dict[int | None, list[dict[str, float]]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for s in settings:
            runs[s].append(prefill_seconds(model, prompts, s))
    best = {s: min(rs, key=lambda r: r["total"]) for s, rs in runs.items()}

    default = best[None]
    names = [n for n in (*BLOCKS, *KDA_PIECES) if n in default]
    print(f"eager prefill of {args.prompts} prompts (16..64 tokens), tiny Kimi Linear, 1 thread, "
          f"best of {args.rounds}:")
    print(markdown_table(["piece", "ms", "share of the prefill"],
                         [[n, f"{default[n] * 1e3:.1f}", f"{default[n] / default['total']:.1%}"] for n in names]
                         + [["prefill", f"{default['total'] * 1e3:.1f}", "100%"]]))
    rows = [[("default" if s is None else s), f"{best[s]['total'] * 1e3:.1f}", f"{best[s]['chunk_kda'] * 1e3:.1f}",
             f"{best[s]['total'] / default['total']:.2f}"] for s in settings]
    print(markdown_table(["KDA chunk", "prefill ms", "chunked op ms", "prefill / default's"], rows))
    write_result("kda_prefill_share", {
        "workload": {"prompts": args.prompts, "prompt_lengths": "16..64", "model": "bench_serve_offline.hf_model",
                     "threads": 1, "rounds": args.rounds, "clock": "thread CPU time, best round"},
        "default_ms": {n: default[n] * 1e3 for n in (*names, "total")},
        "by_chunk_size": {str(s if s is not None else "default"): best[s]["total"] * 1e3 for s in settings},
    })


if __name__ == "__main__":
    main()
