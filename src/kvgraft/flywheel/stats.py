"""Small statistics for reports: Wilson score intervals and medians."""

from __future__ import annotations

import math


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion (well behaved at 0 and n, unlike the normal approximation).

    Args:
        correct: successes.
        n: trials.
        z: the normal quantile (the default gives a 95% interval).

    Returns:
        (low, high) within [0, 1]; (0.0, 1.0) when n is 0.
    """
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))
