"""The statistics an experiment's table prints: Wilson intervals, the exact McNemar test, the paired
bootstrap and the verdict line, against values worked by hand."""

from __future__ import annotations

import re

import pytest

from experiments import stats


def test_wilson_interval_of_7_of_20_is_the_textbook_one():
    low, high = stats.wilson(7, 20)
    assert low == pytest.approx(0.1812, abs=1e-4) and high == pytest.approx(0.5671, abs=1e-4)


def test_wilson_interval_stays_inside_0_and_1_at_the_edges():
    assert stats.wilson(0, 140)[0] == 0.0 and 0.02 < stats.wilson(0, 140)[1] < 0.03
    assert stats.wilson(140, 140)[1] == 1.0 and stats.wilson(140, 140)[0] > 0.97
    assert stats.wilson(0, 0) == (0.0, 1.0)


def test_exact_mcnemar_p_counts_only_discordant_games():
    # the README's old headline: 4 games only the loop won, 2 only the drafts: p = 0.69, not a finding
    assert stats.sign_test_p(4, 2) == pytest.approx(0.6875)
    assert stats.sign_test_p(5, 0) == pytest.approx(0.0625)  # five one way: still not at 5 %
    assert stats.sign_test_p(0, 6) == pytest.approx(0.03125)
    assert stats.sign_test_p(0, 0) == 1.0
    assert stats.sign_test_p(3, 3) == 1.0


def test_paired_bootstrap_centres_on_the_mean_difference_and_is_repeatable():
    a = [1, 1, 0, 1, 0, 0, 1, 1, 0, 1]
    b = [0, 1, 0, 0, 0, 0, 1, 0, 0, 1]
    diff, low, high = stats.paired_bootstrap(a, b, rounds=2000, seed=3)
    assert diff == pytest.approx(0.3)
    assert low <= diff <= high and low >= 0.0 and high <= 0.7
    assert stats.paired_bootstrap(a, b, rounds=2000, seed=3) == (diff, low, high)
    assert stats.paired_bootstrap(a, a, rounds=200) == (0.0, 0.0, 0.0)  # identical rows: no spread
    with pytest.raises(ValueError, match="differ in length"):
        stats.paired_bootstrap(a, b[:-1])


def test_seeds_pair_with_seeds_or_with_a_reference_played_once():
    assert stats.pairs_of([1, 0], [0, 0]) == [(1, 0), (0, 0)]
    assert stats.pairs_of([1, 0], [1]) == [(1, 1), (0, 1)]
    assert stats.discordant([[1, 0], [1, 1]], [[0], [1]]) == (1, 0)
    assert stats.discordant([[1, 0], [0, 0]], [[0, 1], [1]]) == (1, 3)
    with pytest.raises(ValueError, match="cannot be paired"):
        stats.compare("a", [[1, 0, 1]], "b", [[1, 0]])


def test_the_verdict_says_ahead_only_when_interval_and_test_agree():
    won_more = [[1]] * 30 + [[0]] * 10
    ref = [[0]] * 30 + [[0]] * 10
    c = stats.compare("CoMap", won_more, "drafts alone", ref, rounds=2000)
    assert c["only_row"] == 30 and c["only_reference"] == 0 and c["p"] < 1e-6
    assert c["verdict"].startswith("CoMap ahead of drafts alone at 95 %: +0.75")
    behind = stats.compare("drafts alone", ref, "CoMap", won_more, rounds=2000)
    assert behind["verdict"].startswith("drafts alone behind CoMap at 95 %")
    close = stats.compare("x", [[1], [0], [1], [0]], "y", [[0], [1], [1], [0]], rounds=2000)
    assert re.fullmatch(r"x not distinguishable from y: \+0\.00 \[-0\.\d\d, \+0\.\d\d\], p = 1", close["verdict"])
