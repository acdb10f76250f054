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


def test_window_lengths_match_clip_per_window():
    """The vectorised per-window lengths equal clipping each window on its own."""
    rng = np.random.default_rng(5)
    for _ in range(20):
        a_s = rng.uniform(0, 900, 50)
        a = iv.union(a_s, a_s + rng.uniform(0.1, 40, 50))
        lo = rng.uniform(-50, 950, 12)
        hi = lo + rng.uniform(-10, 300, 12)  # some empty windows
        want = [iv.length(iv.clip(a, l, h)) for l, h in zip(lo, hi)]
        np.testing.assert_allclose(iv.length_in(a, lo, hi), want, atol=1e-9)
        bins = iv.binned_busy(a, lo, hi, 7)
        for k, (l, h) in enumerate(zip(lo, hi)):
            np.testing.assert_allclose(bins[k], iv.binned_busy(a, l, h, 7), atol=1e-9)
    assert iv.length_in(iv.EMPTY, np.array([0.0]), np.array([5.0])).tolist() == [0.0]
