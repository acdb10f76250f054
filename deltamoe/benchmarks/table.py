"""The README benchmark table, rendered from bench/results/*.json.

One formatter per results file turns its JSON into table rows (figures, peer, ratio, target and
whether it is met), so the README carries exactly what the last full run measured. Quick runs
(`*_quick.json`) are smoke tests and never reach the table. Targets and notes come from the
JSON too (each script writes its `target`; a `note` attached to one run stays with that run).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

from deltamoe.errors import ConfigError

START = "<!-- bench-table:start -->"
END = "<!-- bench-table:end -->"
HEADERS = ["benchmark (command)", "deltamoe", "peer", "ratio", "target"]

Row = list[str]  # one cell per header


# --- number formats ------------------------------------------------------------------------


def ms(seconds: float) -> str:
    v = seconds * 1e3
    return f"{v:.1f}" if v < 10 else f"{v:,.0f}"


def secs(seconds: float) -> str:
    return f"{seconds:.2f}" if seconds < 10 else f"{seconds:,.1f}"


def times(x: float) -> str:
    """A ratio: two decimals near 1 and wherever one decimal would round onto a whole-number goal
    (4.97x must not read 5.0x beside a missed >= 5x), one otherwise."""
    near_whole = abs(x - round(x)) < 0.05 and f"{x:.2f}" != f"{round(x):.2f}"
    return f"{x:.2f}x" if x < 1.1 or near_whole else f"{x:.1f}x"


def rate(x: float) -> str:
    return f"{x:,.0f}"


def bold(text: str) -> str:
    return f"**{text}**"


def verdict(goals: list[tuple[str, bool]], note: str | None = None) -> str:
    """'>= 1.5x (met)', or each goal with its own verdict when they differ; a run's note after."""
    if all(met for _, met in goals) or not any(met for _, met in goals):
        text = " / ".join(g for g, _ in goals) + (" (met)" if goals[0][1] else " (missed)")
    else:
        text = " / ".join(f"{g} ({'met' if met else 'missed'})" for g, met in goals)
    return f"{text}; {note}" if note else text


def command(suite: str) -> str:
    return f"(`deltamoe bench {suite}`)"


# --- one formatter per results file ---------------------------------------------------------


def vs_recurrence(row: dict, prefix: str) -> float:
    """The ratio to the recurrence a goal is judged by: the lower of the medians' ratio and the
    fastest runs' ratio. The recurrence's time varies with the page faults its per-token states
    take (what the process allocated before it; docs/model.md, "Measuring the KDA ops"), so a
    median over faulting rounds alone would flatter the chunked op."""
    best = row.get(f"best_{prefix}speedup_vs_recurrent")
    median = row[f"{prefix}speedup_vs_recurrent"]
    return median if best is None else min(median, best)


def fastest_runs(row: dict, prefix: str) -> str:
    """' (fastest runs: Nx)' where the bench recorded them and they differ from the medians' ratio."""
    best = row.get(f"best_{prefix}speedup_vs_recurrent")
    faults = row.get("recurrent_kda_faults")
    if best is None or abs(best - row[f"{prefix}speedup_vs_recurrent"]) < 0.05 * best:
        return ""
    return f" (fastest runs {times(best)}" + (f"; recurrence median run {faults:,} page faults)" if faults else ")")


def kda_rows(d: dict) -> list[Row]:
    rows = sorted(d["rows"], key=lambda r: r["T"], reverse=True)
    top, rest = rows[0], rows[1:]
    c, t = d["config"], d.get("target", {})
    goals = []
    if "speedup_vs_transformers" in t:
        goals.append((f">= {t['speedup_vs_transformers']:g}x", top["speedup_vs_transformers"] >= t["speedup_vs_transformers"]))
    if "speedup_vs_recurrent" in t:
        goals.append((f">= {t['speedup_vs_recurrent']:g}x", vs_recurrence(top, "") >= t["speedup_vs_recurrent"]))
    threads = f", {c['threads']} thread{'s' if c['threads'] != 1 else ''}" if "threads" in c else ""
    threads += ", CPU time" if c.get("clock") == "process CPU time" else ""
    out = [[f"KDA prefill, {c['dtype'].replace('float', 'fp')}, B={c['B']} H={c['H']} K=V={c['K']}, T={top['T']}{threads} "
            + command("kda"),
            f"{ms(top['chunk_kda_s'])} ms",
            f"transformers torch chunk KDA {ms(top['transformers_s'])} ms; plain recurrence {ms(top['recurrent_kda_s'])} ms",
            f"{bold(times(top['speedup_vs_transformers']))} / {bold(times(top['speedup_vs_recurrent']))}"
            + fastest_runs(top, ""),
            verdict(goals, d.get("note")) if goals else ""]]
    if "chunk_kda_torch_path_s" in top:  # the fused kernel (ops/kda_fused.py) beside the torch path
        out.append(["same, chunk_kda's torch path (its fused kernel off: `DELTAMOE_KDA_KERNEL=0`, what training runs)",
                    f"{ms(top['chunk_kda_torch_path_s'])} ms", f"the fused kernel {ms(top['chunk_kda_s'])} ms",
                    f"kernel {times(top['kernel_vs_torch_path'])} the torch path", ""])
    if "compiled_chunk_kda_s" in top:  # `--compiled`: ops/kda_compiled.py beside the eager op
        first_compile = max(r.get("compile_cpu_s", 0.0) for r in rows)  # the first T compiles; later ones reuse it
        compiled_goals = [(f">= {t[key]:g}x", (vs_recurrence(top, "compiled_") if key == "speedup_vs_recurrent"
                                                else top[f"compiled_{key}"]) >= t[key])
                          for key in ("speedup_vs_transformers", "speedup_vs_recurrent") if key in t]
        out.append([f"same, compiled_chunk_kda (torch.compile of each group of chunk steps; compile "
                     f"{first_compile:.0f} CPU s on the first call)", f"{ms(top['compiled_chunk_kda_s'])} ms",
                    f"eager chunk_kda {ms(top['chunk_kda_s'])} ms (compiled at {times(top['compiled_vs_eager'])} its speed)",
                    f"{times(top['compiled_speedup_vs_transformers'])} / {times(top['compiled_speedup_vs_recurrent'])}"
                    + fastest_runs(top, "compiled_"),
                    verdict(compiled_goals) if compiled_goals else ""])
    if rest:
        def join(key: str) -> str:
            return " / ".join(ms(r[key]) for r in rest)
        out.append([f"same, T={' / '.join(str(r['T']) for r in rest)}", f"{join('chunk_kda_s')} ms",
                    f"transformers {join('transformers_s')} ms; recurrence {join('recurrent_kda_s')} ms",
                    " / ".join(times(r["speedup_vs_transformers"]) for r in rest) + "; "
                    + " / ".join(times(r["speedup_vs_recurrent"]) for r in rest), ""])
    return out


