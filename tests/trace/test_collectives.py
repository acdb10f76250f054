"""Collective numbering and step placement (vectorised) against a plain per-row loop."""

from __future__ import annotations

import numpy as np

from deltamoe.trace.classify import P2P_KINDS
from deltamoe.trace.collectives import _text, finish


def _reference(pg, seq, kind, arrive, windows):
    """The per-row loop the vectorised `finish` replaced."""
    order = sorted(range(len(arrive)), key=lambda i: arrive[i])
    counters: dict = {}
    out_seq, out_step = [], []
    for i in order:
        s = seq[i]
        if s < 0:
            key = (pg[i], kind[i] in P2P_KINDS) if pg[i] else (kind[i], kind[i] in P2P_KINDS)
            s = counters.get(key, 0)
            counters[key] = s + 1
        out_seq.append(s)
        # The last step starting at or before the arrival, if the arrival lies inside it
        # (the end of the last step included).
        starts = [k for k, (lo, _) in enumerate(windows) if lo <= arrive[i]]
        k = starts[-1] if starts else -1
        inside = k >= 0 and (arrive[i] < windows[k][1] or (k == len(windows) - 1 and arrive[i] <= windows[k][1]))
        out_step.append(k if inside else -1)
    return out_seq, out_step


def test_finish_numbers_and_places_like_the_loop():
    rng = np.random.default_rng(7)
    kinds = ["all_reduce", "all_to_all", "send", "recv", "all_gather"]
    for _ in range(30):
        n = int(rng.integers(0, 60))
        pg = [str(rng.choice(["", "0", "3", "7"])) for _ in range(n)]
        kind = [str(rng.choice(kinds)) for _ in range(n)]
        seq = [int(x) if rng.random() < 0.3 else -1 for x in rng.integers(0, 50, n)]
        arrive = np.round(rng.uniform(0, 100, n), 1)  # ties happen: order must be stable
        starts = np.sort(rng.uniform(0, 100, 3))
        windows = np.stack([starts, starts + rng.uniform(5, 40, 3)], axis=1)  # gaps and overlaps
        got = finish(pg=_text(pg), seq=np.array(seq, dtype=np.int64), kind=_text(kind),
                     nbytes=np.zeros(n, dtype=np.int64), arrive=arrive, end=arrive + 1,
                     peer=np.full(n, -1, dtype=np.int64), windows=windows)
        want_seq, want_step = _reference(pg, seq, kind, arrive.tolist(), windows.tolist())
        assert got.seq.tolist() == want_seq
        assert got.step.tolist() == want_step
        assert got.arrive.tolist() == sorted(arrive.tolist())
