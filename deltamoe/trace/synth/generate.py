"""`deltamoe trace synth`: simulate a job step by step, then write every rank's trace and the truth.

Ground truth (`_ground_truth.json`, ignored by the reader because of the leading '_') holds
the injected stragglers and hot ranks, per-rank compute/comm/memcpy/idle/overlap totals,
per-stage bubble fractions measured on the generated timeline, and the 1F1B formula.
"""

from __future__ import annotations

import gzip
import multiprocessing as mp
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson

from deltamoe.trace import intervals as iv
from deltamoe.trace.synth.kineto import T0, RankWriter
from deltamoe.trace.synth.layout import Layout, SynthConfig, build_layout
from deltamoe.trace.synth.program import step_program
from deltamoe.trace.synth.simulate import simulate_step

STEP_GAP = 200.0  # host-side gap between steps (data loading, logging)

_STATE: dict = {}  # layout and times, inherited by forked writer processes


def generate(cfg: SynthConfig, outdir: str | Path, workers: int = 1,
             on_rank: Callable[[], None] | None = None) -> dict:
    lay = build_layout(cfg)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    times = _simulate(lay)
    _STATE.update(lay=lay, times=times, out=str(out))
    truths = []
    if workers > 1 and cfg.ranks > 1:
        with mp.get_context("fork").Pool(workers) as pool:
            for t in pool.imap_unordered(_write_rank, range(cfg.ranks), chunksize=8):
                truths.append(t)
                if on_rank:
                    on_rank()
    else:
        for r in range(cfg.ranks):
            truths.append(_write_rank(r))
            if on_rank:
                on_rank()
    truths.sort(key=lambda t: t["rank"])
    truth = _ground_truth(lay, truths)
    _atomic_write(out / "_ground_truth.json", orjson.dumps(truth, option=orjson.OPT_INDENT_2))
    _STATE.clear()
    return truth


def _simulate(lay: Layout) -> dict[int, list[list]]:
    c = lay.cfg
    start = {r: T0 for r in range(c.ranks)}
    times: dict[int, list] = {r: [] for r in range(c.ranks)}
    for step in range(c.steps):
        progs = {r: step_program(lay, r, step) for r in range(c.ranks)}
        res = simulate_step(lay, progs, start)
        for r in range(c.ranks):
            arr = np.array([t if t is not None else (np.nan, np.nan) for t in res[r]], dtype=float)
            times[r].append(arr)
            start[r] = float(np.nanmax(arr[:, 1])) + STEP_GAP
        del progs, res
    return times


def _write_rank(rank: int) -> dict:
    lay: Layout = _STATE["lay"]
    c = lay.cfg
    w = RankWriter(lay, rank)
    comp, comm, mem, pipe = [], [], [], []
    firsts, pipe_bounds = [], []
    for step in range(c.steps):
        prog = step_program(lay, rank, step)
        tm = _STATE["times"][rank][step]
        step_comp, step_pipe = [], []
        bounds = (np.inf, -np.inf)  # first and last pipeline (F/B) compute of the step
        for op, (s0, e0) in zip(prog, tm.tolist()):
            code = op[0]
            if code == "C":
                spans = w.compute(s0, op[2])
                step_comp += spans
                if op[1] in ("F", "B"):
                    step_pipe += spans
                    bounds = (min(bounds[0], spans[0][0]), max(bounds[1], spans[-1][1]))
            elif code == "M":
                mem.append(w.memcpy(s0, op[1]))
            elif code == "X":
                comm.append(w.comm(op[2], op[1], op[4], s0, e0))
                step_pipe.append(comm[-1])  # exposed MoE/TP comm is not bubble
            elif code in ("S", "R", "SR"):
                parts = ([("send", op[1], op[3]), ("recv", op[4], op[5])] if code == "SR"
                         else [("send" if code == "S" else "recv", op[1], op[-1])])
                comm.append(w.p2p(parts, lay.group(rank, "pp"), s0, e0))
        firsts.append(float(np.nanmin(tm[:, 0])))
        comp += step_comp
        pipe.append(step_pipe)
        pipe_bounds.append(bounds)
    last_end = max(e for _, e in comp + comm + mem)
    windows = [(firsts[k], firsts[k + 1] if k + 1 < c.steps else last_end) for k in range(c.steps)]
    for k, (lo, hi) in enumerate(windows):
        w.step_span(k + 1, lo - 20.0, hi - 20.0 if k + 1 < c.steps else hi + 5.0)
    data = w.document()
    name = f"rank{rank}.pt.trace.json" + (".gz" if c.gz else "")
    path = Path(_STATE["out"]) / name
    _atomic_write(path, gzip.compress(data, compresslevel=1) if c.gz else data)
    return _rank_truth(rank, windows, comp, comm, mem, pipe, pipe_bounds, len(w.ev) + 8)


def _rank_truth(rank, windows, comp, comm, mem, pipe, pipe_bounds, events) -> dict:
    c, m, x = (iv.union(*_arr(s)) for s in (comp, comm, mem))
    tot = {"compute_s": 0.0, "comm_s": 0.0, "memcpy_s": 0.0, "idle_s": 0.0, "overlap_s": 0.0}
    for lo, hi in windows:
        cc, mm, xx = iv.clip(c, lo, hi), iv.clip(m, lo, hi), iv.clip(x, lo, hi)
        busy = iv.length(iv.merge(cc, mm, xx))
        tot["compute_s"] += iv.length(cc) / 1e6
        tot["comm_s"] += iv.length(mm) / 1e6
        tot["overlap_s"] += iv.overlap(cc, mm) / 1e6
        tot["memcpy_s"] += (busy - iv.length(iv.merge(cc, mm))) / 1e6
        tot["idle_s"] += ((hi - lo) - busy) / 1e6
    pipes = []
    for p, (f0, f1) in zip(pipe, pipe_bounds):
        pipes.append((f0, f1, iv.length(iv.clip(iv.union(*_arr(p)), f0, f1))) if p else None)
    return {"rank": rank, "events": events, "step_s": [(hi - lo) / 1e6 for lo, hi in windows],
            **tot, "_pipes": pipes}


def _ground_truth(lay: Layout, truths: list[dict]) -> dict:
    c = lay.cfg
    bubbles: dict[int, list[float]] = {}
    if c.pp > 1:
        for _name, desc, ranks in lay.groups:
            if desc != "pp":
                continue
            for k in range(c.steps):
                ps = [truths[r]["_pipes"][k] for r in ranks]
                w0, w1 = min(p[0] for p in ps), max(p[1] for p in ps)
                for stage, p in enumerate(ps):
                    bubbles.setdefault(stage, []).append(1.0 - p[2] / (w1 - w0))
    for t in truths:
        t.pop("_pipes")
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in c.__dict__.items()},
        "stragglers": sorted(c.stragglers),
        "hot_ranks": sorted(r for r, _f in c.hot_ranks),
        "pipeline": ({"stages": c.pp, "microbatches": c.m, "virtual": 1,
                      "theoretical_bubble": (c.pp - 1) / (c.m + c.pp - 1),
                      "bubble_fraction": {str(s): float(np.mean(v)) for s, v in sorted(bubbles.items())},
                      "pipelines": sorted(list(r) for _n, d, r in lay.groups if d == "pp")}
                     if c.pp > 1 else None),
        "ranks": truths,
    }


def _arr(spans: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    a = np.array(spans, dtype=float).reshape(-1, 2)
    return a[:, 0], a[:, 1]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