def kda_k128_rows(d: dict) -> list[Row]:
    """`bench_kda.py --head-dim 128` (K3's head size; `--threads N` when not the default 2): the same
    rows, with the command that made them."""
    rows = kda_rows(d)
    threads = d["config"].get("threads", 2)
    flags = "--head-dim 128" + ("" if threads == 2 else f" --threads {threads}")
    flags += " --compiled" if "compiled_chunk_kda_s" in d["rows"][0] else ""
    flags += " --cpu-time" if d["config"].get("clock") == "process CPU time" else ""
    flags += " --allocator default" if d["config"].get("allocator") == "default" else ""
    rows[0][0] = rows[0][0].replace(command("kda"), f"(`python bench/bench_kda.py {flags}`)")
    return rows


def serve_structured_rows(d: dict) -> list[Row]:
    tpot = {(r["concurrency"], r["schema"]): r for r in d["tpot"]}
    streams = sorted({c for c, _ in tpot})
    with_, without = ([tpot[(c, flag)]["tpot_ms_median"] for c in streams] for flag in (True, False))
    label = (f"structured outputs (llguidance JSON schema) vs free text, `{d['model']}`, {d['input_len']} in / "
             f"{d['output_len']} out tokens, {' / '.join(map(str, streams))} streams, TPOT p50 {command('serve_structured')}")
    rows: list[Row] = [[label, " / ".join(f"{v:.1f}" for v in with_) + " ms",
                        "no schema " + " / ".join(f"{v:.1f}" for v in without) + " ms",
                        " / ".join(times(a / b) for a, b in zip(with_, without)) + " the time", ""]]
    choices = {r["mode"]: r for r in d.get("choices", [])}
    if len(choices) == 2:
        sep, fork = choices["4 separate requests"], choices["n=4 in one request"]
        rows.append(["same, n = 4 in one request (one prefill, forked) vs 4 separate requests",
                     f"{rate(fork['output_tok_per_s'])} tok/s", f"4 requests {rate(sep['output_tok_per_s'])} tok/s",
                     times(fork["output_tok_per_s"] / sep["output_tok_per_s"]), ""])
    return rows


def train_offload_rows(d: dict) -> list[Row]:
    r = d["results"]
    modes = ["checkpointing", "offload", "both"]
    cut, slow = d["goal_memory_cut"], d["goal_slowdown"]
    what = "saved activations kept resident" if d["memory"] == "resident_saved_bytes" else "peak memory"
    label = (f"activation checkpointing / offload to host / both vs none, `{d['preset']}` {d['batch']} x {d['seq']} "
             f"on {d['device']}, {what} and step time {command('train_offload')}")
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    met = all(r[m]["memory_cut"] >= cut and r[m]["slowdown"] <= slow for m in modes)
    return [[label, " / ".join(f"{mib(r[m]['resident_saved_bytes'])}, {r[m]['step_s']:.1f} s" for m in modes),
             f"none {mib(r['none']['resident_saved_bytes'])}, {r['none']['step_s']:.1f} s",
             " / ".join(f"-{r[m]['memory_cut']:.0%}".replace("%", " %") for m in modes),
             verdict([(f">= {cut:.0%} less for <= {slow:.0%} more time".replace("%", " %"), met)],
                     "on a CPU the host is the same memory: bytes counted by the hooks")]]


def train_fp8_rows(d: dict) -> list[Row]:
    """Mean over the seed pairs of each run's final losses and of fp8's gaps, with the gaps' spread
    and the reference's own seed-to-seed spread (the size of gap noise alone makes)."""
    prec, goal = d["precision"], d["goal_rel_gap"]
    ref, fp8 = d[prec], d["fp8_blockwise"]
    mean = lambda runs, key: sum(r[key] for r in runs) / len(runs)  # noqa: E731
    pct = lambda x, sign="+": f"{x:{sign}.1%}".replace("%", " %")  # noqa: E731
    schedule = d.get("schedule_steps", d["steps"])
    steps = f"{d['steps']} steps" if schedule == d["steps"] else (
        f"the first {d['steps']} of {schedule} steps (unfinished; eval loss at step {d['eval_step']})")
    label = (f"blockwise FP8 training (e4m3 operands, DeepSeek-V3 tiles, forward and backward) vs {prec}, `tiny` "
             f"byte-level LM on the repo's docs, {steps}, {d['seeds']} seeds (each pair: same weights "
             f"and data order); train loss (mean of the last {d['tail_steps']} steps) / held-out eval loss, "
             f"mean over seeds {command('train_fp8')}")
    gaps = (d["rel_gap"], d["eval_rel_gap"])
    return [[label, f"{mean(fp8, 'final_loss'):.4f} / {mean(fp8, 'eval_loss'):.4f}",
             f"{prec} {mean(ref, 'final_loss'):.4f} / {mean(ref, 'eval_loss'):.4f}",
             " / ".join(f"{pct(g['mean'])} +- {pct(g['std'], '')}" for g in gaps)
             + f" (seed to seed: {pct(d['seed_rel_spread'], '')} / {pct(d['seed_eval_rel_spread'], '')})",
             verdict([(f"mean within {goal:.0%}".replace("%", " %"), all(abs(g["mean"]) <= goal for g in gaps))],
                     "on a CPU the e4m3 products are an exact emulation" if d.get("device", "cpu") == "cpu" else None)]]


def ep_overlap_rows(d: dict) -> list[Row]:
    c = d["chunks"]
    base, over = d["chunks_1"], d[f"chunks_{c}"]
    label = (f"overlapped expert all-to-all (`--ep-chunks {c}`, asynchronous) vs one exchange, 2 gloo ranks, "
             f"`--ep 2`, `tiny`; exposed all-to-all per step from the run's own traces (deltamoe trace) "
             f"{command('ep_overlap')}")
    a, b = over["exposed_alltoall_s_per_step"], base["exposed_alltoall_s_per_step"]
    return [[label, f"{ms(a)} ms (step {ms(over['step_s'])} ms)", f"one exchange {ms(b)} ms (step {ms(base['step_s'])} ms)",
             f"{times(a / b)} the exposed time" if b > 0 else "",
             verdict([("less exposed, same losses", a < b and d["same_losses"])],
                      "gloo's threads and the training threads share the cores")]]


def speedup_goal(d: dict) -> str:
    goal = d.get("target", {}).get("speedup")
    return verdict([(f">= {goal:g}x", d["speedup"] >= goal)], d.get("note")) if goal else d.get("note", "")


def model_forward_rows(d: dict) -> list[Row]:
    t = d["seq_len"]
    return [[f"whole-model forward, hidden {d['hidden']}, {d['layers']} layers, T={t} {command('model_forward')}",
             f"{rate(t / d['deltamoe_s'])} tok/s", f"transformers KimiLinear {rate(t / d['transformers_s'])} tok/s",
             bold(times(d["speedup"])), speedup_goal(d)]]


