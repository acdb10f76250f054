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


def test_length_outside_equals_subtract_then_measure():
    """`length_outside` (one cumulative curve) against its readable form, subtract then length_in:
    on fresh random spans and windows (overlapping, empty and out-of-range windows, spans touching),
    at small and at Kineto-sized timestamps (microseconds since boot, ~1e12)."""
    rng = np.random.default_rng(11)
    for trial in range(60):
        base = 0.0 if trial % 2 else 1.7e12
        n, m, w = rng.integers(0, 40), rng.integers(0, 40), rng.integers(0, 10)
        a_s = base + rng.uniform(0, 900, n)
        a = iv.union(a_s, a_s + rng.choice([0.0, 5.0, 30.0], n) + rng.uniform(0, 20, n))
        b_s = base + np.round(rng.uniform(0, 900, m))  # rounded: ends that meet exactly
        b = iv.union(b_s, b_s + np.round(rng.uniform(0, 40, m)))
        lo = base + rng.uniform(-100, 1000, w)
        hi = lo + rng.uniform(-20, 400, w)
        want = iv.length_in(iv.subtract(a, b), lo, hi)
        np.testing.assert_allclose(iv.length_outside(a, b, lo, hi), want, rtol=0, atol=1e-9 if not base else 1e-3)
    assert iv.length_outside(iv.EMPTY, iv.EMPTY, np.array([0.0]), np.array([1.0])).tolist() == [0.0]
