"""`deltamoe plan`: memory, layouts, throughput estimates and a launch recipe; `--validate`
compares the estimator with published deployments. Errors are DeltaMoEError types, which the
top-level CLI prints as one line with exit code 2.

Without `--slo-ttft`/`--slo-tpot` the plan meets interactive targets (TTFT 3 s, TPOT 50 ms)
and says so, showing the throughput-optimal plan beside it; `--no-slo` ranks by throughput
alone. The estimator is imported inside the command, so `deltamoe --help` does not load it.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from typing import Optional

import typer

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError
from deltamoe.hf_config import load_config
from deltamoe.plan.precision import CLI_WEIGHTS, KV_FORMATS

# A chat user reads about 20 tokens/s (TPOT 50 ms) and waits a few seconds for the first token;
# the README's deployment table uses the same targets.
INTERACTIVE_TTFT_S = 3.0
INTERACTIVE_TPOT_S = 0.05


@dataclass(frozen=True)
class SloChoice:
    ttft_s: float | None
    tpot_s: float | None
    reason: str  # printed beside the SLO: where the limits came from
    is_default: bool = False  # the interactive targets, chosen for a user who gave no SLO flag


def choose_slo(slo_ttft: float | None, slo_tpot: float | None, no_slo: bool) -> SloChoice:
    """The latency limits a plan must meet: the flags given, none with --no-slo, else interactive ones."""
    for name, value in (("slo-ttft", slo_ttft), ("slo-tpot", slo_tpot)):
        if value is not None and not (math.isfinite(value) and value > 0):  # NaN passes `<= 0`
            raise ConfigError(f"expected a positive number of seconds, got {value}", field=name)
    if no_slo:
        if slo_ttft is not None or slo_tpot is not None:
            raise ConfigError("--no-slo contradicts --slo-ttft/--slo-tpot", field="no-slo",
                              hint="pass either the limits or --no-slo")
        return SloChoice(None, None, "none (--no-slo): the most output tok/s per chip, whatever the latency")
    if slo_ttft is None and slo_tpot is None:
        return SloChoice(INTERACTIVE_TTFT_S, INTERACTIVE_TPOT_S,
                         "interactive default (no --slo-* flag given; --no-slo for throughput alone)",
                         is_default=True)
    return SloChoice(slo_ttft, slo_tpot, "as given")


def _model(name: str) -> ModelConfig:
    from deltamoe.plan.reference_models import REFERENCE_MODELS

    if name in REFERENCE_MODELS:
        return REFERENCE_MODELS[name]()
    return load_config(name)


def _default_weights(cfg: ModelConfig) -> str:
    # The released K3 checkpoints ship MXFP4 experts; everything else is planned as BF16.
    return "mxfp4" if cfg.model_type == "kimi_k3" else "bf16"


def plan_command(
    model: Optional[str] = typer.Option(None, "--model", help="preset name, config.json or checkpoint folder"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="catalog name or YAML/JSON hardware file"),
    nodes: int = typer.Option(1, "--nodes", min=1, help="--nodes units (servers, racks or SuperPoDs)"),
    chips: Optional[int] = typer.Option(None, "--chips", min=1, help="exact chip count (overrides --nodes)"),
    context: int = typer.Option(8192, "--context", min=1, help="prompt tokens per request"),
    output: int = typer.Option(1024, "--output", min=1, help="generated tokens per request"),
    weights: Optional[str] = typer.Option(None, "--weights", help=f"{'|'.join(CLI_WEIGHTS)} (default: native)"),
    kv_cache: str = typer.Option("bf16", "--kv-cache", help="|".join(KV_FORMATS)),
    kda_state: str = typer.Option("fp32", "--kda-state", help="KDA recurrent state dtype: fp32|bf16"),
    slo_ttft: Optional[float] = typer.Option(None, "--slo-ttft", help="time-to-first-token limit, seconds "
                                             f"(without either SLO flag: {INTERACTIVE_TTFT_S:g} s)"),
    slo_tpot: Optional[float] = typer.Option(None, "--slo-tpot", help="time-per-output-token limit, seconds "
                                             f"(without either SLO flag: {INTERACTIVE_TPOT_S:g} s)"),
    no_slo: bool = typer.Option(False, "--no-slo", help="no latency limits: the throughput-optimal plan"),
    draft_tokens: int = typer.Option(0, "--draft-tokens", min=0, help="speculative tokens verified per step"),
    accept_len: float = typer.Option(1.0, "--accept-len", help="tokens accepted per step with speculation"),
    headroom: float = typer.Option(0.10, "--headroom", help="fraction of chip memory left free"),
    validate: bool = typer.Option(False, "--validate", help="compare estimates with published deployments"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
) -> None:
    """Plan a deployment: weights, caches, TP/EP/PP/DP layout, prefill/decode split, tok/s per chip."""
    from rich.console import Console

    from deltamoe.plan.costs import model_costs
    from deltamoe.plan.hardware import get_hardware
    from deltamoe.plan.recipe import launch_recipe
    from deltamoe.plan.report import plan_json, render_plan, render_validation
    from deltamoe.plan.search import Workload, best_plan
    from deltamoe.plan.validate import run_validation

    console = Console(width=200)
    if validate:
        given = [flag for flag, value in (("--model", model), ("--hardware", hardware)) if value]
        if given:  # each published deployment fixes its own model and hardware
            raise ConfigError(f"{given[0]} with --validate: the validation rows fix their own model and hardware",
                              field="validate", hint="run --validate alone")
        rows = run_validation()
        if as_json:
            sys.stdout.write(json.dumps([r.to_json() for r in rows], indent=2) + "\n")
        else:
            render_validation(console, rows)
        return
    if not model:
        raise ConfigError("missing --model", field="model", hint="a preset such as kimi-k3.1-pro")
    if not hardware:
        raise ConfigError("missing --hardware", field="hardware", hint="e.g. h200 or m890-superpod")
    if weights is not None and weights not in CLI_WEIGHTS:
        raise ConfigError(f"expected one of {CLI_WEIGHTS}, got {weights!r}", field="weights")
    if kda_state not in ("fp32", "bf16"):
        raise ConfigError(f"expected fp32 or bf16, got {kda_state!r}", field="kda-state")
    if not (math.isfinite(headroom) and 0 <= headroom < 1):
        raise ConfigError(f"expected a fraction in [0, 1), got {headroom}", field="headroom")
    if not (math.isfinite(accept_len) and 1 <= accept_len <= 1 + draft_tokens):
        raise ConfigError(f"expected 1 <= accept-len <= 1 + draft-tokens ({1 + draft_tokens}), got {accept_len}",
                          field="accept-len")
    slo = choose_slo(slo_ttft, slo_tpot, no_slo)
    cfg = _model(model)
    if context + output > cfg.max_position_embeddings:  # the printed --max-model-len must load
        raise ConfigError(f"{context:,} prompt + {output:,} output tokens = {context + output:,}, more than "
                          f"{model}'s max_position_embeddings ({cfg.max_position_embeddings:,})", field="context",
                          hint=f"at most {cfg.max_position_embeddings:,} tokens of prompt and output together")
    hw = get_hardware(hardware)
    scheme = weights or _default_weights(cfg)
    costs = model_costs(cfg, scheme, kv_cache, 4 if kda_state == "fp32" else 2, draft_tokens)
    workload = Workload(context=context, output=output, slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s,
                        draft_tokens=draft_tokens, accept_len=accept_len, headroom=headroom)
    n_chips = chips or nodes * hw.chips_per_node
    plan, plans = best_plan(costs, hw, workload, n_chips, model)
    # Beside a default SLO the user did not choose, what dropping it would buy.
    fastest = None
    if slo.is_default:
        fastest, _ = best_plan(costs, hw, replace(workload, slo_ttft_s=None, slo_tpot_s=None), n_chips, model)
    recipe = launch_recipe(plan, model, scheme, kv_cache, hw, costs)
    if as_json:
        doc = plan_json(model, costs, hw, plan, plans[:6], recipe, slo.reason, fastest)
        try:  # strict JSON: a NaN or inf (from extreme hardware numbers) is an error, never a bare NaN
            text = json.dumps(doc, indent=2, allow_nan=False)
        except ValueError as e:
            raise ConfigError(f"the plan holds a number that is not finite ({e})", field="hardware",
                              hint="check the hardware numbers: one is far too small or too large") from e
        sys.stdout.write(text + "\n")
    else:
        render_plan(console, model, costs, hw, plan, plans, recipe, slo.reason, fastest)