def train_throughput_rows(d: dict) -> list[Row]:
    tps = d["tokens_per_s"]
    return [[f"training step, hidden {d['hidden']}, {d['layers']} layers, batch {d['batch']}x{d['seq_len']}, AdamW "
             + command("train_throughput"),
             f"{rate(tps['deltamoe'])} tok/s", f"transformers KimiLinear {rate(tps['transformers'])} tok/s",
             bold(times(d["speedup"])), speedup_goal(d)]]


def train_quality_rows(d: dict) -> list[Row]:
    data = d["settings"]["data"]
    minutes = d["wall_s"] / 60
    acc, goal_acc, goal_min = d["final_accuracy"], d["target_accuracy"], d.get("target_minutes")
    goal = f">= {goal_acc:.0%}".replace("%", " %") + (f" in <= {goal_min:g} min" if goal_min else "")
    met = d["reached"] and (goal_min is None or minutes <= goal_min)
    return [[f"time-to-quality: `tiny` on associative recall ({data['num_pairs']} pairs) {command('train_quality')}",
             f"{acc * 100:.1f} % held-out in {d['steps']} steps, {minutes:.1f} min", "", "",
             verdict([(goal, met)], d.get("note"))]]


ASYNC_MODE = ", async scheduling"  # suffix of bench_serve_offline.py's one-step-ahead modes
MULTI_STEP_MODE = re.compile(r", multi-step \d+$")  # suffix of its multi-step modes (windows of N decode steps)


def serve_offline_rows(d: dict) -> list[Row]:
    w, tps = d["workload"], dict(d["tokens_per_s"])
    ours = {name: tps.pop(name) for name in list(tps) if name.startswith("deltamoe engine")}
    peers = "; ".join(f"{name.removeprefix('transformers, ').removesuffix(' (left pad)')} {rate(v)}"
                      for name, v in sorted(tps.items(), key=lambda kv: -kv[1]))
    best_peer = max(tps.values())
    d = {**d, "speedup": d["speedup_vs_best_transformers"]}
    label = (f"offline serving, {w['prompts']} prompts x {w['new_tokens']} tokens, Kimi Linear tiny "
             + command("serve_offline"))
    rows: list[Row] = []
    for name, value in ours.items():  # the headline (first) mode carries the goal
        mode = name.removeprefix("deltamoe engine").removeprefix(", ")
        # An async or multi-step mode is compared with its one-step mode.
        one_step = MULTI_STEP_MODE.sub("", name.removesuffix(ASYNC_MODE))
        if one_step != name and one_step in ours:
            rows.append([f"same, deltamoe {mode}", f"{rate(value)} tok/s",
                         f"{one_step.removeprefix('deltamoe engine, ')}, one step at a time {rate(ours[one_step])}",
                         times(value / ours[one_step]), ""])
            continue
        rows.append([label + (f", {mode}" if mode else "") if not rows else f"same, deltamoe {mode}",
                     f"{rate(value)} tok/s", f"transformers {peers}" if not rows else "",
                     bold(times(value / best_peer)) if not rows else times(value / best_peer),
                     speedup_goal(d) if not rows else ""])
    return rows


def compile_start_rows(d: dict) -> list[Row]:
    c, first, steps = d["config"], d["first_start"], d["step_ms"]
    target = d["target"]["first_start_s"]
    form = c.get("form", "parts" if c["mode"] == "regions" else "whole")  # older files name only the mode
    mode = {"parts": "attention + FFN regions", "layers": "whole-layer regions", "whole": "whole call"}[form]
    start = "first start (empty inductor cache)" if c.get("fresh_cache", True) else "start from inductor's disk cache"
    # `deltamoe bench compile_start` runs the default form, whole layers
    how = command("compile_start") if form == "layers" else f"(`python bench/bench_compile_start.py --form {form}`)"
    b = str(c["batch"])
    compiled, eager = steps["compiled"], steps["eager"]
    return [
        [f"compiled decode, {start}, `{c['preset']}`, {c['threads']} threads, {mode} "
         f"{how}", f"{secs(first['wall_s'])} s ({secs(first['cpu_s'])} s CPU), "
         f"{first['graphs']} graphs", "", "", verdict([(f"<= {target:.0f} s", first["wall_s"] <= target)])],
        [f"same, decode step at batch 1 / {b}, compiled vs eager",
         f"{compiled['1']['wall_ms']:.1f} / {compiled[b]['wall_ms']:.1f} ms",
         f"eager {eager['1']['wall_ms']:.1f} / {eager[b]['wall_ms']:.1f} ms",
         " / ".join(times(eager[k]["wall_ms"] / compiled[k]["wall_ms"]) for k in ("1", b)), ""],
    ]


def serve_dsa_decode_rows(d: dict) -> list[Row]:
    eager = d
    compiled = d.get("compiled")
    head = compiled or eager  # the fastest mode measured carries the goal
    res = head["results"]
    ctx = " / ".join(f"{r['context'] // 1024}k" for r in res)
    t = d.get("target", {})
    batched = head.get("batched")

    def at_target(rows: list[dict]) -> bool:
        at = next((r for r in rows if r["context"] == t["context"]), None)
        return at is not None and at["speedup"] >= t["speedup"]

    goal = ""
    if "speedup" in t:
        goals = [(f">= {t['speedup']:g}x at {t['context'] // 1024}k, one sequence", at_target(res))]
        if batched:
            goals.append((f"{batched['batch']} sequences", at_target(batched["results"])))
        goal = verdict(goals, d.get("note"))

    def curve(label: str, rows: list[dict], key: str = "speedup", dsa: str = "dsa_ms", dense: str = "dense_mla_ms",
              strong: bool = False) -> Row:
        ratios = [times(r[key]) for r in rows]
        if strong:
            ratios[-1] = bold(ratios[-1])
        return [label, " / ".join(f"{r[dsa]:.1f}" for r in rows) + " ms",
                "dense " + " / ".join(f"{r[dense]:,.1f}" for r in rows) + " ms", " / ".join(ratios), ""]

    mode = ", compiled decode" if compiled else ""
    out = [curve(f"DSA vs dense MLA decode step at {ctx} context, top-k {d['config']['index_topk']}, one sequence"
                 f"{mode} " + command("serve_dsa_decode"), res, strong=True)]
    out[0][-1] = goal
    if compiled:
        out.append(curve("same, eager", eager["results"]))
    if all("layer_speedup" in r for r in eager["results"]):
        out.append(curve("same, the attention layer alone" + (" (eager)" if compiled else ""), eager["results"],
                         "layer_speedup", "dsa_layer_ms", "dense_mla_layer_ms"))
    if head.get("scattered"):
        out.append(curve(f"same, one sequence on scattered blocks (a long-running server's pool){mode}",
                         head["scattered"]))
    if batched:
        out.append(curve(f"same, a decode batch of {batched['batch']} sequences{mode}", batched["results"], strong=True))
        if compiled and eager.get("batched"):
            out.append(curve(f"same, a decode batch of {batched['batch']} sequences, eager", eager["batched"]["results"]))
    return out


