"""What a table of won and lost games shows: intervals, paired differences, exact tests, a verdict.

Every figure here is over games, each won (1) or lost (0). An arm's success rate gets a Wilson 95 %
interval (right at 0 and 1, where the normal approximation is not). Two rows played on the same games
are compared pairwise: the difference of their success rates with a bootstrap 95 % interval over games
(resampling games, not episodes, since the two rows share them), and the exact McNemar test, which
looks only at the discordant games (won by one row and not the other) and asks how likely a split at
least that lopsided is when either row is as likely to win each of them: a two-sided sign test.

A pooled row (an arm trained with several seeds) has one value per game: the mean over its seeds. Its
paired difference is over games as above; its McNemar counts every (game, seed) pair against the
reference's outcome on that game, which treats the seeds as independent draws of the arm.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

Z95 = 1.959963984540054


def wilson(won: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of ``won`` successes in ``n`` trials (``won`` may be fractional: a pooled row's
    mean over seeds times its games); (0, 1) for no trials."""
    if n <= 0:
        return 0.0, 1.0
    p = won / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # exact at the edges: no won game leaves 0 inside the interval, not a rounding error above it
    low = 0.0 if won <= 0 else max(0.0, centre - half)
    return low, 1.0 if won >= n else min(1.0, centre + half)


def sign_test_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p over ``b`` games won only by one row and ``c`` only by the other: the
    binomial(b + c, 1/2) probability of a split at least as far from even. 1.0 with no discordant game."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], rounds: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean of a - b, 2.5th and 97.5th percentiles of that mean over ``rounds`` resamples of the games).
    ``a`` and ``b`` are per-game values of two rows on the same games, in the same order."""
    if len(a) != len(b):
        raise ValueError(f"paired rows differ in length: {len(a)} against {len(b)} games")
    n = len(a)
    if n == 0:
        return 0.0, 0.0, 0.0
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / n
    rng = random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    return mean, means[int(0.025 * rounds)], means[min(rounds - 1, int(0.975 * rounds))]


def pairs_of(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
    """The (row, reference) outcome pairs of one game: seed with seed when both rows have the same seeds
    (an arm's loop against its own drafts), each seed against a reference played once, else none."""
    if len(a) == len(b):
        return list(zip(a, b))
    if len(b) == 1:
        return [(x, b[0]) for x in a]
    return []


def discordant(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(pairs won by ``a`` only, pairs won by ``b`` only): ``a`` and ``b`` hold each game's outcomes over
    their seeds (one or more), paired as :func:`pairs_of` says."""
    pairs = [p for outs, ref in zip(a, b) for p in pairs_of(outs, ref)]
    return sum(1 for x, y in pairs if x and not y), sum(1 for x, y in pairs if y and not x)


def compare(
    name: str, a: Sequence[Sequence[int]], reference_name: str, b: Sequence[Sequence[int]], rounds: int = 10_000
) -> dict[str, object]:
    """Row ``a`` against ``b`` on the same games (each game's outcomes over each row's seeds): the paired
    difference of per-game means with its bootstrap interval, the discordant pairs, the exact p and the verdict."""
    if any(len(x) != len(y) and len(y) != 1 for x, y in zip(a, b)):
        raise ValueError(f"{name} against {reference_name}: seeds cannot be paired ({len(a[0])} against {len(b[0])})")
    per_game = [sum(outs) / len(outs) for outs in a]
    ref_game = [sum(outs) / len(outs) for outs in b]
    diff, low, high = paired_bootstrap(per_game, ref_game, rounds)
    only_a, only_b = discordant(a, b)
    p = sign_test_p(only_a, only_b)
    return {
        "row": name,
        "reference": reference_name,
        "games": len(b),
        "difference": round(diff, 4),
        "ci95": [round(low, 4), round(high, 4)],
        "only_row": only_a,
        "only_reference": only_b,
        "p": round(p, 4),
        "verdict": verdict(name, reference_name, diff, low, high, p),
    }


def verdict(name: str, reference: str, diff: float, low: float, high: float, p: float) -> str:
    """One line a reader can take as the table's conclusion: ahead or behind only when both the bootstrap
    interval excludes 0 and the exact test rejects at 5 %; otherwise not distinguishable, with the figures."""
    figures = f"{diff:+.2f} [{low:+.2f}, {high:+.2f}], p = {p:.2g}"
    if low > 0 and p < 0.05:
        return f"{name} ahead of {reference} at 95 %: {figures}"
    if high < 0 and p < 0.05:
        return f"{name} behind {reference} at 95 %: {figures}"
    return f"{name} not distinguishable from {reference}: {figures}"
