"""Where multi-step decode (`multi_step.py`) runs: asked before a model loads or a worker starts (no torch here)."""

from __future__ import annotations

from deltamoe.errors import ConfigError


def check_multi_step(num_scheduler_steps: int, workers: bool, transfers: bool) -> None:
    """Worker ranks would each need the window's steps, and a KV connector loads and saves once per
    step: with either, a window of more than one step is a ConfigError naming the field."""
    if num_scheduler_steps == 1:
        return
    for refused, layout in ((workers, "--tp/--ep workers"), (transfers, "a prefill/decode role")):
        if refused:
            raise ConfigError(f"multi-step decode with {layout}: not yet", field="num_scheduler_steps",
                              hint="drop --num-scheduler-steps")


# `generate`'s windows when --num-scheduler-steps is not given (docs/serving-compiled.md, "Multi-step decode": offline
# 64 x 128 tokens on Kimi Linear tiny, compiled, the same tokens in fewer trips through the scheduler). `serve`
# keeps one step at a time unless asked: windows stream in bursts and hold back arrivals until a window ends.
GENERATE_DEFAULT_STEPS = 8


def resolve_generate_steps(asked: int | None, workers: bool, async_scheduling: bool, speculative: bool) -> int:
    """`generate`'s num_scheduler_steps: the one asked for, else GENERATE_DEFAULT_STEPS where windows run
    (one process, neither async scheduling nor speculative decoding), else 1."""
    if asked is not None:
        return asked
    return 1 if workers or async_scheduling or speculative else GENERATE_DEFAULT_STEPS
