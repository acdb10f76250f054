"""Write the analysis: JSON (machine readable) and one self-contained HTML page with plots."""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path

import orjson

from deltamoe.trace.summary import RankSummary


def atomic_write(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_json(report: dict, path: str | Path) -> None:
    atomic_write(path, orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{alt}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(rows: list[dict], cols: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "; ".join(f"{x['op']} x{x['count']}: {x['others_waited_s']:.4g}s" if isinstance(x, dict) else str(x)
                         for x in v)
    return "" if v is None else str(v)


def write_html(report: dict, summaries: list[RankSummary], path: str | Path) -> None:
    from deltamoe.trace import plots  # matplotlib costs ~0.5 s: load it only for HTML

    r = report
    parts = [f"<h1>Trace analysis: {html.escape(r['folder'])}</h1>",
             f"<p>{r['ranks_analyzed']} of {r['ranks_found']} rank files, {r['events']:,} events, backend "
             f"{html.escape(r['backend'])} ({r['mode']}); read in {r['read_seconds']} s.</p>"]
    t = r["totals"]
    parts.append("<p>Job time: " + ", ".join(f"{k.replace('_fraction', '')} {v:.1%}" for k, v in t.items()) + "</p>")
    parts.append("<h2>Stragglers</h2>")
    parts.append(_table(r["stragglers"], ["rank", "host", "score", "others_waited_s", "compute_vs_peers", "cause",
                                          "collectives"]) if r["stragglers"] else "<p>None found.</p>")
    flagged = {s["rank"] for s in r["stragglers"]}
    parts.append(_img(plots.straggler_ranking(r["straggler_detail"]["ranking"], flagged), "straggler ranking"))
    parts.append("<h2>Ranks over time</h2>" + _img(plots.heatmap(summaries), "heat map"))
    parts.append("<h2>Per-rank breakdown</h2>" + _img(plots.breakdown_bars(r["ranks"]), "breakdown"))
    if r["pipeline"]:
        p = r["pipeline"]
        parts.append(f"<h2>Pipeline bubbles</h2><p>{p['pipelines']} pipelines of {p['stages']} stages, "
                     f"{p['microbatches']} microbatches, schedule {p['schedule']}; theory "
                     f"{p['theoretical_bubble_fraction']:.3f}.</p>" + _img(plots.bubble_chart(p), "bubbles"))
    if r["alltoall"]:
        a = r["alltoall"]
        parts.append(f"<h2>MoE all-to-all</h2><p>max/mean bytes {a['max_over_mean_bytes']}</p>"
                     + _table(a["hot_ranks"], ["rank", "group", "bytes_vs_median"]))
    st = r["step_times"]
    parts.append(f"<h2>Step times</h2><p>outlier steps: {st['outlier_steps'] or 'none'}; "
                 f"distribution {st['distribution']}</p>" + _img(plots.step_histogram(summaries), "steps"))
    if r["skipped"]:
        parts.append("<h2>Skipped files</h2>" + _table(r["skipped"], ["path", "error"]))
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse;"
             "font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px}img{max-width:100%}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>deltamoe trace report</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")
    atomic_write(path, page.encode())
