"""`deltamoe plan`: memory, layouts, throughput estimates and a launch recipe; `--validate`
compares the estimator with published deployments. Errors are DeltaMoEError types, which the
top-level CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Console

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError
from deltamoe.hf_config import load_config
from deltamoe.plan.costs import model_costs
from deltamoe.plan.hardware import get_hardware
from deltamoe.plan.precision import CLI_WEIGHTS, KV_FORMATS
from deltamoe.plan.recipe import launch_recipe
from deltamoe.plan.reference_models import REFERENCE_MODELS
from deltamoe.plan.report import plan_json, render_plan, render_validation
from deltamoe.plan.search import Workload, best_plan
from deltamoe.plan.validate import run_validation


def _model(name: str) -> ModelConfig:
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
    slo_ttft: Optional[float] = typer.Option(None, "--slo-ttft", help="time-to-first-token limit, seconds"),
    slo_tpot: Optional[float] = typer.Option(None, "--slo-tpot", help="time-per-output-token limit, seconds"),
    draft_tokens: int = typer.Option(0, "--draft-tokens", min=0, help="speculative tokens verified per step"),
    accept_len: float = typer.Option(1.0, "--accept-len", help="tokens accepted per step with speculation"),
    headroom: float = typer.Option(0.10, "--headroom", help="fraction of chip memory left free"),
    validate: bool = typer.Option(False, "--validate", help="compare estimates with published deployments"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
) -> None:
    """Plan a deployment: weights, caches, TP/EP/PP/DP layout, prefill/decode split, tok/s per chip."""
    console = Console(width=200)
    if validate:
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
    if not 0 <= headroom < 1:
        raise ConfigError(f"expected a fraction in [0, 1), got {headroom}", field="headroom")
    if accept_len < 1 or accept_len > 1 + draft_tokens:
        raise ConfigError(f"expected 1 <= accept-len <= 1 + draft-tokens ({1 + draft_tokens}), got {accept_len}",
                          field="accept-len")
    cfg = _model(model)
    hw = get_hardware(hardware)
    scheme = weights or _default_weights(cfg)
    costs = model_costs(cfg, scheme, kv_cache, 4 if kda_state == "fp32" else 2, draft_tokens)
    workload = Workload(context=context, output=output, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
                        draft_tokens=draft_tokens, accept_len=accept_len, headroom=headroom)
    n_chips = chips or nodes * hw.chips_per_node
    plan, plans = best_plan(costs, hw, workload, n_chips, model)
    recipe = launch_recipe(plan, model, scheme, kv_cache, hw)
    if as_json:
        sys.stdout.write(json.dumps(plan_json(model, costs, hw, plan, plans[:6], recipe), indent=2) + "\n")
    else:
        render_plan(console, model, costs, hw, plan, plans, recipe)