def serve_cache_bytes_rows(d: dict) -> list[Row]:
    variants, t = d["variants"], d.get("target", {})
    dense = next(v for v in variants.values() if v["state_bytes_per_sequence"] == 0)
    out = []
    for name, v in variants.items():
        if v is dense:
            continue
        ratio = v["per_token_vs_all_mla"]
        goal = ""
        if t.get("variant") == name:
            low, high = t["per_token_vs_all_mla"]
            goal = verdict([(f"about 1/4, {low:g}-{high:g}", low <= ratio <= high)], d.get("note"))
        label = (f"cache bytes per token, {name} vs all-MLA {command('serve_cache_bytes')}" if not out
                 else f"same, {name}")
        out.append([label, f"{v['bytes_per_token']:,} B + {v['state_bytes_per_sequence'] / 2**20:,.1f} MiB state/seq",
                    f"{dense['bytes_per_token']:,} B", bold(f"{ratio:.2f}") if not out else f"{ratio:.2f}", goal])
    return out


def serve_online_rows(d: dict) -> list[Row]:
    runs = d["runs"]

    def join(key: str) -> str:
        return " / ".join(f"{r[key]:,.0f}" for r in runs)

    if d["config"].get("compile_decode"):
        label = "same, server with `--compile-decode` (`python bench/bench_serve_online.py --compile-decode`)"
    else:
        label = (f"online serving, {d['config']['model']}, {' / '.join(str(r['concurrency']) for r in runs)} clients "
                 + command("serve_online"))
    return [[label, f"TTFT p50 {join('p50_ttft_ms')} ms; TPOT p50 {join('p50_tpot_ms')} ms", "(no peer server run)",
             "", d.get("note", "")]]


def serve_disagg_rows(d: dict) -> list[Row]:
    c, t, summary = d["config"], d.get("targets", {}), d["summary"]
    co, pd = d["colocated"], d["disaggregated"]
    tpot = summary["p99_chat_tpot_colocated_over_disagg"]
    goal = f">= {t['p99_chat_tpot_colocated_over_disagg']:g}x p99 TPOT" if "p99_chat_tpot_colocated_over_disagg" in t else ""
    run = ("with async scheduling on every server (`python bench/bench_serve_disagg.py --async-scheduling`)"
           if c.get("async_scheduling") else command("serve_disagg"))
    out = [[f"P/D disaggregation (1 prefill + 1 decode, Mooncake TCP) vs one colocated server, {c['model']}: "
            f"{c['chats']} chats of {c['chat_len']} + {c['chat_output']} tokens beside a {c['long_len']}-token prompt "
            f"every {c['long_every']:g} s {run}",
            f"chat TPOT p99 {pd['chat_tpot_p99_ms']:,.0f} ms, gap p99 {pd['chat_itl_p99_ms']:,.0f} ms",
            f"colocated TPOT p99 {co['chat_tpot_p99_ms']:,.0f} ms, gap p99 {co['chat_itl_p99_ms']:,.0f} ms",
            f"{bold(times(tpot))} / {times(summary['p99_chat_itl_colocated_over_disagg'])}",
            verdict([(goal, tpot >= t["p99_chat_tpot_colocated_over_disagg"])], d.get("note")) if goal else ""]]
    idle = d["hand_off"]["idle"]
    worst = min(r["over_raw_tcp"] for r in idle)
    share = t.get("handoff_over_raw_tcp")
    # Runs before the notice was timed measured the copy path alone (no "copy_seconds" beside it).
    span = "prefill's finish -> cache in the decode server's pools" if "copy_seconds" in idle[0] \
        else "gather + write + scatter"
    out.append([f"same, one hand-off at a time ({span}) at "
                + " / ".join(f"{r['bytes_per_handoff'] / 2**20:.2f}" for r in idle) + " MiB",
                " / ".join(f"{r['gb_s']:.2f}" for r in idle) + " GB/s",
                "Mooncake raw TCP write " + " / ".join(f"{r['raw_tcp_gb_s']:.2f}" for r in idle) + " GB/s",
                " / ".join(bold(f"{r['over_raw_tcp']:.2f}") if r["over_raw_tcp"] == worst else f"{r['over_raw_tcp']:.2f}"
                           for r in idle),
                verdict([(f">= {share:.0%} of raw at every size".replace("%", " %"), worst >= share)]) if share else ""])
    for told, how in (("noticed", "notice"), ("marked", "marker")):  # runs before each was measured have none
        if f"raw_tcp_{told}_gb_s" not in idle[0]:
            continue
        out.append(["same, one hand-off at a time vs a raw write that also tells its receiver (isolated, with a "
                     f"completion {how}, until the receiver process has it) at "
                     + " / ".join(f"{r['bytes_per_handoff'] / 2**20:.2f}" for r in idle) + " MiB",
                     " / ".join(f"{r['gb_s']:.2f}" for r in idle) + " GB/s",
                     f"Mooncake raw TCP write + {how} " + " / ".join(f"{r[f'raw_tcp_{told}_gb_s']:.2f}" for r in idle)
                     + " GB/s", " / ".join(f"{r[f'over_raw_tcp_{told}']:.2f}" for r in idle),
                     "(beside the goal's reference, not instead of it)"])
    sustained = d["hand_off"].get("sustained")  # runs before it was measured have none
    for count in dict.fromkeys(r["in_flight"] for r in sustained or []):  # `--in-flight 4,8`: a row each
        rows = [r for r in sustained if r["in_flight"] == count]
        same_bytes = all("raw_tcp_same_bytes_gb_s" in r for r in rows)  # N raw writes back to back
        raw_key, ratio_key = (("raw_tcp_same_bytes_gb_s", "over_raw_tcp_same_bytes") if same_bytes
                              else ("raw_tcp_gb_s", "over_raw_tcp"))
        low = min(r[ratio_key] for r in rows)
        out.append([f"same, {count} hand-offs in flight (bytes / seconds with one on its way) at "
                    + " / ".join(f"{r['bytes'] / r['handoffs'] / 2**20:.2f}" for r in rows) + " MiB",
                    " / ".join(f"{r['gb_s']:.2f}" for r in rows) + " GB/s",
                    ("Mooncake raw TCP, the same bytes as " + str(count) + " writes back to back " if same_bytes
                     else "Mooncake raw TCP write ") + " / ".join(f"{r[raw_key]:.2f}" for r in rows) + " GB/s",
                    " / ".join(bold(f"{r[ratio_key]:.2f}") if r[ratio_key] == low else f"{r[ratio_key]:.2f}"
                               for r in rows),
                    verdict([(f">= {share:.0%} of raw at every size".replace("%", " %"), low >= share)]) if share
                    else ""])
    k3 = [r for r in d["bytes_per_handoff"] if r["model"].startswith("kimi-k3")]
    run = next((r for r in d["bytes_per_handoff"] if r["measured"] is not None), None)
    out.append(["same, bytes per hand-off: Kimi K3 (planner formulas) at "
                + " / ".join(f"{r['prompt_tokens'] // 1024}k" for r in k3) + " prompt tokens",
                " / ".join(f"{r['bytes'] / 2**20:,.0f} MiB" for r in k3),
                f"{c['model']}, this run: {run['measured'] / 2**20:.2f} MiB measured, {run['bytes'] / 2**20:.2f} MiB "
                "predicted" if run else "", "", ""])
    return out
