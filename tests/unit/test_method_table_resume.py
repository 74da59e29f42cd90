"""``benchmarks/method_table.py --resume``: which forks are kept, forked again or forked anew."""

from __future__ import annotations

import pytest

from benchmarks.method_table import plan_forks, variant_overrides


def test_a_trained_fork_is_kept_and_one_cut_short_is_forked_again():
    done = {"r27-comap": {"name": "r27-comap", "wall_s": 1800}, "r27-frozen_wm": {"name": "r27-frozen_wm"}}
    plan = plan_forks(["comap", "frozen_wm", "no_action_gate", "comap"], "r27", done)
    assert plan == [
        ("r27-comap", "comap", "keep"),
        ("r27-frozen_wm", "frozen_wm", "refork"),
        ("r27-no_action_gate", "no_action_gate", "fork"),
        ("r27-comap-again", "comap", "fork"),
    ]


def test_a_variant_is_its_ablations_and_settings():
    assert variant_overrides("comap") == []
    assert variant_overrides("frozen_wm+learner.policy_wm_aux=0.2") == [
        "ablation.frozen_wm=true",
        "learner.policy_wm_aux=0.2",
    ]
    with pytest.raises(SystemExit, match="unknown ablation frozen"):
        variant_overrides("frozen")
