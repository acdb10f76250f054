"""A rank > 0 of a serving replica: build the shard and its cache, then run rank 0's steps until told to stop.

It holds no scheduler and samples nothing: each `StepMessage` carries the state-slot writes rank 0
made since the last step and the step's model calls; the worker replays the writes on its cache
shard and runs the calls, joining their collectives. It exits when rank 0 says stop, when a
collective fails (a peer died), or, when rank 0 spawned it, as soon as rank 0 is gone (no orphans).

Spawned as `python -m deltamoe.serve.executor.worker '<json>'` by `group.spawn_group`; under torchrun
`deltamoe serve` calls `run_worker` on ranks > 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from deltamoe.errors import ConfigError
from deltamoe.hf_config import load_config
from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.runner import ModelRunner
from deltamoe.serve.executor.group import (RankGroup, RankStats, StepMessage, StopMessage, WorkerSpec, build_shard,
                                           join_spawned)
from deltamoe.serve.executor.image_rows import attach_images, empty_rows
from deltamoe.serve.executor.placeholders import filled_inputs
from deltamoe.serve.executor.weight_sync import WeightsMessage, load_full_weights, tp_coordinate


def max_model_len(spec: WorkerSpec, engine: EngineConfig) -> int:
    """The context limit `LLMEngine` derives, so every rank sizes its cache alike."""
    return engine.max_model_len or load_config(spec.source).max_position_embeddings


def serve_steps(spec: WorkerSpec, group: RankGroup) -> None:
    """The worker loop (rank > 0)."""
    engine = EngineConfig(**spec.engine)
    model = build_shard(spec, group)
    if model is None:  # a rank could not load its shard: rank 0 reports it
        return
    cache = HybridCache(model.config, engine, max_model_len(spec, engine), dtype=model.dtype, device=group.device,
                        tp_size=group.dims.tp)
    runner = ModelRunner(model, cache, compiled_decode=engine.compile_decode, compile_form=engine.compile_form)
    stats = RankStats(group.rank)
    with torch.inference_mode():
        while True:
            message = group.receive()
            if isinstance(message, StopMessage):
                return
            if isinstance(message, WeightsMessage):
                tp = group.dims.tp
                load_full_weights(model, message.tensors, tp_coordinate(group.mesh, tp), tp)
                continue
            assert isinstance(message, StepMessage)
            if message.reset_stats:
                stats = RankStats(group.rank)
            start = time.perf_counter()
            cache.apply_state_ops(message.state_ops)
            if message.loaded:  # caches handed off to rank 0 that this step first runs (a decode role)
                from deltamoe.serve.kv_transfer.worker_state import receive_loaded_caches

                receive_loaded_caches(cache, message.loaded, group.device, tp_coordinate(group.mesh, group.dims.tp),
                                      group.dims.tp)
            inputs: list[torch.Tensor | None] = [None] * len(message.calls)
            if message.earlier_rows:  # a one-step-ahead step: rank 0's previous sampled ids follow
                earlier = torch.empty(message.earlier_rows, dtype=torch.long, device=group.device)
                dist.broadcast(earlier, src=0)
                inputs = filled_inputs(message.calls, message.fills, earlier, group.device)
            if message.images is not None:  # rank 0's image rows for the calls' placeholders
                rows = empty_rows(message.images, group.device)
                dist.broadcast(rows, src=0)
                attach_images(message.calls, message.images, rows)
            projections = message.projections or [[]] * len(message.calls)
            for call, ids, projected in zip(message.calls, inputs, projections):
                if not projected:
                    runner.forward(call, ids)
                    continue
                _, hidden = runner.forward(call, ids, with_hidden=True)
                for row, lo, hi in projected:  # rank 0's prompt-logprob projections, joined
                    model.lm_head(model.model.norm(hidden[row, lo:hi]))
            if message.gather_slots:  # a prefill role over --tp ranks: rank 0 pushes these states whole
                from deltamoe.serve.kv_transfer.worker_state import send_heads

                send_heads(cache, message.gather_slots)
            stats.last_step_seconds = time.perf_counter() - start
            stats.forward_seconds_total += stats.last_step_seconds
            stats.steps += 1
            if message.report:
                group.gather_stats(stats)


def _exit_with_parent() -> None:
    """Exit the moment the spawning rank 0 is gone, however it went (even SIGKILL)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.2)

    threading.Thread(target=watch, name="deltamoe-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    spec = WorkerSpec(**args["spec"])
    _exit_with_parent()
    # Ctrl-C in a terminal, and a SIGTERM sent to the process group (timeout, a container stop,
    # systemd), reach every process: rank 0 decides when the workers stop (they died first and the
    # server logged a worker failure during a normal shutdown). A SIGKILL still ends one. A handler,
    # not SIG_IGN: an ignored signal stays ignored in the processes a worker starts (compile workers).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    dims = spec.worker_config().dims(load_config(spec.source))
    group = join_spawned(spec, dims, args["rank"], args["world_size"], args["port"])
    try:
        serve_steps(spec, group)
    except ConfigError as e:  # rank 0 reports the same problem in its own line; no traceback here
        print(f"worker rank {args['rank']}: error: {e.one_line()}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