def serve_online_vs_peer_rows(d: dict) -> list[Row]:
    runs, peer, ratios = d["runs"], d["peer_runs"], d["ratio_vs_peer"]
    clients = [str(r["concurrency"]) for r in runs]

    def join(rows: list[dict], key: str) -> str:
        return " / ".join(f"{r[key]:,.0f}" for r in rows)

    goal_at, goal = str(d["target"]["output_throughput_ratio_at"]), d["target"]["ratio"]
    headline = ratios.get(goal_at, {}).get("output_throughput")
    flags = "".join(f", `--{k.replace('_', '-')}`" for k in ("compile_decode", "async_scheduling")
                    if d["config"].get(k))
    label = (f"online serving vs `transformers serve`, {d['config']['model']}{flags}, {' / '.join(clients)} clients, "
             f"output tok/s and TPOT p50 (`python bench/bench_serve_online.py --peer transformers`)")
    ours = f"{join(runs, 'output_throughput')} tok/s; TPOT {join(runs, 'p50_tpot_ms')} ms"
    theirs = f"transformers serve {join(peer, 'output_throughput')} tok/s; TPOT {join(peer, 'p50_tpot_ms')} ms"
    ratio = " / ".join(times(ratios[c]["output_throughput"]) if c in ratios else "-" for c in clients)
    met = headline is not None and headline >= goal
    return [[label, ours, theirs, ratio, verdict([(f">= {goal:g}x at {goal_at} clients", met)], d.get("note"))]]


def serve_workers_rows(d: dict) -> list[Row]:
    w, layouts = d["workload"], d["layouts"]
    label = (f"offline serving over worker processes, `{w['model']}`, {w['prompts']} prompts x {w['new_tokens']} "
             f"tokens, {d['threads']} threads per layout " + command("serve_workers"))
    rows: list[Row] = []
    for name, r in layouts.items():
        # Compiled layouts compare with the compiled one-process run (the eager one is its own row).
        ref = "1 process, compiled" if r.get("compile_decode") and name != "1 process, compiled" \
            and "1 process, compiled" in layouts else "1 process"
        if r.get("torch_threads", d["threads"]) < d["threads"] and r["tp"] * r["ep"] == 1:
            # The async host thread took one of the layout's threads (bench_serve_workers.py).
            name = f"{name} ({r['torch_threads']} torch thread{'s' if r['torch_threads'] > 1 else ''} + its host thread)"
        rows.append([f"{label}: {name}" if not rows else f"same, {name}",
                     f"{rate(r['tokens_per_s'])} tok/s; TPOT {r['mean_tpot_ms']:.0f} ms",
                     ref if name != "1 process" else "", times(r["tokens_per_s"] / layouts[ref]["tokens_per_s"]),
                     d.get("note", "") if not rows else ""])
    return rows


def shard_load_rows(d: dict) -> list[Row]:
    """Per layout, the worst rank's peak memory while loading, each path: reading the rank's shard vs
    the whole model then cut (a float checkpoint), or vs one process loading it packed (`--format F`)."""
    whole, own = d["paths"]
    fmt = d.get("format")

    def mib(run: dict, path: str, key: str) -> str:
        return f"{max(r[key] for r in run['ranks'][path]) / 2**20:,.0f}"

    rows: list[Row] = []
    for run in d["layouts"]:
        layout = f"tp{run['tp']} ep{run['ep']}"
        if rows:
            label = f"same, {layout}"
        elif fmt is None:
            label = (f"a serving rank's load, peak memory above start (worst rank), `{d['preset']}` {d['dtype']} "
                     f"checkpoint, {layout} {command('shard_load')}")
        else:
            label = (f"same, `{d['preset']}` quantized --format {fmt} (packed experts kept packed), {layout} "
                     f"(`python bench/bench_shard_load.py --format {fmt}`)")
        reference = ("loading the whole model, then cutting it" if fmt is None else
                     f"loading it whole in one process (keeps {mib(run, whole, 'weights_kept_bytes')} MiB)")
        rows.append([label, f"{mib(run, own, 'peak_above_start_bytes')} MiB reading its "
                     f"{'shard' if fmt is None else 'share'} (keeps {mib(run, own, 'weights_kept_bytes')} MiB)",
                     f"{mib(run, whole, 'peak_above_start_bytes')} MiB {reference}",
                     f"{run['peak_ratio_own_over_whole']:.2f}", ""])
    return rows


def trace_rows(d: dict) -> list[Row]:
    t, out = d.get("target", {}), []
    peer = [p for p in d.get("peer", []) if p.get("hta", {}).get("wall_s")]
    if peer:
        shown = peer[-2:]
        per_rank = round(shown[-1]["events"] / shown[-1]["ranks"], -2)
        sizes = " / ".join(f"{p['ranks']:,}" for p in shown)
        speedups = [p["hta"]["wall_s"] / p["deltamoe"]["wall_s"] for p in shown]
        right = all(p["deltamoe"].get("stragglers") == p["truth_stragglers"] for p in peer)
        hta_right = all(p["hta"].get("stragglers") == p["truth_stragglers"] for p in peer)
        blame = "" if hta_right else f" (HTA blames rank {', '.join(map(str, shown[-1]['hta'].get('stragglers') or ['none']))})"
        goal = ""
        if "speedup_vs_hta" in t:
            # The target holds at every size shown (256 and 1,024 ranks), not just the largest.
            goal = verdict([(f">= {t['speedup_vs_hta']:g}x at {sizes} ranks",
                             min(speedups) >= t["speedup_vs_hta"])])
        out.append([f"trace analysis vs {d.get('peer_name', 'HTA')}, {sizes} ranks x ~{per_rank:,.0f} events "
                    + command("trace"),
                    " / ".join(f"{secs(p['deltamoe']['wall_s'])} s, {p['deltamoe']['peak_rss_mb']:.0f} MB" for p in shown),
                    "HTA " + " / ".join(f"{secs(p['hta']['wall_s'])} s, {p['hta']['peak_rss_mb']:.0f} MB" for p in shown),
                    bold(" / ".join(times(s) for s in speedups))
                    + ("; right straggler" if right else "; wrong straggler") + blame, goal])
    if d.get("throughput"):
        rows = d["throughput"]
        events = max(r["events"] for r in rows)
        best = max(r["events_per_s"] for r in rows)
        goal = ""
        if "events_per_s" in t:
            goal = verdict([(f">= {t['events_per_s'] / 1e6:g}M events/s", best >= t["events_per_s"])])
        out.append([f"trace analysis, one {events / 1e6:.0f}M-event rank file ({' / '.join(r['format'] for r in rows)})",
                    " / ".join(f"{r['events_per_s'] / 1e6:.2f}M" for r in rows)
                    + f" events/s, {max(r['peak_rss_mb'] for r in rows):.0f} MB", "", "", goal])
    if d.get("scaling"):
        rows = d["scaling"]
        per_rank = round(rows[-1]["events"] / rows[-1]["ranks"], -2)
        cells = [f"{secs(r['wall_s'])} s, {r['peak_rss_mb']:.0f} MB" for r in rows]
        cells[-1] = bold(cells[-1])
        goal = ""
        if "scaling_wall_s" in t:
            last = rows[-1]
            goal = verdict([(f"<= {t['scaling_wall_s']:g} s, <= {t['scaling_peak_mb'] / 1e3:g} GB",
                             last["wall_s"] <= t["scaling_wall_s"] and last["peak_rss_mb"] <= t["scaling_peak_mb"])])
        sizes = " / ".join(f"{r['ranks']:,}" for r in rows)
        out.append([f"trace analysis, {sizes} ranks x ~{per_rank:,.0f} events",
                    " / ".join(cells), "", "", goal])
    return out


