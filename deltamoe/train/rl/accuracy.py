"""How sure a held-out accuracy is: the Wilson score interval of a binomial proportion.

Held-out greedy accuracy is `correct` successes in `n` independent prompts; a rise between two
evaluations is outside sampling noise when their intervals do not overlap (conservative).
"""

from __future__ import annotations

import math


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """(low, high) of the `z` (1.96: 95 %) Wilson interval for `correct` / `n`."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
