"""The rich summary printed after `deltamoe trace analyze`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_summary(report: dict, console: Console | None = None) -> None:
    c = console or Console()
    r = report
    backend = f"{r['backend']} ({r['mode']})" if r["backend"] else f"no collectives ({r['mode']})"
    world = r["consistency"]["world_size"]
    c.print(f"[bold]{r['ranks_analyzed']}[/] of {world} ranks ({r['ranks_found']} files), {r['events']:,} events, "
            f"{backend}, read in {r['read_seconds']} s")
    for s in r["skipped"]:
        c.print(f"[yellow]skipped[/] {s['error']}")
    for w in r["consistency"]["warnings"]:
        c.print(f"[yellow]warning[/] {w}")
    t = r["totals"]
    c.print("time: " + ", ".join(f"{k.replace('_fraction', '')} {v:.1%}" for k, v in t.items())
            + f"; comm hidden under compute {r['overlap']['job_overlap_fraction']:.1%}")
    ex = r.get("exposed_by_kind")
    if ex and ex["exposed_s_per_step"] > 0:
        kinds = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(ex["by_kind_s_per_step"].items(), key=lambda kv: -kv[1])
                          if v > 0)
        c.print(f"exposed communication per step {ex['exposed_s_per_step'] * 1e3:.2f} ms of {ex['step_s'] * 1e3:.2f} ms "
                f"(by kind: {kinds})")
    sk = r.get("sync_skew")
    if sk:
        c.print(f"collectives: {sk['sync_wait_s']:.4f} s waiting for late peers (sync skew), "
                f"{sk['transfer_s']:.4f} s transferring ({sk['sync_fraction']:.1%} skew)")
    if r["stragglers"]:
        tab = Table(title="Stragglers")
        for col in ("rank", "host", "score", "others waited (s)", "compute vs peers", "cause", "main evidence"):
            tab.add_column(col)
        for s in r["stragglers"]:
            ev = s["collectives"][0] if s["collectives"] else {"op": "", "count": 0}
            tab.add_row(str(s["rank"]), s["host"], f"{s['score']:.3f}", f"{s['others_waited_s']:.4f}",
                        f"{s['compute_vs_peers']:.2f}x", s["cause"], f"{ev['op']} x{ev['count']}")
        c.print(tab)
    else:
        c.print("stragglers: none")
    p = r["pipeline"]
    if p:
        theory = p["theoretical_bubble_fraction"]
        c.print(f"pipeline: {p['pipelines']} x {p['stages']} stages, m={p['microbatches']}, {p['schedule']}; "
                f"bubble per stage " + ", ".join(f"{k}: {v:.3f}" for k, v in p["bubble_fraction"].items())
                + (f" (theory {theory:.3f})" if theory is not None else ""))
    a = r["alltoall"]
    if a:
        hot = ", ".join(f"{h['rank']} ({h['bytes_vs_median']}x)" for h in a["hot_ranks"][:8]) or "none"
        ratio = a["max_over_mean_bytes"]
        if ratio is None:  # gloo without record_shapes: the payloads are not in the trace
            c.print("all-to-all: max/mean bytes n/a (bytes unknown: record with record_shapes=True)")
        else:
            c.print(f"all-to-all: max/mean bytes {ratio}, hot ranks {hot}")
    st = r["step_times"]
    if st["distribution"]:
        d = st["distribution"]
        c.print(f"step time p50 {d['p50'] * 1e3:.2f} ms, p90 {d['p90'] * 1e3:.2f} ms, max {d['max'] * 1e3:.2f} ms; "
                f"outlier steps {st['outlier_steps'] or 'none'}")
