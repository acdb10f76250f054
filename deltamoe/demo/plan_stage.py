"""Demo stage 3: deployment plans for the real Kimi K3.1 Pro, the planner's way.

Three targets: four 8 x H200 nodes; the Zhenwu M890 SuperPoD from the catalog, which the
planner refuses because T-Head has not published the numbers a roofline needs (the refusal is
shown as it is); and the same SuperPoD with those numbers filled in by stated assumptions
(deltamoe/plan/examples/m890-superpod-assumed.yaml, every such figure tagged "user").
The screen gets one row per target; the full tables and JSON go to plans/.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from deltamoe.demo.run_folder import RunFolder
from deltamoe.errors import DeltaMoEError
from deltamoe.hf_config import load_config
from deltamoe.plan.costs import model_costs
from deltamoe.plan.hardware import get_hardware
from deltamoe.plan.recipe import launch_recipe
from deltamoe.plan.report import plan_json, render_plan
from deltamoe.plan.search import GB, Plan, Workload, best_plan

MODEL = "kimi-k3.1-pro"
WEIGHTS = "mxfp4"  # the released checkpoints' native expert format
KV_CACHE = "bf16"
# The README's serving target: 8K prompts, 1K outputs, TPOT <= 50 ms, TTFT <= 3 s.
WORKLOAD = Workload(context=8192, output=1024, slo_ttft_s=3.0, slo_tpot_s=0.05)
ASSUMED_M890 = Path(__file__).resolve().parent.parent / "plan" / "examples" / "m890-superpod-assumed.yaml"


@dataclass(frozen=True)
class Target:
    key: str  # file stem under plans/
    label: str
    hardware: str  # catalog name or hardware file
    nodes: int


TARGETS = (
    Target("h200-4-nodes", "4 nodes x 8 H200", "h200", 4),
    Target("m890-superpod", "M890 SuperPoD", "m890-superpod", 1),
    Target("m890-superpod-assumed", "M890 SuperPoD (assumed numbers)", str(ASSUMED_M890), 1),
)


def plan_target(folder: RunFolder, target: Target) -> dict[str, Any]:
    """Plan one target; a refusal is a result too (its message, the field it names, the hint)."""
    try:
        cfg = load_config(MODEL)
        hw = get_hardware(target.hardware)
        costs = model_costs(cfg, WEIGHTS, KV_CACHE)
        plan, plans = best_plan(costs, hw, WORKLOAD, target.nodes * hw.chips_per_node, MODEL)
    except DeltaMoEError as e:
        folder.write_text(f"plans/{target.key}.txt", f"refused: {e.one_line()}\n")
        return {"label": target.label, "hardware": target.hardware, "refused": str(e), "field": e.field,
                "hint": e.hint}
    recipe = launch_recipe(plan, MODEL, WEIGHTS, KV_CACHE, hw)
    buf = io.StringIO()
    render_plan(Console(file=buf, width=200, color_system=None), MODEL, costs, hw, plan, plans, recipe)
    folder.write_text(f"plans/{target.key}.txt", buf.getvalue())
    folder.write_json(f"plans/{target.key}.json", plan_json(MODEL, costs, hw, plan, plans[:6], recipe))
    assumed = {n: {"value": f.value, "source": f.source} for n, f in hw.figures.items() if f.tag == "user"}
    return {"label": target.label, "hardware": target.hardware, "chips": plan.chips, **_summary(plan),
            "assumed_figures": assumed}


def _summary(plan: Plan) -> dict[str, Any]:
    d = plan.decode
    layout = (f"{plan.prefill.layout.describe()} prefill + {d.layout.describe()} decode" if plan.prefill
              else d.layout.describe())
    return {"mode": plan.mode, "layout": layout, "seqs_per_rank": d.batch,
            "output_tok_s_per_chip": round(plan.output_per_chip, 1), "ttft_ms": round(plan.ttft_s * 1e3),
            "tpot_ms": round(plan.tpot_s * 1e3, 1), "bound": d.step.bound, "meets_slo": plan.meets(),
            "memory_gb_per_chip": round(d.memory.total / GB), "usable_gb_per_chip": round(d.memory.capacity / GB)}


def run_plans(folder: RunFolder, console: Console) -> dict[str, Any]:
    results = {t.key: plan_target(folder, t) for t in TARGETS}
    table = Table(title=f"{MODEL}: {WEIGHTS} experts, 8K in / 1K out, TTFT <= 3 s, TPOT <= 50 ms", box=box.SIMPLE)
    table.add_column("target", max_width=18)
    table.add_column("chosen layout", min_width=24)
    table.add_column("out tok/s\nper chip", justify="right")
    table.add_column("TTFT /\nTPOT", justify="right")
    table.add_column("bound")
    for r in results.values():
        if "refused" in r:
            table.add_row(r["label"], "[yellow]refused: numbers not published (below)", "", "", "")
            continue
        table.add_row(r["label"], f"{r['layout']}\n{r['mode']} on {r['chips']} chips\n{r['seqs_per_rank']} seq/rank, "
                      f"{r['memory_gb_per_chip']}/{r['usable_gb_per_chip']} GB",
                      f"{r['output_tok_s_per_chip']:,.1f}", f"{r['ttft_ms'] / 1e3:.2f} s\n{r['tpot_ms']} ms"
                      + ("" if r["meets_slo"] else "\n[red]SLO missed"), r["bound"])
    console.print(table)
    for r in results.values():
        if "refused" in r:
            console.print(f"[yellow]{r['label']}: refused[/] ({r['refused']})", highlight=False)
        if r.get("assumed_figures"):
            listed = "; ".join(f"{n} = {f['value']:g} ({f['source']})" for n, f in r["assumed_figures"].items())
            console.print(f"[bold yellow]{r['label']}[/]: these are user inputs from {Path(r['hardware']).name}, "
                          f"not vendor figures: {listed}", highlight=False)
    console.print(f"full tables, alternatives and launch recipes: {folder.plans}/")
    return results