def plan_validation_rows(d: dict) -> list[Row]:
    low, high = d["goal"]
    rows = d["rows"]
    outliers = [r for r in rows if not r["within_0.5x_2x"]]
    ratio = "; ".join(f"outlier: {r['system']}, {r['metric']} {r['ratio']:.2f}x (see docs/planner.md)" for r in outliers)
    return [[f"planner validation vs {len(rows)} published deployments {command('plan_validate')}",
             f"{d['within']} of {len(rows)} rows within {low:g}x-{high:g}x", "published figures", ratio,
             verdict([(f"all within {low:g}x-{high:g}x", not outliers)], d.get("note"))]]


def moe_rows(d: dict) -> list[Row]:
    s = d["shape"]
    res = {r["name"]: r for r in d["results"]}
    ours = res.pop("deltamoe experts_forward")
    hf = {name.split("(")[-1].rstrip(")"): r for name, r in res.items() if name.startswith("transformers")}
    loop = res.get("naive per-token loop")
    peers = "transformers " + ", ".join(f"{impl} {r['median_ms']:.1f} ms" for impl, r in hf.items())
    ratios = [times(r["time_vs_experts_forward"]) for r in hf.values()]
    if loop:
        peers += f"; per-token loop {loop['median_ms']:.1f} ms"
        ratios.append(times(loop["time_vs_experts_forward"]))
    return [[f"MoE experts, {s['tokens']} tokens, {s['experts']} experts top-{s['top_k']} {command('moe')}",
             f"{ours['median_ms']:.1f} ms", peers, " / ".join(ratios), d.get("note", "")]]


def quant_rows(d: dict) -> list[Row]:
    t = d.get("target", {})
    out = []
    # Eager rows, then compiled ones where the run has them (`--compile`), each against the baselines
    # decoded the same way (compiled: batch 1 as the engine runs it, one row on this preset; the
    # run's "compiled, two rows" baselines, the form before, are for docs/quantization.md, not the table). The int4 rows (rest bf16 as published; rest fp32 where the run has it)
    # against both full-precision baselines: the goal holds against each one the run names a target for.
    for decode in ("eager", "compiled"):
        speed = {r["format"]: r for r in d["speed"] if r.get("decode", "eager") == decode}
        if not speed:
            continue
        bf16, fp32 = speed["bf16"], speed["fp32"]
        for label, what in (("int4 (W4A16)", "int4 W4A16"), ("int4 (W4A16), rest fp32", "int4 W4A16, rest fp32"),
                            ("int4 (W4A16), torch's kernel", "int4 W4A16 on torch's int4 kernel (the form before)")):
            int4 = speed.get(label)
            if int4 is None:
                continue
            goals = [(f">= {t[f'int4_decode_vs_{b}']:g}x {b}", int4[f"speedup_vs_{b}"] >= t[f"int4_decode_vs_{b}"])
                     for b in ("bf16", "fp32") if f"int4_decode_vs_{b}" in t and "torch's" not in label]
            how = ", compiled" if decode == "compiled" else ""
            # Files from before `batch_one_rows` ran the compiled baselines as two rows and also
            # named the one-row fp32 ratio: keep it beside theirs.
            one_row = f", {times(int4['speedup_vs_fp32_one_row'])} fp32 one row" \
                if "speedup_vs_fp32_one_row" in int4 else ""
            # Another preset's rows come from a speed-only run (`--preset`), named by its own command.
            flags = " --compile" if d.get("compiled") else ""
            run = command("quant") if d["preset"] == "small" else \
                f"(`python bench/bench_quant.py --speed-only --preset {d['preset']}{flags}`)"
            out.append([f"{what} batch-1 decode{how}, {d['preset']} {run}",
                        f"{int4['decode_tok_s']:.2f} tok/s, {int4['memory_vs_bf16']:.2f}x bf16 bytes",
                        f"bf16 {bf16['decode_tok_s']:.2f} / fp32 {fp32['decode_tok_s']:.2f} tok/s",
                        bold(f"{times(int4['speedup_vs_bf16'])} / {times(int4['speedup_vs_fp32'])}") + one_row,
                        verdict(goals, d.get("note")) if goals and d["preset"] == "small"
                        else "(the goal is small's, above)" if goals else ""])
    if d.get("accuracy"):
        bound = t.get("accuracy_delta_abs")
        deltas = [abs(r["accuracy_delta"]) for r in d["accuracy"] if r.get("accuracy_delta") is not None]
        out.append([f"same, task-accuracy change over {', '.join(r['format'] for r in d['accuracy'][1:])}",
                    f"max {max(deltas):.3f}", "fp32", "",
                    verdict([(f"within {bound:g}", max(deltas) <= bound)]) if bound else ""])
    if d.get("kv_cache"):
        k3 = next((r for r in d["kv_cache"] if r["preset"] == "kimi-k3"), d["kv_cache"][0])
        bound = t.get("fp8_kv_vs_bf16")
        out.append([f"same, FP8 KV cache bytes per token, {k3['preset']}", f"{k3['fp8_bytes_per_token']:,} B",
                    f"bf16 {k3['bf16_bytes_per_token']:,} B", f"{k3['fp8_vs_bf16']:.2f}",
                    verdict([(f"<= {bound:g}", k3["fp8_vs_bf16"] <= bound)]) if bound else ""])
    return out


