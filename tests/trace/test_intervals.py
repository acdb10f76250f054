"""Interval helpers against brute force on a fine grid."""

from __future__ import annotations

import numpy as np

from deltamoe.trace import intervals as iv


def _grid(spans, n=1000):
    g = np.zeros(n, dtype=bool)
    for s, e in zip(*spans):
        g[int(s):int(e)] = True
    return g


def test_union_overlap_subtract_binned_match_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(20):
        a_s = rng.integers(0, 900, 40).astype(float)
        a = iv.union(a_s, a_s + rng.integers(1, 60, 40))
        b_s = rng.integers(0, 900, 30).astype(float)
        b = iv.union(b_s, b_s + rng.integers(1, 60, 30))
        ga, gb = _grid(a), _grid(b)
        assert iv.length(a) == ga.sum()
        assert iv.overlap(a, b) == (ga & gb).sum()
        assert iv.length(iv.subtract(a, b)) == (ga & ~gb).sum()
        assert iv.length(iv.clip(a, 100, 700)) == ga[100:700].sum()
        np.testing.assert_allclose(iv.binned_busy(a, 0, 1000, 10), ga.reshape(10, 100).mean(axis=1))
