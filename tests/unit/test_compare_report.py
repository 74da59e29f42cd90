"""``evaluator.compare_report``: the success rate's interval and the table's columns."""

from __future__ import annotations

import pytest

from evaluator.compare_report import markdown, row, run_label, server_per_step, wilson_interval


def test_wilson_interval_matches_the_textbook_values():
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)
    assert wilson_interval(1, 20) == pytest.approx((0.0089, 0.2361), abs=1e-4)
    assert wilson_interval(10, 20) == pytest.approx((0.2993, 0.7007), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_a_row_shows_its_wins_interval_and_mean_score():
    report = {
        "adapter_version": 12,
        "games": 20,
        "success_rate": 0.15,
        "mean_score": 15.0,
        "delta_f1": 0.65,
        "delta_f1_transitions": 900,
        "mean_steps": 47.0,
        "revision_rate": 0.08,
        "invalid_action_rate": 0.2,
        "loop_rate": 0.06,
        "parse_problem_rate": 0.25,
        "wall_s": 1800.0,
        "cycle_projected_steps": 340,
    }
    r = row("CoMap (r27-comap)", "run", "comap", report)
    assert r["wins"] == 3 and r["mean_score"] == 15.0
    assert r["wall_s_per_step"] == pytest.approx(1800 / (20 * 47 - 340))  # the projected steps cost nothing
    table = markdown([r], "valid_seen", 20)
    assert "| CoMap (r27-comap) | v12 | 0.150 | 3/20 (0.05-0.36) | 15.0 | 0.650 | 47.0 |" in table
    assert table.rstrip().splitlines()[4].endswith("| 0.060 | 0.250 | 3.0 |")
    older = {k: v for k, v in report.items() if k != "parse_problem_rate"}  # a cell measured before the count
    assert (
        markdown([row("x", "run", "comap", older)], "valid_seen", 20).splitlines()[4].endswith("| 0.060 | n/a | 3.0 |")
    )
    assert row("x", "method", "react", {**report, "wall_s": 0.0})["wall_s_per_step"] is None


def test_a_rows_unreadable_answers_are_counted_over_its_steps():
    """A row whose answers the parser could not read ran the fallback action: the report says how often,
    so such a row is not read as the method acting (a cell recorded before the count says n/a)."""
    from evaluator.eval_report import summarize_records

    def episode(steps, parse_problems=None):
        rec = {"game": "g", "won": False, "steps": steps, "score": 0.0, "revisions": 0, "invalid": 0}
        rec |= {"loops": 0, "guarded": 0, "delta_f1": []}
        return rec if parse_problems is None else {**rec, "parse_problems": parse_problems}

    report = summarize_records([episode(50, 50), episode(30, 10)], "valid_seen", 19, 1.0)
    assert report["parse_problem_rate"] == pytest.approx(60 / 80)
    assert summarize_records([episode(50, 50), episode(30)], "valid_seen", 19, 1.0)["parse_problem_rate"] is None


def _report(scores: dict[str, float]) -> dict:
    n = len(scores)
    return {
        "adapter_version": 3,
        "games": n,
        "success_rate": sum(s >= 100 for s in scores.values()) / n,
        "mean_score": sum(scores.values()) / n,
        "delta_f1": None,
        "delta_f1_transitions": 0,
        "mean_steps": 30.0,
        "revision_rate": 0.0,
        "invalid_action_rate": 0.0,
        "episodes": [{"game": g, "score": s, "won": s >= 100} for g, s in scores.items()],
    }


def test_rows_are_paired_game_by_game_with_the_methods_own_run():
    from evaluator.compare_report import paired_difference

    games = [f"g{i}" for i in range(10)]
    comap = row("CoMap (r-comap)", "run", "comap", _report(dict(zip(games, [10.0] * 10))), run="r", ablation=[])
    better = row("ablation x (r-x)", "run", "comap", _report(dict(zip(games, [30.0] * 10))), run="r-x", ablation=["x"])
    mixed = row("Draft only", "method", "draft_only", _report(dict(zip(games, [0.0, 20.0] * 5))))
    assert comap["game_scores"]["g3"] == 10.0
    assert paired_difference(comap["game_scores"], better["game_scores"]) == (20.0, 20.0, 20.0, 10)
    d, low, high, n = paired_difference(comap["game_scores"], mixed["game_scores"])
    assert d == 0.0 and low < 0 < high and n == 10  # half the games 10 points worse, half 10 better
    assert paired_difference(comap["game_scores"], {"other": 5.0}) is None
    table = markdown([mixed, comap, better], "dev", 10)
    assert "Paired with CoMap (r-comap) game by game" in table
    assert "- ablation x (r-x): +20.0 (+20.0 to +20.0) over 10 games" in table
    assert "- Draft only: +0.0 (" in table and "- CoMap (r-comap): " not in table


def test_the_table_says_which_rows_won_each_game():
    comap = row("CoMap (r)", "run", "comap", _report({"a": 100.0, "b": 0.0}), run="r", ablation=[])
    draft = row("Draft only", "method", "draft_only", _report({"a": 100.0, "b": 100.0}))
    table = markdown([comap, draft], "valid_seen", 2)
    assert "Games won (2 of 2), by which rows:" in table
    assert "- `a`: CoMap (r); Draft only" in table and "- `b`: Draft only" in table
    nothing = markdown([row("CoMap (r)", "run", "comap", _report({"a": 40.0}), run="r", ablation=[])], "dev", 1)
    assert "Games won" not in nothing


def test_a_scored_environments_chart_shows_the_mean_score(tmp_path):
    from evaluator.compare_report import bar_chart, chart_panels

    rows = [row("CoMap (r)", "run", "comap", _report({"a": 40.0, "b": 10.0}), run="r", ablation=[])]
    assert chart_panels(rows, scored=True) == [("mean score / 100", [0.25]), ("world-model Delta-F1", [None])]
    assert chart_panels(rows, scored=False)[0] == ("success rate", [0.0])
    assert bar_chart(rows, tmp_path / "c.png", "dev, 2 games", scored=True).stat().st_size > 1000
    from comap_async.envs.registry import env_spec

    assert env_spec("scienceworld").scored and not env_spec("alfworld").scored  # what comap compare charts


def test_the_action_gates_reasons_are_summed_over_a_rows_episodes():
    """A CoMap row with no revisions says why the gate stayed shut; a row without reflections (or with
    an episode recorded before the reasons were) has none."""
    from evaluator.compare_report import markdown, row
    from evaluator.eval_report import summarize_records

    def episode(reasons=None):
        rec = {"game": "g", "won": False, "steps": 3, "score": 0.0, "revisions": 0, "invalid": 0}
        rec |= {"loops": 0, "guarded": 0, "delta_f1": [], "parse_problems": 0}
        return rec if reasons is None else {**rec, "gate_reasons": reasons}

    report = summarize_records(
        [episode({"keep": 2, "same_action": 1}), episode({"low_confidence": 1, "keep": 2})], "valid_seen", 4, 1.0
    )
    assert report["gate_reasons"] == {"keep": 4, "low_confidence": 1, "same_action": 1}
    assert list(report["gate_reasons"]) == ["keep", "low_confidence", "same_action"]  # most frequent first
    assert summarize_records([episode({"keep": 3}), episode()], "valid_seen", 4, 1.0)["gate_reasons"] is None
    text = markdown([row("CoMap (r)", "run", "comap", report)], "valid_seen", 2)
    assert "- CoMap (r): keep 4, low_confidence 1, same_action 1" in text
    drafts = row("Draft only", "method", "draft_only", {**report, "gate_reasons": None})
    assert "steps by reason" not in markdown([drafts], "valid_seen", 2)


def test_played_revisions_are_counted_by_the_verb_they_replaced():
    """A CoMap row says what its revisions replaced (``move -> go`` is where a won game is lost); rows
    without revisions say nothing."""
    from evaluator.compare_report import markdown, row
    from evaluator.eval_report import markdown as eval_markdown
    from evaluator.eval_report import summarize_records

    def episode(revised=()):
        rec = {"game": "g", "won": False, "steps": 3, "score": 0.0, "revisions": len(revised), "invalid": 0}
        rec |= {"loops": 0, "guarded": 0, "delta_f1": [], "parse_problems": 0, "gate_reasons": {"keep": 3}}
        return {**rec, "revisions_played": [list(r) for r in revised]} if revised else rec

    report = summarize_records(
        [
            episode([(1, "go to desk 1", "go to bed 1"), (2, "move pen 1 to desk 1", "go to bed 1")]),
            episode([(4, "go to shelf 1", "Take pen 1 from shelf 1"), (5, "go to desk 2", "go to desk 1")]),
            episode(),
        ],
        "valid_seen",
        4,
        1.0,
    )
    assert report["revision_verbs"] == {"go -> go": 2, "move -> go": 1, "go -> take": 1}
    assert "Revisions played (draft -> revision): go -> go 2, move -> go 1, go -> take 1" in eval_markdown(report)
    text = markdown([row("CoMap", "run", "comap", report)], "valid_seen", 2)
    assert "- CoMap: keep 9; revisions played (draft -> revision): go -> go 2, move -> go 1, go -> take 1" in text
    assert summarize_records([episode()], "valid_seen", 4, 1.0)["revision_verbs"] is None


def test_the_servers_time_is_split_per_played_step():
    before = {
        "prompt_tokens": 1000.0,
        "prefix_cache_hit_tokens": 200.0,
        "generation_tokens": 50.0,
        "prefill_seconds": 1.0,
        "decode_seconds": 2.0,
        "decode_steps": 10.0,
        "decode_rows": 40.0,
    }
    after = {
        "prompt_tokens": 5000.0,
        "prefix_cache_hit_tokens": 2200.0,
        "generation_tokens": 450.0,
        "prefill_seconds": 9.0,
        "decode_seconds": 6.0,
        "decode_steps": 110.0,
        "decode_rows": 640.0,
    }
    s = server_per_step(before, after, 4)
    assert s == {
        "steps": 4,
        "prompt_tokens": 1000.0,
        "cached_share": 0.5,
        "generated_tokens": 100.0,
        "prefill_s": 2.0,
        "decode_s": 1.0,
        "mean_batch": 6.0,
    }
    # a server that does not count them (vLLM), or a row that played nothing, says nothing
    assert server_per_step({}, {}, 4) is None and server_per_step(before, after, 0) is None
    assert server_per_step(before, {"prompt_tokens": 1.0}, 4) is None
    r = row(
        "CoMap (r)",
        "run",
        "comap",
        {
            "adapter_version": 3,
            "games": 1,
            "success_rate": 0.0,
            "delta_f1": None,
            "delta_f1_transitions": 0,
            "mean_steps": 4.0,
            "revision_rate": 0.0,
            "invalid_action_rate": 0.0,
            "server_per_step": s,
        },
    )
    assert "1000 prompt tokens (50% from the prefix cache), 100 generated; prefill 2.00 s" in markdown([r], "x", 1)


def test_the_charts_row_labels_fit_in_the_figure():
    import matplotlib.pyplot as plt

    from evaluator.compare_report import bar_figure, chart_label

    switches = ["handcoded_demos", "admissible_choice", "reflect_confidence", "draft_turns"]
    label = run_label([], "r41-comap-learner-policy_wm_aux-0-2-learner-phases-coevolve-lr-0-0001-again", switches)
    rows = [row(label, "run", "comap", _report({"a": 100.0, "b": 0.0}), run="r", ablation=[])] * 6
    rows.append(row("Draft only", "method", "draft_only", _report({"a": 100.0, "b": 100.0})))
    fig = bar_figure(rows, "valid_seen, 2 games")
    fig.canvas.draw()
    for tick in fig.axes[0].get_yticklabels():  # a label cut at the figure's left edge starts left of 0
        box = tick.get_window_extent()
        assert box.x0 >= 0 and box.y0 >= 0 and box.y1 <= fig.bbox.height, tick.get_text()
    plt.close(fig)
    assert chart_label(label).replace("\n", " ") == label  # wrapped, nothing dropped
