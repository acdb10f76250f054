"""Interval arithmetic on numpy arrays of [start, end) spans (microseconds).

Busy time on a stream is the length of the union of its kernels; overlap of two kinds of
work is |A| + |B| - |A u B| of their unions. Everything is vectorised because a rank file
can hold a million kernels.
"""

from __future__ import annotations

import numpy as np

Spans = tuple[np.ndarray, np.ndarray]
EMPTY: Spans = (np.zeros(0), np.zeros(0))


def union(starts: np.ndarray, ends: np.ndarray) -> Spans:
    """Merge possibly overlapping spans into sorted disjoint ones."""
    if len(starts) == 0:
        return EMPTY
    order = np.asarray(starts).argsort(kind="stable")  # methods, not np.* wrappers: called per rank
    s = starts[order]
    e = np.maximum.accumulate(ends[order])
    # A new merged span begins where a start lies beyond every earlier end; the running
    # maximum of the ends at the last span before the next beginning is where it ends.
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    np.greater(s[1:], e[:-1], out=new[1:])
    last = np.empty(len(s), dtype=bool)
    last[:-1] = new[1:]
    last[-1] = True
    return s[new], e[last]


def length(spans: Spans) -> float:
    s, e = spans
    return float(np.sum(e - s)) if len(s) else 0.0


def clip(spans: Spans, lo: float, hi: float) -> Spans:
    """Disjoint sorted spans cut to [lo, hi)."""
    s, e = spans
    if len(s) == 0 or hi <= lo:
        return EMPTY
    i = int(e.searchsorted(lo, side="right"))
    j = int(s.searchsorted(hi, side="left"))
    s, e = np.maximum(s[i:j], lo), np.minimum(e[i:j], hi)
    keep = e > s
    return s[keep], e[keep]


def merge(*parts: Spans) -> Spans:
    """Union of several disjoint span sets."""
    s = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0)
    e = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0)
    return union(s, e)


def overlap(a: Spans, b: Spans) -> float:
    """Length of the intersection of two disjoint span sets."""
    if len(a[0]) == 0 or len(b[0]) == 0:
        return 0.0
    return length(a) + length(b) - length(merge(a, b))


def subtract(a: Spans, b: Spans) -> Spans:
    """a minus b, both disjoint and sorted."""
    if len(a[0]) == 0 or len(b[0]) == 0:
        return a
    # Walk the boundaries: +1 when entering a, -2 when entering b; keep where the sum is 1.
    pts = np.concatenate([a[0], a[1], b[0], b[1]])
    delta = np.concatenate([np.ones(len(a[0])), -np.ones(len(a[1])),
                            np.full(len(b[0]), -2.0), np.full(len(b[1]), 2.0)])
    order = np.lexsort((delta, pts))
    pts, level = pts[order], np.cumsum(delta[order])
    inside = level == 1
    s = pts[:-1][inside[:-1]]
    e = pts[1:][inside[:-1]]
    keep = e > s
    return union(s[keep], e[keep])


def covered(spans: Spans, x: np.ndarray) -> np.ndarray:
    """Busy length of disjoint sorted spans before each point of x (the cumulative busy curve).

    Differences of this curve give the busy time inside many windows at once, which is
    what makes the per-step breakdown a few numpy calls per rank instead of a loop.
    """
    s, e = spans
    x = np.asarray(x, dtype=float)
    if len(s) == 0:
        return np.zeros(x.shape)
    span = e - s
    cum_end = np.empty(len(span) + 1)  # busy time before span i
    cum_end[0] = 0.0
    span.cumsum(out=cum_end[1:])
    k = s.searchsorted(x, side="right") - 1  # last span starting at or before x
    kk = np.maximum(k, 0)
    inside = np.minimum(np.maximum(x - s[kk], 0.0), span[kk])
    return np.where(k >= 0, cum_end[kk] + inside, 0.0)


def length_in(spans: Spans, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Busy length inside each window [lo[i], hi[i]) (0 for an empty window)."""
    x = np.empty((2, len(lo)))
    x[0] = lo
    np.maximum(hi, lo, out=x[1])
    c = covered(spans, x)
    return c[1] - c[0]


def length_outside(spans: Spans, other: Spans, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """`length_in(subtract(spans, other), lo, hi)` without building the difference (both disjoint
    and sorted): the time outside `other` before a point is the point minus `covered(other, .)`,
    so each span's part outside `other` is a difference of that curve at its ends, and a window's
    is the running sum of those up to each edge. One `covered` call instead of subtract's sort."""
    s, e = spans
    lo = np.asarray(lo, dtype=float)
    if len(s) == 0 or len(lo) == 0:
        return np.zeros(len(lo))
    if len(other[0]) == 0:
        return length_in(spans, lo, hi)
    x = np.empty((2, len(lo)))
    x[0] = lo
    np.maximum(hi, lo, out=x[1])
    k = s.searchsorted(x, side="right") - 1  # the last span starting at or before each edge
    kk = np.maximum(k, 0)
    xc = np.minimum(x, e[kk])  # the edge, or the end of that span when the edge lies beyond it
    n = len(s)
    pts = np.concatenate([s, e, xc.ravel()])
    free = pts - covered(other, pts)
    fs, fe, fx = free[:n], free[n:2 * n], free[2 * n:].reshape(x.shape)
    cum = np.empty(n + 1)  # outside time of the spans before span i
    cum[0] = 0.0
    (fe - fs).cumsum(out=cum[1:])
    at = np.where(k >= 0, cum[kk] + np.maximum(fx - fs[kk], 0.0), 0.0)
    return at[1] - at[0]


def binned_busy(spans: Spans, lo, hi, bins: int) -> np.ndarray:
    """Fraction of each of `bins` equal slices of [lo, hi) covered by the spans.

    lo and hi may be arrays of windows; the result then has one row of bins per window.
    """
    lo_a, hi_a = np.atleast_1d(np.asarray(lo, dtype=float)), np.atleast_1d(np.asarray(hi, dtype=float))
    out = np.zeros((len(lo_a), bins))
    ok = hi_a > lo_a
    if ok.any() and len(spans[0]):
        lo_ok, hi_ok = lo_a[ok, None], hi_a[ok, None]
        edges = np.arange(bins + 1) * ((hi_ok - lo_ok) / bins) + lo_ok  # np.linspace, without its overhead
        edges[:, -1] = hi_ok[:, 0]
        c = covered(spans, edges)
        out[ok] = (c[:, 1:] - c[:, :-1]) / (edges[:, 1:] - edges[:, :-1])
    return out if np.ndim(lo) else out[0]
