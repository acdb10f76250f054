"""Run every analysis over a folder of rank traces and return one JSON-ready report dict."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

from deltamoe.errors import TraceError
from deltamoe.trace.reader import ReadConfig, dedupe_ranks, find_traces, read_all
from deltamoe.trace.summary import RankSummary


@dataclass
class Analysis:
    report: dict
    summaries: list[RankSummary]


def analyze(folder: str, cfg: ReadConfig | None = None, workers: int = 0,
            on_file: Callable[[str], None] | None = None, on_start: Callable[[int], None] | None = None) -> Analysis:
    # The summaries and columns are long-lived and free of cycles: collections while they
    # pile up would only rescan them (~30% of unpickling time; more at thousands of ranks).
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        return _analyze(folder, cfg, workers, on_file, on_start)
    finally:
        if gc_was_on:
            gc.enable()


def _analyze(folder: str, cfg: ReadConfig | None, workers: int, on_file: Callable[[str], None] | None,
             on_start: Callable[[int], None] | None) -> Analysis:
    cfg = cfg or ReadConfig()
    paths = find_traces(folder)
    if on_start:
        on_start(len(paths))
    t0 = time.perf_counter()
    # The analyses load while the reader processes work (this process would only wait).
    results = list(read_all(paths, cfg, workers, on_file, meanwhile=_load_analyses))
    t_read = time.perf_counter() - t0
    summaries, errors = dedupe_ranks(results)
    if not summaries:
        first = errors[0].message if errors else "nothing readable"
        raise TraceError(f"no usable rank file in {folder} ({len(errors)} skipped; first: {first})", field="DIR")
    from deltamoe.trace.analyses.alltoall import alltoall
    from deltamoe.trace.analyses.breakdown import breakdown, totals
    from deltamoe.trace.analyses.exposed import exposed
    from deltamoe.trace.analyses.bubbles import bubbles
    from deltamoe.trace.analyses.overlap import overlap
    from deltamoe.trace.analyses.steps import step_times
    from deltamoe.trace.analyses.stragglers import stragglers
    from deltamoe.trace.analyses.sync_skew import sync_skew
    from deltamoe.trace.join import join

    _check_steps(cfg, summaries)
    j = join(summaries)
    pipe = bubbles(j, summaries)
    stage_of = {int(k): v for k, v in pipe["stage_of_rank"].items()} if pipe else {}
    a2a = alltoall(j)
    hot = {h["rank"] for h in a2a["hot_ranks"]} if a2a else set()
    strag = stragglers(j, summaries, stage_of, hot)
    rows = breakdown(summaries)
    report = {
        "folder": str(folder),
        "ranks_found": len(paths), "ranks_analyzed": len(summaries),
        "world_size": max(s.world_size for s in summaries),
        "backend": summaries[0].backend, "mode": summaries[0].mode,
        "events": sum(s.events for s in summaries),
        "read_seconds": round(t_read, 3), "analysis_seconds": round(time.perf_counter() - t0 - t_read, 3),
        "skipped": [{"path": e.path, "error": e.message} for e in errors],
        "consistency": consistency(summaries, j),
        "collectives_matched": j.instances, "p2p_matched": int(len(j.p2p_src)),
        "totals": totals(rows),
        "stragglers": strag["stragglers"],
        "straggler_detail": {k: v for k, v in strag.items() if k != "stragglers"},
        "ranks": rows,
        "overlap": overlap(summaries),
        "exposed_by_kind": exposed(summaries),
        "sync_skew": sync_skew(j),
        "pipeline": pipe,
        "bubble_fraction": pipe["bubble_fraction"] if pipe else None,
        "alltoall": a2a,
        "step_times": step_times(summaries),
    }
    return Analysis(report, summaries)


def consistency(summaries: list[RankSummary], j) -> dict:
    """What does not add up across the rank files: ranks missing from the world, collectives a
    member lacks (excluded from straggler evidence), per-rank warnings."""
    world = max(s.world_size for s in summaries)
    present = {s.rank for s in summaries}
    missing = sorted(set(range(world)) - present)
    warnings = []
    if missing:
        warnings.append(f"{len(missing)} of {world} rank files missing (ranks {_ranks_text(missing)}); "
                        "collectives of their groups are matched among the others")
    by_group: dict[tuple[int, str], list[dict]] = {}
    for u in j.unmatched:
        by_group.setdefault((u["rank"], u["group"]), []).append(u)
    for (rank, group), items in sorted(by_group.items()):
        if not group or group.startswith("?"):  # gloo ops that no group's members overlap in time
            warnings.append(f"rank {rank}: {len(items)} {items[0]['kind']} op(s) matched no process group (gloo does "
                            "not name it; no group's members overlap it in time); excluded from straggler evidence")
            continue
        seqs = sorted(u["seq"] for u in items)
        seqs = ", ".join(map(str, seqs[:8])) + (", ..." if len(seqs) > 8 else "")
        warnings.append(f"rank {rank} lacks {len(items)} collective(s) of group {group or '?'} that its other "
                        f"members ran ({items[0]['kind']}, sequence {seqs}); excluded from straggler evidence")
    for s in summaries:
        warnings += [f"rank {s.rank}: {w}" for w in s.warnings]
    return {"world_size": world, "missing_ranks": missing, "unmatched_collectives": j.unmatched[:256],
            "unmatched_count": len(j.unmatched), "warnings": warnings[:64]}


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f", ... ({len(ranks)} in all)" if len(ranks) > 16 else "")


def _check_steps(cfg: ReadConfig, summaries: list[RankSummary]) -> None:
    """`--steps` that selects nothing is a usage error, not a report of zeros."""
    if cfg.steps == (None, None) or any(len(s.step_ids) for s in summaries):
        return
    held = sorted({n for s in summaries for n in s.steps_in_trace})
    lo, hi = cfg.steps
    asked = f"{'' if lo is None else lo}:{'' if hi is None else hi}"
    have = f"{held[0]}..{held[-1]}" if held else "none"
    raise TraceError(f"no step of {asked} in the traces (they hold steps {have})", field="--steps",
                     hint="pick A:B inside that range")


def _load_analyses() -> None:
    import numpy.ma  # noqa: F401  np.unique (join, analyses) loads it on first use

    import deltamoe.trace.analyses.alltoall
    import deltamoe.trace.analyses.breakdown
    import deltamoe.trace.analyses.exposed
    import deltamoe.trace.analyses.bubbles
    import deltamoe.trace.analyses.overlap
    import deltamoe.trace.analyses.steps
    import deltamoe.trace.analyses.stragglers
    import deltamoe.trace.analyses.sync_skew
    import deltamoe.trace.join
    import deltamoe.trace.report  # noqa: F401
