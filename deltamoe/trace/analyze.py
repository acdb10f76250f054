"""Run every analysis over a folder of rank traces and return one JSON-ready report dict."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from deltamoe.errors import TraceError
from deltamoe.trace.reader import ReadConfig, dedupe_ranks, find_traces, read_all
from deltamoe.trace.summary import RankSummary


# Of the report dict (JSON): bumped when a field changes meaning or type. 2: alltoall bytes may be
# null (unknown), straggler_detail.unresolved_instances, gloo groups "?<kind>".
SCHEMA_VERSION = 2


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
    from deltamoe.trace.clock import correct
    from deltamoe.trace.join import join

    _check_steps(cfg, summaries)
    # A rank whose clock is (trustworthily) off the others' is shifted before anything compares ranks.
    summaries, j, clock = correct(summaries, join)
    pipe = bubbles(j, summaries)
    stage_of = {int(k): v for k, v in pipe["stage_of_rank"].items()} if pipe else {}
    a2a = alltoall(j)
    hot = {h["rank"] for h in a2a["hot_ranks"]} if a2a else set()
    strag = stragglers(j, summaries, stage_of, hot)
    rows = breakdown(summaries)
    report = {
        "schema_version": SCHEMA_VERSION,
        "folder": str(folder),
        "ranks_found": len(paths), "ranks_analyzed": len(summaries),
        "world_size": max(s.world_size for s in summaries),
        "backend": summaries[0].backend, "mode": summaries[0].mode,
        "events": sum(s.events for s in summaries),
        "read_seconds": round(t_read, 3), "analysis_seconds": round(time.perf_counter() - t0 - t_read, 3),
        "skipped": [{"path": e.path, "error": e.message} for e in errors],
        "consistency": consistency(summaries, j, clock),
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


def consistency(summaries: list[RankSummary], j, clock: dict[int, float] | None = None) -> dict:
    """What does not add up across the rank files: ranks missing from the world, collectives a
    member lacks (excluded from straggler evidence), per-rank warnings. `clock`: rank -> the
    clock offset (us) removed from its timestamps (trace/clock.py)."""
    clock = clock or {}
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
    warnings += _world_size_warnings(summaries)
    warnings += _time_span_warnings(summaries)
    warnings += [f"rank {r}: its collectives end {off / 1e3:+.1f} ms after the other members' (median; members "
                 f"of a collective leave it together): its clock is about {off / 1e3:+.1f} ms off the others'; "
                 f"corrected (its timestamps were shifted by {-off / 1e3:+.1f} ms before comparing ranks)"
                 for r, off in sorted(clock.items())]
    warnings += _clock_skew_warnings(j)
    warnings += _unplaced_warnings(j)
    warnings += _unpaired_p2p_warnings(j)
    for (rank, group), items in sorted(by_group.items()):
        if group.startswith("?"):  # unplaced gloo ops: warned about per rank above
            continue
        if not group:  # no process group in the trace at all
            warnings.append(f"rank {rank}: {len(items)} {items[0]['kind']} op(s) matched no process group (gloo does "
                            "not name it; no group's members overlap it in time); excluded from straggler evidence")
            continue
        seqs = sorted(u["seq"] for u in items)
        seqs = ", ".join(map(str, seqs[:8])) + (", ..." if len(seqs) > 8 else "")
        warnings.append(f"rank {rank} lacks {len(items)} collective(s) of group {group or '?'} that its other "
                        f"members ran ({items[0]['kind']}, sequence {seqs}); excluded from straggler evidence")
    same: dict[str, list[int]] = {}  # one line per text, naming its ranks (not one line per rank)
    for s in summaries:
        for w in s.warnings:
            same.setdefault(w, []).append(s.rank)
    warnings += [f"rank{'s' if len(r) > 1 else ''} {_ranks_text(r)}: {w}" for w, r in same.items()]
    return {"world_size": world, "missing_ranks": missing, "unmatched_collectives": j.unmatched[:256],
            "unmatched_count": len(j.unmatched), "warnings": warnings[:64],
            "clock_offsets_ms": {str(r): round(off / 1e3, 3) for r, off in sorted(clock.items())}}


def _world_size_warnings(summaries: list[RankSummary]) -> list[str]:
    """Rank files that disagree on the world size come from different jobs (or a broken file)."""
    by_size: dict[int, list[int]] = {}
    for s in summaries:
        by_size.setdefault(s.world_size, []).append(s.rank)
    if len(by_size) < 2:
        return []
    parts = "; ".join(f"{w} in rank{'s' if len(r) > 1 else ''} {_ranks_text(sorted(r))}"
                      for w, r in sorted(by_size.items()))
    return [f"rank files disagree on world_size ({parts}): files from different jobs? the largest is used"]


def _time_span_warnings(summaries: list[RankSummary]) -> list[str]:
    """All ranks of one profiling window run at the same time: a rank whose kept steps do not
    overlap another's comes from another job or window, and comparing them means nothing."""
    spans = [(float(s.window[:, 0].min()), float(s.window[:, 1].max()), s.rank) for s in summaries if len(s.window)]
    if len(spans) < 2:
        return []
    late = max(spans, key=lambda x: (x[0], -x[2]))  # the rank that starts last (the lowest of a tie)
    early = min(spans, key=lambda x: (x[1], x[2]))  # the rank that ends first
    if late[0] <= early[1]:
        return []
    apart = [r for a, b, r in spans if a > early[1]]
    return [f"rank files do not overlap in time: rank {early[2]} ends {(late[0] - early[1]) / 1e6:.1f} s before "
            f"rank {late[2]} starts (ranks starting after rank {early[2]} ended: {_ranks_text(sorted(apart))}); "
            "files from different jobs or profiling windows?"]


