"""``eval.max_share``: how long the evaluator rests after an evaluation, and which version it measures next
(the rules; the process is exercised in tests/integration/test_evaluator.py)."""

from __future__ import annotations

import pytest

from comap_async.config import ConfigError, load_config
from evaluator.evaluator import MAX_PENDING, next_version, rest_after


@pytest.mark.parametrize(("share", "rest"), [(None, 0.0), (1.0, 0.0), (0.5, 120.0), (0.25, 360.0)])
def test_rest_keeps_evaluating_to_its_share_of_the_wall_clock(share, rest):
    assert rest_after(120.0, share) == pytest.approx(rest)
    if share:
        assert 120.0 / (120.0 + rest_after(120.0, share)) == pytest.approx(share)


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.2"])
def test_a_share_outside_0_1_is_refused(bad):
    with pytest.raises(ConfigError, match="eval.max_share"):
        load_config(None, [f"eval.max_share={bad}"])


def test_the_next_version_is_the_oldest_waiting_until_too_many_wait():
    assert next_version(set(), [1, 2]) == 0  # the base model first
    assert next_version({0}, []) is None
    assert next_version({0, 1}, [1, 2, 3]) == 2  # oldest first, each version measured
    waiting = list(range(2, 3 + MAX_PENDING))
    assert next_version({0, 1}, [1, *waiting]) == waiting[-1]  # fallen behind: the newest, the ones between skipped
