"""Write the analysis: JSON (machine readable) and one self-contained HTML page of tables and figures."""

from __future__ import annotations

import base64
import html
import os
import re
from pathlib import Path

import orjson

from deltamoe.trace.summary import RankSummary

TABLE_ROWS = 256  # per-rank tables longer than this show the ranks that matter most

SCORE_TEXT = ("Score: the time the other members of a rank's collectives and pipeline hops waited for it, "
              "per step, as a fraction of the median step time (0.1 = others lost a tenth of a step, on "
              "average, to this rank). Only lateness the rank produced itself counts: a rank held up by "
              "someone else passes the wait on. A rank is named when its score is at least {min:.2f}, far "
              "above the job's typical score (robust z > 5; median score {median:.4f}; in a job of fewer than 8 "
              "ranks also: at least 3x every other rank's score) and it was late in at least half of the steps.")


STDOUT = "-"  # `--json -` / `--html -`: the report goes to standard output (to pipe into jq)


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all; "-" writes it to standard output."""
    if str(path) == STDOUT:
        import sys

        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:  # a full disk, an interrupt: leave no `.name.tmpPID` behind
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(report: dict, path: str | Path) -> None:
    atomic_write(path, orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{alt}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


_NUMBER = re.compile(r"^-?[\d.,]+(%|x)?$")


def _table(rows: list[list], head: list[str]) -> str:
    """Cells are formatted already; numbers are right-aligned."""
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(
        f"<td{' class=n' if _NUMBER.match(str(c)) else ''}>{c if isinstance(c, _Html) else html.escape(str(c))}</td>"
        for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


class _Html(str):
    """A cell that is markup already."""


def _s(x: float) -> str:
    return f"{x:.4f}" if abs(x) < 10 else f"{x:.2f}"


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _stragglers(r: dict) -> str:
    d = r["straggler_detail"]
    out = [f"<p class=note>{html.escape(SCORE_TEXT.format(min=d['min_score'], median=d['median_score']))}</p>"]
    if not r["stragglers"]:
        return "<p><b>No straggler found.</b></p>" + "".join(out)
    rows = []
    for s in r["stragglers"]:
        ev = "<br>".join(html.escape(f"{c['op']}: late {c['count']} time{'s' if c['count'] != 1 else ''}, "
                                     f"others waited {_s(c['others_waited_s'])} s")
                         for c in s["collectives"])
        rows.append([s["rank"], s["host"], f"{s['score']:.3f}", s["test"], s["steps_late"],
                     _s(s["others_waited_s"]), f"{s['compute_vs_peers']:.2f}x", s["cause"], _Html(ev)])
    verdict = ", ".join(str(s["rank"]) for s in r["stragglers"])
    return (f"<p><b>Straggler{'s' if len(r['stragglers']) > 1 else ''}: rank {verdict}.</b></p>" + "".join(out)
            + _table(rows, ["rank", "host", "score", "far above the others by", "steps late", "others waited (s)",
                            "own compute vs stage peers", "likely cause", "evidence (where others waited)"]))


def _rank_rows(r: dict) -> list[dict]:
    rows = r["ranks"]
    if len(rows) <= TABLE_ROWS:
        return rows
    keep = {s["rank"] for s in r["stragglers"]} | {x["rank"] for x in r["straggler_detail"]["ranking"][:32]}
    worst_idle = sorted(rows, key=lambda x: -x["idle_s"])[:TABLE_ROWS - len(keep)]
    keep |= {x["rank"] for x in worst_idle}
    return [x for x in rows if x["rank"] in keep]


def _breakdown(r: dict) -> str:
    skew = {x["rank"]: x for x in (r.get("sync_skew") or {}).get("ranks", [])}
    rows = []
    for x in _rank_rows(r):
        k = skew.get(x["rank"], {})
        rows.append([x["rank"], x["host"], x["steps"], _s(x["time_s"]), _s(x["compute_s"]), _s(x["exposed_comm_s"]),
                     _s(x["overlap_s"]), _s(x["memcpy_s"]), _s(x["idle_s"]),
                     _s(k["sync_wait_s"]) if k else "", _s(k["transfer_s"]) if k else ""])
    note = (f"<p class=note>{len(rows)} of {len(r['ranks'])} ranks: the stragglers, the highest scores and the "
            "most idle.</p>" if len(rows) < len(r["ranks"]) else "")
    return note + _table(rows, ["rank", "host", "steps", "time (s)", "compute", "exposed comm", "comm under compute",
                                "memcpy", "idle", "collective: waiting for peers", "collective: transfer"])


def _pipeline(p: dict, plots) -> str:
    theory = p["theoretical_bubble_fraction"]
    rows = [[int(k), _pct(v), _pct(theory) if theory is not None else "", _s(p["recv_wait_s"].get(k, 0.0))]
            for k, v in sorted(p["bubble_fraction"].items(), key=lambda kv: int(kv[0]))]
    pipes = "; ".join(" > ".join(map(str, x)) for x in p["pipelines_ranks"][:8])
    more = f" (and {p['pipelines'] - 8} more)" if p["pipelines"] > 8 else ""
    return (f"<p>{p['pipelines']} pipelines of {p['stages']} stages, {p['microbatches']} microbatches, schedule "
            f"{p['schedule']}. Stage order (global ranks): {html.escape(pipes + more)}.</p>"
            + _table(rows, ["stage", "measured bubble", "schedule theory", "recv wait (s)"])
            + _img(plots.bubble_chart(p), "bubbles per stage"))


def _sync(sk: dict) -> str:
    rows = [[g["group"], g["kind"], g["instances"], _s(g["sync_wait_s"]), _s(g["transfer_s"]), _pct(g["sync_fraction"]),
             f"{g['mean_skew_s'] * 1e3:.3f}", f"{g['max_skew_s'] * 1e3:.3f}"] for g in sk["groups"][:32]]
    return (f"<p>In collectives the ranks spent {_s(sk['sync_wait_s'])} s waiting for late peers and "
            f"{_s(sk['transfer_s'])} s transferring ({_pct(sk['sync_fraction'])} waiting).</p>"
            + _table(rows, ["group", "op", "instances", "waiting for peers (s)", "transfer (s)", "waiting share",
                            "mean skew (ms)", "max skew (ms)"]))


def write_html(report: dict, summaries: list[RankSummary], path: str | Path) -> None:
    from deltamoe.trace import plots  # matplotlib costs ~0.5 s: load it only for HTML

    r = report
    c = r["consistency"]
    parts = [f"<h1>Trace analysis</h1><p class=note>{html.escape(r['folder'])}</p>",
             f"<p>{r['ranks_analyzed']} of {c['world_size']} ranks ({r['ranks_found']} files), {r['events']:,} "
             f"events, backend {html.escape(r['backend'] or 'none')} ({r['mode']}); read in {r['read_seconds']} s.</p>"]
    if c["warnings"] or r["skipped"]:
        items = [f"skipped {s['path']}: {s['error']}" for s in r["skipped"]] + c["warnings"]
        parts.append("<div class=warn><b>Check the input:</b><ul>"
                     + "".join(f"<li>{html.escape(w)}</li>" for w in items) + "</ul></div>")
    t = r["totals"]
    parts.append("<p>Where the time goes (all ranks): " + ", ".join(
        f"{k.replace('_fraction', '').replace('_', ' ')} {_pct(v)}" for k, v in t.items())
        + f"; communication hidden under compute {_pct(r['overlap']['job_overlap_fraction'])}.</p>")
    parts.append("<h2>Stragglers</h2>" + _stragglers(r))
    flagged = {s["rank"] for s in r["stragglers"]}
    parts.append(_img(plots.straggler_ranking(r["straggler_detail"]["ranking"], flagged), "straggler ranking"))
    parts.append("<h2>Per-rank breakdown (seconds over the kept steps)</h2>" + _breakdown(r))
    parts.append(_img(plots.breakdown_bars(r["ranks"]), "breakdown"))
    parts.append("<h2>Ranks over time</h2>" + _img(plots.heatmap(summaries), "heat map"))
    if r["pipeline"]:
        parts.append("<h2>Pipeline bubbles</h2>" + _pipeline(r["pipeline"], plots))
    if r.get("sync_skew"):
        parts.append("<h2>Collectives: waiting for peers vs transfer</h2>" + _sync(r["sync_skew"]))
    if r["alltoall"]:
        a = r["alltoall"]
        hot = [[h["rank"], h["group"], f"{h['bytes_vs_median']:.2f}x"] for h in a["hot_ranks"]]
        if a["max_over_mean_bytes"] is None:  # gloo without record_shapes: payloads unknown
            parts.append("<h2>MoE all-to-all</h2><p>Largest payload / mean payload in a group: n/a (bytes "
                         "unknown: record with record_shapes=True).</p>")
        else:
            parts.append(f"<h2>MoE all-to-all</h2><p>Largest payload / mean payload in a group: "
                         f"{a['max_over_mean_bytes']:.2f}.</p>"
                         + (_table(hot, ["rank", "group", "bytes vs group median"]) if hot else "<p>No hot rank.</p>"))
    st = r["step_times"]
    if st["steps"]:
        d = st["distribution"]
        rows = [[x["step"], f"{x['time_s'] * 1e3:.2f}", f"{x['rank_min_s'] * 1e3:.2f}", f"{x['rank_median_s'] * 1e3:.2f}",
                 "outlier" if x["step"] in st["outlier_steps"] else ""] for x in st["steps"]]
        parts.append(f"<h2>Step times</h2><p>Per rank and step: p50 {d['p50'] * 1e3:.2f} ms, p90 {d['p90'] * 1e3:.2f} "
                     f"ms, max {d['max'] * 1e3:.2f} ms.</p>"
                     + _table(rows, ["step", "job (slowest rank, ms)", "fastest rank (ms)", "median rank (ms)", "note"])
                     + _img(plots.step_histogram(summaries), "step times"))
    style = ("body{font-family:system-ui,sans-serif;max-width:1150px;margin:auto;padding:0 1em;color:#222}"
             "table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
             "vertical-align:top}th{background:#f1f3f5;text-align:left}td.n{text-align:right;"
             "font-variant-numeric:tabular-nums}img{max-width:100%;display:block;margin:.5em 0}"
             ".note{color:#555;font-size:13px}.warn{background:#fff3cd;border:1px solid #e0c36a;padding:.3em 1em}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>deltamoe trace report</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")
    atomic_write(path, page.encode())
