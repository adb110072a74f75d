"""Small statistics for reports: Wilson score intervals, and intervals of a mean over problems."""

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
    # The interval holds p exactly; at 0 and n rounding can leave its end a hair inside (1 - 1e-16), so clamp.
    return (min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)))


def mean_interval(values: list[float], z: float = 1.959964) -> tuple[float, float]:
    """A 95% interval of the mean of per-problem accuracies (each in [0, 1]), as with several samples per problem.

    The normal interval of the mean, with the standard error of the per-problem values (samples of one problem are
    not independent, so the problems are the units). When every problem has the same accuracy the standard error
    is 0 and says nothing: the Wilson interval over problems, at that accuracy, is given instead.

    Args:
        values: one accuracy per problem.
        z: the normal quantile (the default gives a 95% interval).

    Returns:
        (low, high) within [0, 1]; (0.0, 1.0) when there are no values.
    """
    n = len(values)
    if n == 0:
        return (0.0, 1.0)
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    if variance == 0.0:
        low, high = wilson_interval(round(mean * n), n, z)
        return (min(low, mean), max(high, mean))
    half = z * math.sqrt(variance / n)
    return (max(0.0, mean - half), min(1.0, mean + half))