def spec_decode_rows(d: dict) -> list[Row]:
    b1, b8 = d["speed"][0], d["speed"][1]
    t = d.get("target", {})
    k2 = {kind: rs[1] for kind, rs in d["acceptance"].items()}  # K = 2
    speedup, accept = _spec_speedup(b1, "K=2"), k2["raw"]["mean_acceptance"]
    goal, floor = t.get("speedup_batch1_k2"), t.get("min_acceptance", 0.0)

    def target(accept: float, speedup: float) -> str:
        if goal is None:
            return ""
        if accept >= floor:
            return verdict([(f">= {goal:g}x at acceptance >= {floor:g}", speedup >= goal)], d.get("note"))
        return f">= {goal:g}x at acceptance >= {floor:g} (acceptance {accept:.2f}: not reached)"
    depth = d["model"].get("mtp_train_depth") or 1  # None: a given checkpoint of unknown recipe
    trained = f", MTP layer trained at depths 1..{depth}" if depth > 1 else ""
    distilled = d["model"].get("mtp_distill_steps") or 0
    trained += f", self-distilled {distilled} steps" if distilled else ""
    # --compile: plain decodes, verifications and drafts through compiled regions; else all eager.
    compiled = d.get("workload", {}).get("compile_decode")
    mode = "compiled" if compiled else "eager"
    # A given checkpoint or --compile: the exact command, which `deltamoe bench spec_decode` is not.
    flags = (f" --checkpoint {d['model']['checkpoint']}" if d["model"].get("given") else "") + (" --compile" if compiled else "")
    how = f"(`python bench/bench_spec_decode.py{flags}`)" if flags else command("spec_decode")
    label = (f"speculative decoding (MTP drafts, {mode}), `tiny` trained {d['model']['train_steps'] or '?'} steps on "
             f"{d['model']['task']}{trained}, batch 1, K = 2 {how}")
    per_k = " / ".join(f"K={k}" for k in (1, 2, 3))
    # Other workloads of the same run (the repeat task's long answers, open-ended decoding), batch 1, K = 2.
    workloads = [[f"same, {name.replace('_', '-')} prompts, batch 1, K = 2",
                  f"{rate(_spec_rate(s[0], 'K=2'))} tok/s; acceptance raw {d['acceptance_k2_by_workload'][name]:.2f}",
                  f"plain decode {rate(_spec_rate(s[0], 'plain'))} tok/s", _spec_times(s[0], "K=2"),
                  target(d["acceptance_k2_by_workload"][name], _spec_speedup(s[0], "K=2"))]
                 for name, s in d.get("speed_by_workload", {}).items()
                 if name != "mix" and name in d.get("acceptance_k2_by_workload", {})]
    ks = [f"K={k}" for k in (1, 2, 3)]
    rule = [f"K={k} (rule)" for k in (1, 2, 3)]
    ruled = all(m in b8["tokens_per_s"] for m in rule)  # results written before the batch-size rule: none
    max_batch = d.get("workload", {}).get("spec_max_batch_default")
    floor8 = t.get("rule_batch8_vs_plain")
    # Results from before the cost rule under the limit carry no spec_batch_rule_default.
    under = {"cost": ", speculating under it only where the measured step costs say it pays"}.get(
        d.get("workload", {}).get("spec_batch_rule_default"), "")
    batch8_rule = [[f"same, batch 8, {per_k}, with the batch-size rule (`--spec-max-batch {max_batch}`, the default"
                    f"{under})",
                    " / ".join(rate(_spec_rate(b8, m)) for m in rule) + " tok/s",
                    f"plain decode {rate(_spec_rate(b8, 'plain'))} tok/s",
                    _spec_times_per_k(b8, rule),
                    verdict([(f">= {floor8:g}x plain", min(_spec_speedup(b8, m) for m in rule) >= floor8)])
                    if floor8 else ""]] if ruled else []
    return [
        [label, f"{rate(_spec_rate(b1, 'K=2'))} tok/s; acceptance raw {accept:.2f}, chat "
                f"{k2['chat']['mean_acceptance']:.2f}", f"plain decode {rate(_spec_rate(b1, 'plain'))} tok/s",
         _spec_times(b1, "K=2", bold), target(accept, speedup)],
        [f"same, batch 1, {per_k}", " / ".join(rate(_spec_rate(b1, m)) for m in ks) + " tok/s",
         "", _spec_times_per_k(b1, ks), ""],
        [f"same, batch 8, {per_k}" + (", speculation forced (`--spec-max-batch 0`)" if ruled else ""),
         " / ".join(rate(_spec_rate(b8, m)) for m in ks) + " tok/s",
         f"plain decode {rate(_spec_rate(b8, 'plain'))} tok/s",
         _spec_times_per_k(b8, ks), ""],
        *batch8_rule,
        *workloads,
    ]


def _spec_rate(s: dict, mode: str) -> float:
    """A mode's tokens/s: the median round where the run kept every round, else its best."""
    return s.get("tokens_per_s_median", s["tokens_per_s"])[mode]


def _spec_speedup(s: dict, mode: str) -> float:
    """A mode's speedup over plain: the median of the rounds' ratios where kept, else the best rounds' ratio."""
    return s.get("speedup_median", s["speedup"])[mode]


def _spec_times(s: dict, mode: str, style=lambda text: text) -> str:
    """'1.6x', and with rounds kept '1.6x (median of 5 rounds: 1.41-1.83x)'."""
    return _spec_times_per_k(s, [mode], style)


def _spec_times_per_k(s: dict, modes: list[str], style=lambda text: text) -> str:
    """'1.3x / 1.6x', and with rounds kept '1.3x / 1.6x (median of 5 rounds: 1.20-1.40x / 1.41-1.83x)'."""
    text = " / ".join(style(_times_not_rounded_up(_spec_speedup(s, m))) for m in modes)
    if "speedup_spread" not in s:
        return text
    spreads = " / ".join(f"{lo:.2f}-{hi:.2f}x" for lo, hi in (s["speedup_spread"][m] for m in modes))
    return f"{text} (median of {s['rounds']} round{'s' if s['rounds'] > 1 else ''}: {spreads})"


def _times_not_rounded_up(x: float) -> str:
    """`times`, with two decimals where one would round the ratio up (1.57x must not read 1.6x beside
    a missed >= 1.6x)."""
    text = times(x)
    return f"{x:.2f}x" if float(text[:-1]) > x else text


def vision_rows(d: dict) -> list[Row]:
    enc, t = d["encoder"], d["ttft"]
    out: list[Row] = []
    for r in enc["rows"]:
        label = (f"image encoder, {r['size']}x{r['size']} ({r['tokens_per_image']} tokens), {r['batch']} images per call, "
                 f"width {enc['width']} x {enc['layers']} blocks {command('vision')}" if not out
                 else f"same, {r['size']}x{r['size']} ({r['tokens_per_image']} tokens)")
        out.append([label, f"{r['deltamoe_images_per_s']:,.1f} img/s, {rate(r['deltamoe_tokens_per_s'])} tok/s",
                    f"transformers Kimi-K2.5 MoonViT {r['transformers_images_per_s']:,.1f} img/s",
                    times(r["speedup"]), ""])
    out.append([f"TTFT, `tiny-vision`, {t['image_size']}px image ({t['image_tokens']} tokens) + {t['text_tokens']} "
                f"text tokens {command('vision')}",
                f"{ms(t['image_plus_text_s'])} ms; repeated image (prefix hit) {ms(t['repeated_image_prefix_hit_s'])} ms",
                f"text alone {ms(t['text_alone_s'])} ms; text of the same length {ms(t['text_same_length_s'])} ms", "",
                ""])
    return out


