"""Demo stage 4: the trace analyzer on the profiler window the training stage recorded.

The trainer wrote train/traces/rank0.json (Kineto, two training steps); the analyzer reads it
like any multi-rank job's folder and prints its one-screen summary. With a single CPU rank
there are no collectives, so the interesting lines are the time breakdown and step times.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from deltamoe.demo.run_folder import RunFolder
from deltamoe.trace.analyze import analyze
from deltamoe.trace.reader import ReadConfig
from deltamoe.trace.report import write_json
from deltamoe.trace.terminal import print_summary


def run_trace_summary(folder: RunFolder, console: Console) -> dict[str, Any]:
    traces = folder.train / "traces"
    console.print(f"trace analysis of {traces} (deltamoe trace analyze; full report: {folder.trace_report})")
    # One reader in this process: a single small file does not pay for forking workers.
    report = analyze(str(traces), ReadConfig(), workers=1).report
    write_json(report, folder.trace_report)
    print_summary(report, console)
    steps = report["step_times"]["distribution"] or {}
    return {"folder": str(traces), "report": str(folder.trace_report), "ranks": report["ranks_analyzed"],
            "events": report["events"], "mode": report["mode"], "totals": report["totals"],
            "step_time_p50_ms": round(steps["p50"] * 1e3, 1) if steps else None}