# Collectives none of whose members can leave before all have entered (a broadcast root can).
_SYNC_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier")


def _clock_skew_warnings(j) -> list[str]:
    """A rank whose collectives, on its clock, start after every other member has finished them
    (or end before any other member started them) cannot be right: no member leaves a collective
    before all have entered. Seen in most of a rank's collectives, its clock is off the others'.

    Per instance of three members or more, only the member that ends last can have started after
    all the others ended (any other ends before it), and only the first to arrive can have ended
    before all the others arrived; the offset is read against the next member's end (members of
    one collective leave it together). Pairs cannot tell which clock is off and are left out."""
    if not len(j.inst):
        return []
    keep = np.flatnonzero(np.isin(j.kind, _SYNC_KINDS) & (j.inst_size[j.inst] >= 3))
    if not len(keep):
        return []
    inst, rank, arrive, end = j.inst[keep], j.rank[keep], j.arrive[keep], j.end[keep]
    total = np.bincount(rank, minlength=int(rank.max()) + 1)
    odd_rank, odd_off = [], []
    for key, late in ((end, True), (arrive, False)):
        order = np.lexsort((key, inst))
        g = inst[order]
        first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        last = np.r_[first[1:], len(g)] - 1
        full = last - first >= 2  # three members or more (the instance may lack some)
        first, last = first[full], last[full]
        if late:  # the last to end started after the one ending next had finished
            a, b = order[last], order[last - 1]
            odd = arrive[a] > end[b]
        else:  # the first to arrive ended before the one arriving next had arrived
            a, b = order[first], order[first + 1]
            odd = end[a] < arrive[b]
        odd_rank.append(rank[a[odd]])
        odd_off.append(end[a[odd]] - end[b[odd]])
    ranks, offs = np.concatenate(odd_rank), np.concatenate(odd_off)
    out = []
    for r in np.unique(ranks).tolist():
        mine = offs[ranks == r]
        n = int(total[r])
        if len(mine) < 2 or 2 * len(mine) < n:
            continue
        off = float(np.median(mine)) / 1e3
        which = ("started after all other members had finished them" if off > 0
                 else "ended before any other member had started them")
        out.append(f"rank {r}: in {len(mine)} of {n} collectives it {which}, impossible without clock skew: its "
                   f"clock is about {off:+.1f} ms off the others'; lateness measured against it is unreliable")
    return out


def _unplaced_warnings(j) -> list[str]:
    """gloo ops placed in no process group (join._resolve_unnamed_groups names them "?<kind>")."""
    count: dict[tuple[int, str], int] = {}
    for rank, pg in zip(j.rank.tolist(), j.pg.tolist()):
        if str(pg).startswith("?"):
            count[(rank, pg[1:])] = count.get((rank, pg[1:]), 0) + 1
    return [f"rank {rank}: {n} {kind} op(s) matched no process group (gloo does not name it; no group's members "
            "overlap it in time); excluded from straggler evidence" for (rank, kind), n in sorted(count.items())]


def _unpaired_p2p_warnings(j) -> list[str]:
    """P2P ops paired with nothing: a peer the trace does not name (gloo without record_shapes
    in a group of more than two ranks), or no matching op on the peer."""
    lone = j.p2p_unpaired
    if not lone or not len(lone["rank"]):
        return []
    nopeer = int((lone["peer"] < 0).sum())
    out = []
    if nopeer:
        out.append(f"{nopeer} P2P ops could not be paired (record with record_shapes=True): the trace does not "
                   f"name their peer (ranks {_ranks_text(sorted(set(lone['rank'][lone['peer'] < 0].tolist())))}); "
                   "a collective member held in such a recv is no straggler evidence")
    other = len(lone["rank"]) - nopeer
    if other:
        out.append(f"{other} P2P ops have no counterpart on their peer (ranks "
                   f"{_ranks_text(sorted(set(lone['rank'][lone['peer'] >= 0].tolist())))}); "
                   "a collective member held in such a recv is no straggler evidence")
    return out


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
    import deltamoe.trace.clock
    import deltamoe.trace.join
    import deltamoe.trace.report  # noqa: F401
