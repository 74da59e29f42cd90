"""`comap stats` text: the learner's latest scalars, in a fixed order, or a line saying why none."""

from __future__ import annotations

from comap_async.commands.stats import eval_points, render, summarize


def _stats(learner: dict) -> dict:
    return {
        "registry": {"phase": "coevolve", "versions": {"policy": 2}, "step": 40},
        "stores": {"transitions": {"count": 3, "capacity": 10, "evicted": 0}},
        "ingest": {"rate_per_s": 1.5},
        "gates": {},
        "stale_skipped": {},
        "learner": learner,
    }


def test_learner_scalars_are_shown_in_order():
    text = render(summarize(_stats({"policy/bce": 0.25, "wm/change_nll": 2.5, "wm/ce": 1.0, "other": 7}), [], []))
    line = next(x for x in text.splitlines() if x.startswith("learner "))
    assert line.split()[1:] == ["wm/ce=1.000", "wm/change_nll=2.500", "policy/bce=0.250"]


def test_no_publish_yet_says_so():
    text = render(summarize(_stats({}), [], []))
    assert "learner    (no publish yet" in text


def test_reflect_init_label_distribution_is_shown():
    stats = {
        **_stats({"policy/revise_label_share": 0.4}),
        "reflect_init_labels": {"expert_better": 6, "equal_draft": 3, "not_better": 1},
    }
    text = render(summarize(stats, [], []))
    line = next(x for x in text.splitlines() if x.startswith("reflect_init "))
    assert (
        "y=1 6" in line and "equal drafts 3" in line and "ties or worse 1" in line and "share y=1 0.600 of 10" in line
    )
    assert "policy/revise_label_share=0.400" in text
    assert "no reflection-initialisation samples yet" in render(summarize(_stats({}), [], []))


def test_eval_points_are_in_version_order_whatever_the_input_order():
    # learning_curve.py once read eval/v*.json in name order: v0, v1, v10, v2 drew a zigzag
    results = [
        {"version": 0, "ts": 100.0, "wm_delta_f1": 0.0},
        {"version": 1, "ts": 400.0, "wm_delta_f1": 0.2},
        {"version": 10, "ts": 1900.0, "wm_delta_f1": 0.7},
        {"version": 2, "ts": 700.0, "wm_delta_f1": 0.4},
        {"version": 3, "ts": 1000.0},
    ]
    assert eval_points(results, "wm_delta_f1") == [(0, 0.0, 0.0), (1, 5.0, 0.2), (2, 10.0, 0.4), (10, 30.0, 0.7)]


def test_the_action_gates_reasons_are_counted_per_version():
    from comap_async.commands.stats import gates_by_version

    refl = [
        {"source": "gate", "policy_version": 20, "y": 1, "ag_reason": "revised", "ws_imagined": True},
        {"source": "gate", "policy_version": 20, "y": 0, "ag_reason": "keep", "ws_imagined": False},
        {"source": "gate", "policy_version": 20, "y": 0, "ag_reason": "keep", "ws_imagined": False},
        {"source": "gate", "policy_version": 21, "y": 0, "ag_reason": "same_action", "ws_imagined": False},
        {"source": "suffix", "policy_version": 4, "y": 1, "label": "expert_better"},  # not the gate's
    ]
    rows = gates_by_version(refl)
    assert [(g["version"], g["samples"], g["reasons"]) for g in rows] == [
        (20, 3, {"keep": 2, "revised": 1}),
        (21, 1, {"same_action": 1}),
    ]
    text = render(summarize({**_stats({}), "gates": {}}, [], refl))
    assert "keep=2 revised=1" in next(x for x in text.splitlines() if x.strip().startswith("20 "))