# results file stem -> formatter, in the order the README lists them
def rl_weight_sync_rows(d: dict) -> list[Row]:
    rows = []
    for name, r in d["sizes"].items():
        rows.append([f"RL weight sync, `{name}` ({r['bytes'] / 2**20:.0f} MiB) trainer -> engine {command('rl_weight_sync')}",
                     f"gloo bucketed {secs(r['gloo_bucketed_s'])} s, in-process {secs(r['in_process_s'])} s",
                     f"gloo per-tensor {secs(r['gloo_per_tensor_s'])} s",
                     times(r["gloo_per_tensor_s"] / r["gloo_bucketed_s"]), ""])
    k3, ro = d["k3_shaped"], d["rollouts"]
    rows.append([f"same, K3-shaped tensors ({k3['bytes'] / 2**30:.1f} GiB) over gloo; whole K3 extrapolated",
                 f"{k3['gloo_bucketed_gb_per_s']:.2f} GB/s, ~{k3['k3_whole_model_bucketed_s_extrapolated']:,.0f} s",
                 f"per-tensor {k3['gloo_per_tensor_gb_per_s']:.2f} GB/s", "", ""])
    rows.append(["same, rollout tokens/s inside the GRPO loop vs the engine alone (`tiny`)",
                 rate(ro["in_loop_tokens_per_s"]), f"alone {rate(ro['engine_alone_tokens_per_s'])}",
                 times(ro["in_loop_vs_alone"]), ""])
    return rows


def rl_grpo_rows(d: dict) -> list[Row]:
    def acc(key: str) -> str:  # with the 95 % interval where the results file has it
        ci = d.get(key.replace("accuracy", "ci95"))
        return f"{d[key] * 100:.1f} %" + (f" [{ci[0] * 100:.1f}, {ci[1] * 100:.1f}]" if ci else "")

    prompts = f" on {d['eval_prompts']} prompts" if d.get("eval_prompts") else ""
    rl = d.get("rl_settings", {})
    # Results files from before rl_settings named the task only in this row: 2-digit addition.
    task = {"recall": f"recall ({rl.get('num-pairs', 8)} pairs)", "arithmetic": "2-digit addition"}.get(
        rl.get("task", "arithmetic"), rl.get("task"))
    batch = f", {rl['prompts-per-step']:,} prompts x {rl['group-size']} a step" if "prompts-per-step" in rl else ""
    return [[f"GRPO from a {d['sft_steps']}-step supervised `tiny`, {task}{batch} {command('rl_grpo')}",
             f"held-out {acc('final_accuracy')} after {d['rl_steps']} steps, {d['rl_s'] / 60:.1f} min",
             f"start {acc('start_accuracy')}{prompts}", "",
             ("held-out rise outside the start's 95 % interval within minutes (met)" if d.get("rise_outside_noise")
              else "held-out rise outside the start's 95 % interval (missed)" if "rise_outside_noise" in d else "")]]


FORMATTERS: dict[str, Callable[[dict], list[Row]]] = {
    "kda": kda_rows,
    "kda_k128": kda_k128_rows,
    "kda_k128_t1": kda_k128_rows,
    "kda_k128_default_malloc": kda_k128_rows,  # bench_kda.py --head-dim 128 --allocator default
    "model_forward": model_forward_rows,
    "train_throughput": train_throughput_rows,
    "train_quality": train_quality_rows,
    "serve_offline": serve_offline_rows,
    "serve_dsa_decode": serve_dsa_decode_rows,
    "compile_start": compile_start_rows,
    "compile_start_whole": compile_start_rows,
    "compile_start_layers": compile_start_rows,  # bench_compile_start.py (the default form, whole layers)
    "serve_cache_bytes": serve_cache_bytes_rows,
    "serve_online": serve_online_rows,
    "serve_online_compiled": serve_online_rows,
    "serve_disagg": serve_disagg_rows,
    "serve_disagg_async": serve_disagg_rows,  # bench_serve_disagg.py --async-scheduling
    "serve_online_vs_transformers": serve_online_vs_peer_rows,
    "serve_workers": serve_workers_rows,
    "serve_structured": serve_structured_rows,
    "shard_load": shard_load_rows,
    "shard_load_mxfp4": shard_load_rows,  # bench_shard_load.py --format mxfp4
    "trace": trace_rows,
    "plan_validation": plan_validation_rows,
    "moe": moe_rows,
    "quant": quant_rows,
    "quant_speed_medium": quant_rows,  # bench_quant.py --speed-only --preset medium: a weight-bound width
    "spec_decode": spec_decode_rows,
    "vision": vision_rows,
    "rl_weight_sync": rl_weight_sync_rows,
    "rl_grpo": rl_grpo_rows,
    "train_offload": train_offload_rows,
    "train_fp8": train_fp8_rows,
    "ep_overlap": ep_overlap_rows,
}


# --- rendering and the README block ----------------------------------------------------------


def results_files(results_dir: Path) -> dict[str, Path]:
    """Full-run results by stem; quick (smoke) runs are left out."""
    files = {}
    for path in sorted(results_dir.glob("*.json")):
        if path.stem.endswith("_quick"):
            continue
        files[path.stem] = path
    return files


def render_table(results_dir: Path) -> str:
    files = results_files(results_dir)
    unknown = sorted(set(files) - set(FORMATTERS))
    for stem in unknown:
        print(f"warning: no README formatter for {files[stem]} (add one to deltamoe/benchmarks/table.py)",
              file=sys.stderr)
    rows: list[Row] = []
    for stem, formatter in FORMATTERS.items():
        if stem in files:
            data = json.loads(files[stem].read_text())
            if data.get("quick") or data.get("config", {}).get("quick"):
                continue
            rows += formatter(data)
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def split_readme(text: str, path: Path) -> tuple[str, str, str]:
    """(before, block, after) around the markers; the markers stay in before/after."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ConfigError(f"{path} needs exactly one {START} ... {END} pair", field="README")
    head, rest = text.split(START)
    block, tail = rest.split(END)
    return head + START, block.strip("\n"), END + tail


def update_readme(readme: Path, table: str) -> bool:
    """Put the table between the markers (atomic write). True when the file changed."""
    text = readme.read_text()
    before, block, after = split_readme(text, readme)
    new = f"{before}\n{table}\n{after}"
    if new == text:
        return False
    tmp = readme.with_name(f".{readme.name}.tmp")
    tmp.write_text(new)
    os.replace(tmp, readme)
    return True
