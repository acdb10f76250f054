"""Run HolisticTraceAnalysis 0.5.0 the way the deltamoe analyzer is run: load, breakdown, stragglers.

Executed with the HTA virtualenv's python (bench_trace.py creates it). Prints one JSON line.
Usage: run_hta.py TRACE_DIR
"""

from __future__ import annotations

import json
import sys
import time
import warnings

warnings.filterwarnings("ignore")


def main(folder: str) -> None:
    from hta.trace_analysis import TraceAnalysis

    out: dict = {}
    t0 = time.perf_counter()
    analyzer = TraceAnalysis(trace_dir=folder)
    out["load_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        df = analyzer.get_temporal_breakdown(visualize=False)
        out["breakdown_ranks"] = int(len(df))
    except Exception as e:  # report, do not hide: gloo traces fail here
        out["breakdown_error"] = f"{type(e).__name__}: {e}"
    out["breakdown_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    try:
        out["stragglers"] = [int(r) for r in analyzer.get_potential_stragglers(num_candidates=1)]
    except Exception as e:
        out["straggler_error"] = f"{type(e).__name__}: {e}"
    out["straggler_s"] = time.perf_counter() - t2
    out["ranks"] = len(analyzer.t.traces)
    out["total_s"] = time.perf_counter() - t0
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
