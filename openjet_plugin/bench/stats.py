"""Aggregation of raw samples: the median and a distribution-free 95% interval for it.

Every number in a report is `summarize(samples)` of the samples stored beside it, so anyone can
recompute it from the JSON. lo/hi is the order-statistic confidence interval for the median: with
the n samples sorted, [x(k), x(n+1-k)] covers the true median with probability
P(k <= B <= n-k), B ~ Binomial(n, 1/2), whatever the distribution of the samples. We take the
largest k whose coverage is still >= 95%. From 6 samples on, k = 1 qualifies (coverage 96.9%), so
min/max is itself a 95% interval; with 5 or fewer no such interval exists and lo/hi are min/max
with the coverage they do have (93.8% at n = 5), which `Summary.coverage` states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    lo: float
    hi: float
    coverage: float      # probability that [lo, hi] covers the true median
    min: float
    max: float
    mean: float


def median(samples: Sequence[float]) -> float:
    xs = sorted(float(x) for x in samples)
    n = len(xs)
    mid = n // 2
    return xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2.0


def binomial_half_cdf(k: int, n: int) -> float:
    """P(B <= k) for B ~ Binomial(n, 1/2)."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(0, min(k, n) + 1)) / 2.0 ** n


def median_interval_rank(n: int, confidence: float = CONFIDENCE) -> tuple[int, float]:
    """(k, coverage): the largest k (1-based) with P(k <= B <= n-k) >= confidence; k = 1 with its
    (smaller) coverage when even min/max falls short."""
    best_k, best_cov = 1, 1.0 - 2.0 * binomial_half_cdf(0, n)
    for k in range(1, n // 2 + 1):
        cov = 1.0 - 2.0 * binomial_half_cdf(k - 1, n)
        if cov >= confidence:
            best_k, best_cov = k, cov
        else:
            break
    return best_k, best_cov


def summarize(samples: Sequence[float], confidence: float = CONFIDENCE) -> Summary:
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("summarize: no samples")
    bad = [x for x in xs if not math.isfinite(x)]
    if bad:
        raise ValueError(f"summarize: non-finite sample {bad[0]!r}")
    n = len(xs)
    k, cov = median_interval_rank(n, confidence)
    return Summary(n=n, median=median(xs), lo=xs[k - 1], hi=xs[n - k], coverage=cov,
                   min=xs[0], max=xs[-1], mean=sum(xs) / n)
