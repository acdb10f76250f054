"""Plan and validation output: rich tables for people, one JSON document for programs."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from deltamoe.plan.accelerator import Hardware
from deltamoe.plan.costs import ModelCosts
from deltamoe.plan.recipe import Recipe
from deltamoe.plan.search import GB, Plan, PoolEstimate
from deltamoe.plan.validate import LOW, HIGH, ValidationRow

MiB = 2**20
USED_FIGURES = ("mem_gb", "hbm_tbps", "bf16_tflops", "fp8_tflops", "fp4_tflops", "int8_tops", "scaleup_gbps",
                "scaleup_domain", "scaleout_gbps", "chips_per_node")


def costs_json(costs: ModelCosts, context: int) -> dict[str, Any]:
    p = costs.params
    return {
        "params": {"total": p.total, "text": p.text_total, "active": p.active, "routed": p.routed,
                   "non_routed": p.non_routed, "vision": p.vision},
        "weights_scheme": costs.scheme.name,
        # What the scheme counts (e.g. fp8 keeps embedding, lm_head and vision in BF16, where
        # `deltamoe info`'s FP8 figure counts every parameter in FP8).
        "weights_scheme_description": costs.scheme.description,
        "weight_bytes": costs.weights.as_dict(),
        "kv_cache_format": costs.kv.name,
        "cache": {
            "mla_latent_bytes_per_token_per_layer": costs.mla_bytes_per_token_layer,
            "dsa_indexer_bytes_per_token_per_layer": costs.indexer_bytes_per_token_layer if p.n_dsa else 0,
            "kv_bytes_per_token": costs.kv_bytes_per_token,
            "kda_recurrent_bytes_per_seq_per_layer": costs.kda_recurrent_bytes_per_layer if p.n_kda else 0,
            "kda_conv_bytes_per_seq_per_layer": costs.kda_conv_bytes_per_layer if p.n_kda else 0,
            "kda_state_bytes_per_seq": costs.kda_state_bytes_per_seq,
            "seq_bytes_at_context": costs.seq_cache_bytes(context),
        },
        "moe_a2a_bytes_per_token_per_layer": costs.a2a_bytes_per_token_layer(),
        "flops_per_token": {"linear": sum(costs.linear_flops_per_token),
                            "attention_decode_at_context": costs.attention_flops_decode(context),
                            "attention_prefill_at_context": costs.attention_flops_prefill(context)},
    }


def plan_json(model: str, costs: ModelCosts, hw: Hardware, plan: Plan, alternatives: list[Plan],
              recipe: Recipe, slo_reason: str = "", fastest: Plan | None = None) -> dict[str, Any]:
    """`fastest`: the throughput-optimal plan without an SLO, when the SLO was a default."""
    def one(p: Plan) -> dict[str, Any]:
        return {"mode": p.mode, "chips": p.chips, "meets_slo": p.meets(),
                "output_tok_s_per_chip": p.output_per_chip, "total_tok_s_per_chip": p.total_per_chip,
                "requests_per_s": p.requests_per_s, "ttft_ms": p.ttft_s * 1e3, "tpot_ms": p.tpot_s * 1e3,
                "prefill": p.prefill.to_json() if p.prefill else None, "decode": p.decode.to_json()}

    doc = {"model": model, **costs_json(costs, plan.workload.context), "hardware": hw.to_json(),
           "workload": asdict(plan.workload), "slo_choice": slo_reason, "plan": one(plan),
           "alternatives": [one(p) for p in alternatives], "recipe": recipe.to_json()}
    if fastest is not None:
        doc["throughput_optimal_without_slo"] = one(fastest)
    return doc


def _gb(x: float) -> str:
    return f"{x / GB:,.1f} GB"


def render_plan(console: Console, model: str, costs: ModelCosts, hw: Hardware, plan: Plan,
                alternatives: list[Plan], recipe: Recipe, slo_reason: str = "", fastest: Plan | None = None) -> None:
    """`slo_reason` says where the SLO came from; `fastest` is the plan without it (shown beside a default)."""
    p, w = costs.params, plan.workload
    head = Table(title=f"{model} on {plan.chips} x {hw.name} — {costs.scheme.name} weights, {costs.kv.name} KV",
                 show_header=False)
    head.add_row("parameters", f"{p.total:,} total, {p.active:,} active per token")
    wb = costs.weights
    head.add_row("weights", f"{_gb(wb.total)} (routed experts {_gb(wb.routed)}, rest {_gb(wb.non_routed)}; "
                 f"{costs.scheme.name}: {costs.scheme.description})")
    head.add_row("cache per token", f"{costs.kv_bytes_per_token:,.0f} B ({p.n_mla} attention layers"
                 + (f", {p.n_dsa} with DSA keys)" if p.n_dsa else ")"))
    if p.n_kda:
        head.add_row("KDA state per sequence", f"{costs.kda_state_bytes_per_seq / MiB:,.1f} MiB "
                     f"({p.n_kda} layers, fixed in context)")
    head.add_row("sequence at context", f"{_gb(costs.seq_cache_bytes(w.decode_context))} "
                 f"({w.context} in + {w.output} out, mean {w.decode_context})")
    head.add_row("MoE all-to-all per token", f"{costs.a2a_bytes_per_token_layer() / 1e3:,.1f} KB per layer "
                 f"x {p.n_moe} layers")
    slo = ", ".join(x for x in (f"TTFT <= {w.slo_ttft_s:g} s" if w.slo_ttft_s else "",
                                f"TPOT <= {w.slo_tpot_s * 1e3:g} ms" if w.slo_tpot_s else "") if x) or "none"
    head.add_row("SLO", slo + (f" — {slo_reason}" if slo_reason else ""))
    if fastest is not None:
        head.add_row("without the SLO", f"{fastest.output_per_chip:,.1f} output tok/s per chip at TTFT "
                     f"{fastest.ttft_s * 1e3:,.0f} ms, TPOT {fastest.tpot_s * 1e3:,.1f} ms ({_layouts(fastest)})")
    console.print(head)

    why = "most output tok/s per chip" + (" that meets the SLO" if w.slo_ttft_s or w.slo_tpot_s else "")
    if not plan.meets():  # nothing meets it: this is the best there is, tagged below
        why = "no layout meets the SLO; most output tok/s per chip"
    pools = Table(title=f"chosen plan ({why}): {plan.mode}, {plan.output_per_chip:,.1f} output tok/s per chip "
                  f"({plan.total_per_chip:,.0f} in+out), TTFT {plan.ttft_s * 1e3:,.0f} ms, "
                  f"TPOT {plan.tpot_s * 1e3:,.1f} ms" + ("" if plan.meets() else "  [SLO NOT MET]"))
    for col in ("pool", "chips", "layout", "batch/rank", "mem/chip", "step", "bound", "tok/s/chip", "latency"):
        pools.add_column(col)
    for role, pool in (("prefill", plan.prefill), (plan.decode.layout.role, plan.decode)):
        if pool is not None:
            pools.add_row(*_pool_row(role, pool))
    console.print(pools)

    step = Table(title="step breakdown per chip (ms)")
    for col in ("pool", "compute", "HBM", "scale-up", "scale-out", "fixed", "overlap", "matmul dtypes"):
        step.add_column(col)
    for role, pool in (("prefill", plan.prefill), (plan.decode.layout.role, plan.decode)):
        if pool is not None:
            s = pool.step
            step.add_row(role, f"{s.compute_s * 1e3:.2f}", f"{s.hbm_s * 1e3:.2f}", f"{s.scaleup_s * 1e3:.2f}",
                         f"{s.scaleout_s * 1e3:.2f}", f"{s.fixed_s * 1e3:.2f}", "yes" if s.overlapped else "no",
                         "/".join(s.compute_dtypes))
    console.print(step)

    if len(alternatives) > 1:
        alt = Table(title="alternatives")
        for col in ("mode", "prefill", "decode", "out tok/s/chip", "TTFT ms", "TPOT ms", "SLO"):
            alt.add_column(col)
        for a in alternatives[1:6]:
            alt.add_row(a.mode, f"{a.prefill.layout.describe()} on {a.prefill.layout.chips}" if a.prefill else "-",
                        f"{a.decode.layout.describe()} on {a.decode.layout.chips}, {a.decode.batch}/rank",
                        f"{a.output_per_chip:,.1f}", f"{a.ttft_s * 1e3:,.0f}", f"{a.tpot_s * 1e3:,.1f}",
                        "ok" if a.meets() else "miss")
        console.print(alt)

    figs = Table(title=f"hardware numbers used ({hw.origin})")
    for col in ("number", "value", "tag", "source"):
        figs.add_column(col)
    for name in USED_FIGURES:
        f = hw.figure(name)
        figs.add_row(name, "-" if f.value is None else f"{f.value:g}", f.tag, f.source)
    e = hw.efficiency
    figs.add_row("efficiency", f"MFU {e.mfu_prefill}/{e.mfu_decode}, MBU {e.mbu}, links {e.scaleup_eff}/"
                 f"{e.scaleout_eff}, overlap {e.overlap_eff}", "assumed", e.source)
    console.print(figs)
    console.print("[bold]launch recipe[/bold]")
    console.print(recipe.text(), markup=False, highlight=False, soft_wrap=True)


def _layouts(plan: Plan) -> str:
    decode = f"{plan.decode.layout.describe()} on {plan.decode.layout.chips}, {plan.decode.batch}/rank"
    if plan.prefill is None:
        return f"{plan.mode} {decode}"
    return f"{plan.mode}: prefill {plan.prefill.layout.describe()} on {plan.prefill.layout.chips}, decode {decode}"


def _pool_row(role: str, pool: PoolEstimate) -> list[str]:
    lat = f"TTFT {pool.latency_s * 1e3:,.0f} ms" if role == "prefill" else f"TPOT {pool.latency_s * 1e3:,.1f} ms"
    batch = f"{pool.batch} tok" if role == "prefill" else f"{pool.batch} seq"
    return [role, str(pool.layout.chips), pool.layout.describe(), batch,
            f"{pool.memory.total / GB:,.0f}/{pool.memory.capacity / GB:,.0f} GB",
            f"{pool.step.total_s * 1e3:,.1f} ms", pool.step.bound, f"{pool.per_chip:,.1f}", lat]


def render_validation(console: Console, rows: list[ValidationRow]) -> None:
    table = Table(title=f"planner estimates vs published figures (goal {LOW}x-{HIGH}x)")
    for col in ("figure", "setup", "metric", "published", "estimate", "ratio", "note"):
        table.add_column(col)
    for r in rows:
        ratio = f"{r.ratio:.2f}" + ("" if r.within else " !")
        table.add_row(r.system, r.setup, r.metric, f"{r.published:,.2f}", f"{r.estimate:,.2f}", ratio, r.note)
    console.print(table)
