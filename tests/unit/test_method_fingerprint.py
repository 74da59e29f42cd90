"""The method fingerprint: what it covers, and the one line a mismatch gives."""

from __future__ import annotations

import pytest

from comap_async.config import load_config
from comap_async.errors import CommandError
from comap_async.method.fingerprint import MethodMismatch, check_method, fingerprint


def test_the_fingerprint_covers_the_gates_the_ablations_the_env_and_the_related_methods():
    base = fingerprint(load_config(None))
    assert base == fingerprint(load_config(None, ["learner.lr=0.5", "actor.envs=9"]))  # not the method's settings
    others = [
        ["method.tau_p=0.7"],
        ["method.tau_ws=0.8"],
        ["method.ablation=frozen_wm"],
        ["method.ablation=no_ws_gate_real"],
        ["env.name=scienceworld"],
        ["actor.imagined_rollouts=2"],
    ]
    prints = [fingerprint(load_config(None, o)) for o in others]
    assert base not in prints and len(set(prints)) == len(prints)


def test_the_same_ablations_keep_the_fingerprint_they_had_as_ten_switches():
    """Pinned before the ablations became one list (then ``ablation.frozen_wm=true`` ...): a process of a run
    started before the change still agrees with one started after it on the same ablations."""
    assert fingerprint(load_config(None)) == "b68abcb86773"
    assert fingerprint(load_config(None, ["method.ablation=frozen_wm"])) == "af90b53437ff"
    assert fingerprint(load_config(None, ["method.ablation=[no_action_gate, frozen_wm]"])) == "e1d4af49ae12"
    assert fingerprint(load_config(None, ["method.ablation=[no_ws_gate_imagined, no_future_state]"])) == "45869a96d302"
    assert fingerprint(load_config(None, ["method.ablation=no_ws_gate_real"])) == "2a7ce2f508ee"


def test_a_mismatch_is_one_line_naming_both_sides_and_an_unsaid_one_passes():
    cfg = load_config(None, ["method.ablation=frozen_wm"])
    check_method(cfg, fingerprint(cfg), "the broker")
    check_method(cfg, "", "the broker")  # a peer that does not say (an older broker)
    with pytest.raises(MethodMismatch) as err:
        check_method(cfg, fingerprint(load_config(None)), "the broker")
    text = str(err.value)
    assert isinstance(err.value, CommandError) and "\n" not in text
    assert f"the broker runs method {fingerprint(load_config(None))}" in text and "ablation frozen_wm" in text
