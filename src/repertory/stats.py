"""Statistics without torch: means with exactly rounded sums, standard errors, quantiles, correlations, paired
t-tests over seeds and a bootstrap over games within seeds.

Evaluation tables, ``repertory report --table`` and the estimators share these, so a table printed from
metrics files needs no model code. Student's t distribution comes from mpmath's regularised incomplete beta.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import mpmath

from repertory.types import RepertoryError


def finite_number(value: object) -> bool:
    """Whether ``value`` is a finite int or float (not a bool, NaN or an infinity): a point a metric can plot."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def mean(xs: list[float]) -> float:
    """The mean, with an exactly rounded sum so that group statistics do not depend on the batch's order."""
    return math.fsum(xs) / len(xs)


def std(xs: list[float]) -> float:
    """Unbiased standard deviation; 0 for fewer than two numbers (section 0)."""
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (unbiased std / sqrt(n)); SE 0 for a single value, both NaN for none."""
    if not values:
        return math.nan, math.nan
    return mean(values), std(values) / math.sqrt(len(values))


def seed_summary(scores: list[float]) -> tuple[float, float]:
    """Mean and standard error of per-seed scores (5.7); SE 0 for a single seed."""
    if not scores:
        raise RepertoryError("no seed scores to summarise")
    return mean_se(scores)


def format_mean_se(value: float, se: float, digits: int = 2) -> str:
    """Mean ± SE the way the I-GRPO tables print it (5.7): "0.55 ± .01", the SE without its leading zero."""
    se_text = f"{se:.{digits}f}"
    if se_text.startswith("0."):
        se_text = se_text[1:]
    return f"{value:.{digits}f} ± {se_text}"


def plus_minus(value: float, se: float, n: int, decimals: int | None = None) -> str:
    """ "mean ± SE" with both at the same decimals (by default three, fewer for values of 10 and 100 or more); a
    mean of one value has no standard error and reads "mean (n = 1)", never "± 0"."""
    if decimals is None:
        scale = max(abs(value), abs(se)) if math.isfinite(value) and math.isfinite(se) else 0.0
        decimals = 1 if scale >= 100 else 2 if scale >= 10 else 3
    if n < 2:
        return f"{value:.{decimals}f} (n = {n})"
    return f"{value:.{decimals}f} ± {se:.{decimals}f}"


def quantile(xs: list[float], q: float) -> float:
    """numpy.quantile's default: linear interpolation between order statistics, from the nearer one as numpy
    does, so cutoffs match numpy to the bit."""
    xs = sorted(xs)
    position = (len(xs) - 1) * q
    if position >= len(xs) - 1:
        return xs[-1]
    lo = math.floor(position)
    a, b, frac = xs[lo], xs[lo + 1], position - lo
    return b - (b - a) * (1 - frac) if frac >= 0.5 else a + (b - a) * frac


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson's correlation; None when either side is constant."""
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def _ranks(x: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their average rank."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and x[order[end + 1]] == x[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def rank_correlation(x: list[float], y: list[float]) -> float | None:
    """Spearman's rho (Pearson on average ranks); None when either side is constant."""
    return pearson(_ranks(x), _ranks(y))


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise RepertoryError(f"a t-test needs at least 1 degree of freedom (got {df})")
    if math.isinf(t):
        return 0.0
    return float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))


NORMAL_975 = 1.959963984540054
"""The standard normal's 97.5th percentile."""


def t_critical(df: int, level: float = 0.95) -> float:
    """The t value that ``level`` of Student's t with ``df`` degrees of freedom lies within (two-sided)."""
    low, high = 0.0, 1.0
    while t_two_sided_p(high, df) > 1 - level:
        high *= 2
    for _ in range(80):  # bisection down to float precision
        mid = (low + high) / 2
        low, high = (mid, high) if t_two_sided_p(mid, df) > 1 - level else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class Paired:
    """A paired comparison over seeds: the mean difference, its standard error, the ``level`` confidence interval
    and the two-sided p of a t-test with seeds - 1 degrees of freedom."""

    mean: float
    se: float
    low: float
    high: float
    p: float
    seeds: int


