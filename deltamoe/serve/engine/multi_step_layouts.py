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
