"""Trace analyzer benchmark: deltamoe vs HolisticTraceAnalysis 0.5.0, side by side in one run.

1. Peer comparison at 8, 64, 256 and 1,024 ranks (~2,000 events per rank, pretty-printed JSON
   with `ncclKernel_*` names, which HTA can read; rank 1 is an injected straggler in stage 0
   of a 2-stage 1F1B pipeline): load + breakdown + straggler analysis, wall time and peak RSS
   (PSS) of each tool's whole process tree (sampled from /proc every 50 ms), each in its own
   subprocess, plus which rank each tool names as the straggler.
2. Throughput on one large rank file (~1M events), pretty and compact: events/s end to end.
3. Scaling from 1,000 to 10,000 ranks of ~2,000 events (compact JSON; HTA is not run there).

Before timing, deltamoe's analyzer modules are compiled to bytecode, as installing a package
does (HTA's came compiled with pip install): with PYTHONDONTWRITEBYTECODE=1 in the environment
(as in this repo's dev shells) every run would otherwise recompile each module from source,
~30 ms of start-up that an installed copy never pays.

HTA runs from its own virtualenv (.venv-hta), created when missing with
    python3 -m venv .venv-hta && .venv-hta/bin/pip install torch==2.13.0 HolisticTraceAnalysis==0.5.0 psutil
(torch pinned first so pip takes the local CPU wheel, not a multi-GB CUDA build).

Usage: .venv/bin/python bench/bench_trace.py [--quick] [--skip-hta] [--skip-scaling] [--repeat N]
(--repeat N runs each tool N times per size, interleaved, and keeps the fastest run of each.)
Results: bench/results/trace.json (written atomically) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HTA_VENV = ROOT / ".venv-hta"
HTA_VERSION = "0.5.0"
sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, result_name  # noqa: E402

# Goals: speedup at the largest peer size, one-file throughput, and the 10,000-rank run.
TARGET = {"speedup_vs_hta": 20.0, "events_per_s": 1_000_000, "scaling_wall_s": 60.0, "scaling_peak_mb": 1000.0}
# ~1,900 events per rank: 2 stages x 4 microbatches x 2 layers, 3 profiled steps, EP all-to-all.
JOB = ["--pp", "2", "--layers", "2", "--steps", "3"]


def ensure_hta() -> Path:
    py = HTA_VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import hta"], capture_output=True).returncode == 0:
        return py
    if not py.exists():
        subprocess.run(["python3", "-m", "venv", str(HTA_VENV)], check=True)
    pip = [str(HTA_VENV / "bin" / "pip"), "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + [f"HolisticTraceAnalysis=={HTA_VERSION}", "psutil"], check=True)
    return py


def compile_bytecode() -> list[str]:
    """Write the bytecode of the modules `python -m deltamoe.trace analyze` imports (as pip install would)."""
    import compileall

    done = [str(p) for p in (ROOT / "deltamoe" / "__init__.py", ROOT / "deltamoe" / "errors.py")
            if compileall.compile_file(p, quiet=1)]
    if compileall.compile_dir(ROOT / "deltamoe" / "trace", quiet=1):
        done.append(str(ROOT / "deltamoe" / "trace"))
    return [str(Path(p).relative_to(ROOT)) for p in done]


def _tree_rss(root: int) -> int:
    """Sum of PSS (bytes) over `root` and all its descendants.

    PSS splits pages shared after fork between the processes, so a forked worker pool is
    not counted once per worker (plain RSS would add the parent's imports N+1 times)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            pass
        todo += children.get(pid, [])
    return total


def measure(cmd: list[str], timeout: float = 1800) -> dict:
    """Wall time, peak process-tree RSS and stdout of one command."""
    peak = 0
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            done.wait(0.05)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate(timeout=timeout)
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    return {"wall_s": round(wall, 3), "peak_rss_mb": round(peak / 2**20, 1), "rc": proc.returncode,
            "stdout": out, "stderr_tail": err[-1500:]}


def synth(out: Path, ranks: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "deltamoe.trace", "synth", str(out), "--ranks", str(ranks), *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    truth = json.loads((out / "_ground_truth.json").read_text())
    return {"seconds": round(time.perf_counter() - t0, 1), "truth": truth,
            "events": sum(r["events"] for r in truth["ranks"]),
            "bytes": sum(p.stat().st_size for p in out.iterdir())}


def run_deltamoe(folder: Path, tmp: Path) -> dict:
    out = tmp / "deltamoe.json"
    # `python -m deltamoe.trace` = `deltamoe trace` without importing the other subsystems.
    m = measure([sys.executable, "-m", "deltamoe.trace", "analyze", str(folder), "--json", str(out),
                 "--quiet", "--workers", "2"])
    if m["rc"] == 0:
        rep = json.loads(out.read_text())
        m["stragglers"] = [s["rank"] for s in rep["stragglers"]]
        m["events"] = rep["events"]
        m["read_s"] = rep["read_seconds"]
        out.unlink()
    return m


def run_hta(py: Path, folder: Path) -> dict:
    m = measure([str(py), str(ROOT / "bench" / "trace_support" / "run_hta.py"), str(folder)])
    if m["rc"] == 0:
        line = [x for x in m["stdout"].splitlines() if x.startswith("{")][-1]
        m.update(json.loads(line))
    return m


def peer_comparison(sizes: list[int], hta_py: Path | None, tmp: Path, repeat: int = 1) -> list[dict]:
    rows = []
    for n in sizes:
        folder = tmp / f"peer{n}"
        gen = synth(folder, n, JOB + ["--straggler", "1", "--nccl-names", "legacy"])
        ours, peers = [], []
        for _ in range(repeat):  # interleaved, so both tools see the same machine load
            ours.append(_slim(run_deltamoe(folder, tmp)))
            if hta_py:
                peers.append(_slim(run_hta(hta_py, folder)))
        row = {"ranks": n, "events": gen["events"], "json_mb": round(gen["bytes"] / 1e6, 1),
               "truth_stragglers": gen["truth"]["stragglers"], "deltamoe": _best(ours)}
        if hta_py:
            row["hta"] = _best(peers)
        rows.append(row)
        print(f"  {n} ranks: deltamoe {row['deltamoe']['wall_s']} s"
              + (f", HTA {row['hta']['wall_s']} s" if hta_py else ""), file=sys.stderr, flush=True)
        shutil.rmtree(folder)
    return rows


def _best(runs: list[dict]) -> dict:
    """The fastest of repeated runs, with every run's wall time and the highest peak memory."""
    best = dict(min(runs, key=lambda m: m["wall_s"] if m["rc"] == 0 else float("inf")))
    if len(runs) > 1:
        best["wall_s_runs"] = [m["wall_s"] for m in runs]
        best["peak_rss_mb"] = max(m["peak_rss_mb"] for m in runs)
    return best


def throughput(tmp: Path, layers: int, repeat: int = 1) -> list[dict]:
    rows = []
    for fmt in ("pretty", "compact"):
        folder = tmp / f"big_{fmt}"
        # 2 ranks so the trace has collectives; only rank 0's file is analysed.
        gen = synth(folder, 2, ["--layers", str(layers), "--steps", "10", "--workers", "1"]
                    + (["--compact"] if fmt == "compact" else []))
        (folder / "rank1.pt.trace.json").unlink()
        size = (folder / "rank0.pt.trace.json").stat().st_size
        m = _best([run_deltamoe(folder, tmp) for _ in range(repeat)])
        ev = m.get("events", 0)
        rows.append({"format": fmt, "events": ev, "file_mb": round(size / 1e6, 1), "wall_s": m["wall_s"],
                     "events_per_s": round(ev / m["wall_s"]) if m["wall_s"] else None,
                     "read_s": m.get("read_s"), "peak_rss_mb": m["peak_rss_mb"]}
                    | ({"wall_s_runs": m["wall_s_runs"]} if repeat > 1 else {}))
        print(f"  throughput {fmt}: {rows[-1]['events_per_s']:,} events/s", file=sys.stderr, flush=True)
        shutil.rmtree(folder)
    return rows


def scaling(tmp: Path, sizes: list[int]) -> list[dict]:
    rows = []
    for n in sizes:
        folder = tmp / f"scale{n}"
        gen = synth(folder, n, JOB + ["--straggler", "3", "--compact"])
        m = run_deltamoe(folder, tmp)
        rows.append({"ranks": n, "events": gen["events"], "json_mb": round(gen["bytes"] / 1e6, 1),
                     "generate_s": gen["seconds"], "wall_s": m["wall_s"], "read_s": m.get("read_s"),
                     "peak_rss_mb": m["peak_rss_mb"], "stragglers": m.get("stragglers"),
                     "truth_stragglers": gen["truth"]["stragglers"]})
        print(f"  scaling {n} ranks: {m['wall_s']} s, {m['peak_rss_mb']} MB", file=sys.stderr, flush=True)
        shutil.rmtree(folder)
    return rows


def _slim(m: dict) -> dict:
    return {k: v for k, v in m.items() if k not in ("stdout",) and not (k == "stderr_tail" and m.get("rc") == 0)}


def markdown(res: dict) -> str:
    lines = ["| ranks | events | JSON MB | deltamoe s | HTA s | speedup | deltamoe peak PSS MB | HTA peak PSS MB | "
             "straggler (truth) | deltamoe says | HTA says |", "|" + "---|" * 11]
    for r in res.get("peer", []):
        d, h = r["deltamoe"], r.get("hta", {})
        sp = f"{h['wall_s'] / d['wall_s']:.1f}x" if h.get("wall_s") else "-"
        hta_says = h.get("stragglers", h.get("straggler_error", "-"))
        lines.append(f"| {r['ranks']:,} | {r['events']:,} | {r['json_mb']} | {d['wall_s']} | {h.get('wall_s', '-')} | "
                     f"{sp} | {d['peak_rss_mb']} | {h.get('peak_rss_mb', '-')} | {r['truth_stragglers']} | "
                     f"{d.get('stragglers')} | {hta_says} |")
    if res.get("throughput"):
        lines += ["", "| one rank file | events | file MB | wall s | events/s | peak MB |", "|---|---|---|---|---|---|"]
        lines += [f"| {t['format']} | {t['events']:,} | {t['file_mb']} | {t['wall_s']} | {t['events_per_s']:,} | "
                  f"{t['peak_rss_mb']} |" for t in res["throughput"]]
    if res.get("scaling"):
        lines += ["", "| ranks | events | JSON MB | wall s | peak MB | stragglers found (truth) |", "|---|---|---|---|---|---|"]
        lines += [f"| {s['ranks']:,} | {s['events']:,} | {s['json_mb']} | {s['wall_s']} | {s['peak_rss_mb']} | "
                  f"{s['stragglers']} ({s['truth_stragglers']}) |" for s in res["scaling"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 and 64 ranks, a 200k-event file, 1,000 ranks scaling")
    ap.add_argument("--skip-hta", action="store_true")
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per tool and size, interleaved; the fastest counts (for a shared, noisy machine)")
    ap.add_argument("--out", default=None, help="results file (default bench/results/trace.json, or trace_quick.json)")
    args = ap.parse_args()
    hta_py = None if args.skip_hta else ensure_hta()
    compiled = compile_bytecode()
    sizes = [8, 64] if args.quick else [8, 64, 256, 1024]
    res: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "quick": args.quick,
                 "repeat": args.repeat,
                 "command": " ".join([Path(sys.executable).name, *sys.argv]),
                 "peer_name": None if args.skip_hta else f"HTA {HTA_VERSION}", "target": TARGET,
                 "bytecode_compiled": compiled}
    tmp = Path(tempfile.mkdtemp(prefix="bench_trace_", dir=os.environ.get("BENCH_TMP")))
    try:
        print("peer comparison", file=sys.stderr)
        res["peer"] = peer_comparison(sizes, hta_py, tmp, args.repeat)
        print("throughput", file=sys.stderr)
        res["throughput"] = throughput(tmp, 147 if args.quick else 735, args.repeat)
        if not args.skip_scaling:
            print("scaling", file=sys.stderr)
            res["scaling"] = scaling(tmp, [1000] if args.quick else [1000, 10000])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["markdown"] = markdown(res)
    out = Path(args.out or RESULTS / f"{result_name('trace', args.quick)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".tmp")
    part.write_text(json.dumps(res, indent=2))
    os.replace(part, out)
    print(res["markdown"])


if __name__ == "__main__":
    main()