def paired_t(differences: list[float], level: float = 0.95) -> Paired:
    """The t-test of per-seed differences (arm A - arm B on the same seed): mean, SE, CI and p with n - 1 degrees of
    freedom. Differences that are all equal have SE 0: p is 1 where they are 0, else 0."""
    n = len(differences)
    if n < 2:
        raise RepertoryError(f"a paired comparison needs at least 2 seeds in both arms (got {n})")
    m, se = mean_se(differences)
    if se == 0:
        return Paired(m, 0.0, m, m, 1.0 if m == 0 else 0.0, n)
    half = t_critical(n - 1, level) * se
    return Paired(m, se, m - half, m + half, t_two_sided_p(m / se, n - 1), n)


MOST_SEEDS = 10_000
"""Where :func:`seeds_to_decide` stops counting."""


def seeds_to_decide(sd: float, effect: float, level: float = 0.95) -> int | None:
    """The fewest seeds at which a paired ``level`` CI of differences with standard deviation ``sd`` is narrower
    than ``effect``: it can then hold 0 or ±``effect`` but not both, so it shows a difference or excludes the
    effect. None beyond :data:`MOST_SEEDS` (a spread too large for the effect)."""
    if effect <= 0:
        raise RepertoryError(f"the smallest effect of interest must be positive (got {effect})")
    if sd == 0:
        return 2
    z = 2 * NORMAL_975 * sd / effect  # t's critical value is above the normal's, so no fewer seeds than z**2
    for n in range(max(2, math.floor(z * z)), MOST_SEEDS + 1):
        if 2 * t_critical(n - 1, level) * sd / math.sqrt(n) < effect:
            return n
    return None


@dataclass(frozen=True)
class Decision:
    """What a paired comparison decides at a smallest effect of interest: its ``label``, whether it is
    ``settled`` (nothing left open), and else the ``seeds`` that would settle it at the measured spread (None:
    more than :data:`MOST_SEEDS`)."""

    label: str
    settled: bool
    seeds: int | None = None


def decide(c: Paired, effect: float) -> Decision:
    """What a paired comparison (A − B) decides at the smallest effect of interest ``effect`` (δ). Where its CI
    excludes 0 the difference is shown: "above 0", and "above +δ" where the CI is wholly beyond the effect, or
    "above 0, below +δ" where the difference is real but smaller than the effect (and the same below 0). Where it
    holds 0: "within ±δ" (level at this scale) settles it too; "below +δ" / "above −δ" exclude one side's effect
    (A is not ahead, or not behind, by δ) and span 0 and the other's; "open" spans both. These leave a question
    open, with the seeds that would settle it."""
    if c.low > 0:
        return Decision(_beyond_zero("above", "below", "+", c.low >= effect, c.high < effect, effect), True)
    if c.high < 0:
        return Decision(_beyond_zero("below", "above", "−", c.high <= -effect, c.low > -effect, effect), True)
    if -effect < c.low and c.high < effect:
        return Decision(f"within ±{effect:g}", True)
    label = f"below +{effect:g}" if c.high < effect else f"above −{effect:g}" if c.low > -effect else "open"
    return Decision(label, False, seeds_to_decide(c.se * math.sqrt(c.seeds), effect))


def _beyond_zero(side: str, other: str, sign: str, past: bool, short: bool, effect: float) -> str:
    if past:
        return f"{side} {sign}{effect:g}"
    return f"{side} 0, {other} {sign}{effect:g}" if short else f"{side} 0"


def bootstrap_gain(groups: list[list[float]], draws: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """A one-sided test that the mean over groups (seeds) of each group's mean (over its games) is above 0, by
    resampling games within each group: the statistic, the 5th percentile of its bootstrap distribution, and
    p = (1 + draws at or below 0) / (1 + draws). Seeds are held fixed, so the test asks whether these exploiters
    gained, not whether every exploiter would."""
    if not groups or any(not g for g in groups):
        raise RepertoryError("a bootstrap over games needs at least one game in every seed")
    rng = random.Random(seed)
    statistic = mean([mean(g) for g in groups])
    resampled = [mean([mean(rng.choices(g, k=len(g))) for g in groups]) for _ in range(draws)]
    at_or_below = sum(x <= 0 for x in resampled)
    return statistic, quantile(resampled, 0.05), (1 + at_or_below) / (1 + draws)
