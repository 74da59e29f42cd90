"""Evaluation methods: each method, played on 2 real valid_seen games with
the tiny model on a real embedded server, makes exactly the model calls it should, read from the
calls the inference client recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.alfworld import play_valid_seen

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 4


@pytest.fixture(autouse=True)
def short_react_thoughts(monkeypatch):
    """The tiny random model writes ReAct's whole token budget every step, and ReAct's turns keep their
    thoughts: 4 steps of 96-token thoughts pass the test server's 2048-token prompt limit."""
    monkeypatch.setattr("actors.eval_methods.REACT_MAX_TOKENS", 32)


def play(method: str, roomy_server, alfworld_data, tiny_model_dir, tmp_path, *extra: str):
    return play_valid_seen(method, roomy_server, alfworld_data, tiny_model_dir, tmp_path, MAX_STEPS, *extra)


def _step_calls(calls: list[dict]) -> list[list[dict]]:
    """The recorded calls cut into steps, each starting with a draft (one episode at a time)."""
    steps: list[list[dict]] = []
    for c in calls:
        if c["kind"] == "draft" or not steps:
            steps.append([])
        steps[-1].append(c)
    return steps


def steps_of(calls: list[dict], first: str) -> list[list[str]]:
    """The recorded call kinds cut into steps, each starting with a ``first`` call (one episode at a time)."""
    steps: list[list[str]] = []
    for c in calls:
        if c["kind"] == first or not steps:
            steps.append([])
        steps[-1].append(c["kind"])
    return steps


def test_react_acts_from_the_state_alone(recorded_calls, roomy_server, alfworld_data, tiny_model_dir, tmp_path):
    stats = play("react", roomy_server, alfworld_data, tiny_model_dir, tmp_path)
    n = sum(s.steps for s in stats)
    assert n >= 2 and [c["kind"] for c in recorded_calls] == ["react"] * n  # no world model, no reflection
    assert all(c["logprobs"] is None for c in recorded_calls)
    assert all(s.revisions == 0 and not s.delta_f1 for s in stats)


def test_draft_only_executes_the_draft(recorded_calls, roomy_server, alfworld_data, tiny_model_dir, tmp_path):
    stats = play("draft_only", roomy_server, alfworld_data, tiny_model_dir, tmp_path)
    n = sum(s.steps for s in stats)
    assert n >= 2 and [c["kind"] for c in recorded_calls] == ["draft"] * n
    assert all(s.revisions == 0 for s in stats)


def test_imagine_and_act_makes_no_action_gate_decision(
    recorded_calls, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    stats = play("imagine_and_act", roomy_server, alfworld_data, tiny_model_dir, tmp_path)
    n = sum(s.steps for s in stats)
    # per step: the draft, its imagined consequence, the chosen final action; no Decision prompt and no
    # logprobs (the action gate's inputs), no teacher
    assert steps_of(recorded_calls, "draft") == [["draft", "imagine", "choose"]] * n
    assert all(c["logprobs"] is None for c in recorded_calls)
    assert sum(s.revisions for s in stats) <= n


def test_comap_drafts_imagines_reflects_and_gates(
    recorded_calls, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    stats = play("comap", roomy_server, alfworld_data, tiny_model_dir, tmp_path)
    n = sum(s.steps for s in stats)
    steps = steps_of(recorded_calls, "draft")
    assert len(steps) == n
    revised = 0
    for step in steps:  # the reflection is read decision first: at or under tau_p a KEEP with nothing more
        # generated; above it the whole reflection, its executed action imagined again only when the gate
        # revised the draft, and a reflection without a Final Action line continued for its action
        assert step[:3] == ["draft", "imagine", "reflect"], step
        assert step[3:] == [] or (
            step[3] == "reflect" and step[4:] in ([], ["imagine"], ["continue"], ["continue", "imagine"])
        ), step
        revised += step[-1] == "imagine" and len(step) > 4
    assert revised == sum(s.revisions for s in stats)
    reflections = [c for c in recorded_calls if c["kind"] == "reflect"]
    assert all(c["logprobs"] for c in reflections)  # p_revise from the decision token
    decisions = [step_calls[2] for step_calls in _step_calls(recorded_calls)]
    assert len(decisions) == n and all(c["max_tokens"] == 1 for c in decisions)  # the decision alone first


def test_evaluation_decodes_at_the_eval_temperature(
    recorded_calls, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    play("comap", roomy_server, alfworld_data, tiny_model_dir, tmp_path)  # greedy unless set
    assert recorded_calls and {c["temperature"] for c in recorded_calls} == {0.0}
    recorded_calls.clear()
    play(
        "comap", roomy_server, alfworld_data, tiny_model_dir, tmp_path, "eval.temperature=0.7", "actor.temperature=0.2"
    )  # the actor's own setting is for training rollouts
    assert {c["temperature"] for c in recorded_calls if c["kind"] != "teacher"} == {0.7}


def test_eval_cli_records_the_method(tmp_path, alfworld_data, model_cache):
    out = tmp_path / "out"
    base = [
        sys.executable,
        "-m",
        "comap_async",
        "eval",
        "--config",
        "configs/test.yaml",
        "--split",
        "valid_seen",
        "--data",
        str(alfworld_data),
        "--set",
        f"model.cache_dir={model_cache}",
        "--set",
        f"run.root={tmp_path / 'runs'}",
        "--set",
        "env.max_steps=2",
    ]
    r = subprocess.run(
        base + ["--games", "1", "--method", "react", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["method"] == "react" and report["games"] == 1
    assert "method react" in (out / "eval.md").read_text()
    bad = subprocess.run(
        base + ["--games", "1", "--method", "react", "--probes", "--out", str(tmp_path / "o2"), "--serve", "never"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "do not apply to --method react" in bad.stderr and "Traceback" not in bad.stderr


def test_admissible_choice_executes_only_admissible_actions(
    recorded_calls, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    """``actor.admissible_choice``: every draft is decoded as one of the state's admissible commands
    (the tiny random model's free drafts are not), and a reflection's final action that is not
    admissible is generated again from ``Final Action:`` as one of them."""
    free = play("draft_only", roomy_server, alfworld_data, tiny_model_dir, tmp_path)
    assert sum(s.invalid for s in free) > 0 and all(c["choices"] is None for c in recorded_calls)
    recorded_calls.clear()
    # an evaluation reads a reflection's decision first and stops at a KEEP under tau_p (the tiny model's p is
    # mostly 0: its decision tokens are not among its likeliest); without the action gate every reflection is
    # generated whole, so its final action is read
    for method in ("draft_only", "comap"):
        switches = ("actor.admissible_choice=true", "method.ablation=no_action_gate")
        stats = play(method, roomy_server, alfworld_data, tiny_model_dir, tmp_path, *switches)
        assert sum(s.steps for s in stats) >= 2 and sum(s.invalid for s in stats) == 0, method
    drafts = [c for c in recorded_calls if c["kind"] == "draft"]
    assert drafts and all(c["choices"] and c["text"] in c["choices"] for c in drafts)
    assert all(c["choices"] is None for c in recorded_calls if c["kind"] in ("reflect", "imagine"))
    continued = [c for c in recorded_calls if c["kind"] == "continue"]
    assert continued and all(c["text"] in c["choices"] and c["text"].startswith(" ") for c in continued)


def test_admissible_choice_decodes_every_methods_action_among_the_admissible_commands(
    recorded_calls, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    """``actor.admissible_choice`` holds for every arm, not only the draft: ReAct's thought is written
    freely and its action decoded as one of the state's commands, Imagine-and-Act's final action too.
    The tiny random model's free ReAct answer has no action line: each step executes the fallback command
    (a parse problem) from one free call, so an executed action that is admissible only counts when no
    step fell back."""
    free = play("react", roomy_server, alfworld_data, tiny_model_dir, tmp_path)
    assert sum(s.parse_problems for s in free) > 0 and all(c["choices"] is None for c in recorded_calls)
    recorded_calls.clear()
    stats = play("react", roomy_server, alfworld_data, tiny_model_dir, tmp_path, "actor.admissible_choice=true")
    n = sum(s.steps for s in stats)
    assert n >= 2 and sum(s.invalid for s in stats) == 0 and sum(s.parse_problems for s in stats) == 0
    # per step: the free thought, then the action among the commands, continuing the thought's prompt
    assert steps_of(recorded_calls, "react") == [["react", "react_action"]] * n
    thoughts = [c for c in recorded_calls if c["kind"] == "react"]
    actions = [c for c in recorded_calls if c["kind"] == "react_action"]
    assert all(c["choices"] is None for c in thoughts)
    assert all(c["choices"] and c["text"] in c["choices"] and c["text"].startswith(" ") for c in actions)
    recorded_calls.clear()
    stats = play(
        "imagine_and_act", roomy_server, alfworld_data, tiny_model_dir, tmp_path, "actor.admissible_choice=true"
    )
    assert sum(s.steps for s in stats) >= 2 and sum(s.invalid for s in stats) == 0
    chosen = [c for c in recorded_calls if c["kind"] in ("draft", "choose")]
    assert chosen and all(c["choices"] and c["text"] in c["choices"] for c in chosen)


ROLE_OF_KIND = {
    "draft": "draft",
    "imagine": "world_model",
    "reflect": "reflection",
    "continue": "reflection",
    "choose": "imagine_and_act",
    "react": "react",
    "react_action": "react",
}
ACTION_KINDS = {"draft", "continue", "choose", "react_action"}  # the requests that generate an action


def test_what_roles_read_matches_the_prompts_of_real_games(
    recorded_calls, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    """:func:`evaluator.roles_read.what_roles_read` against every request of real games in the turns form with
    decoding among the commands: a role's prompt lists the admissible commands exactly when it says so, and
    its action requests are constrained to them exactly when it says so."""
    from evaluator.roles_read import what_roles_read
    from tests.fixtures.alfworld import valid_seen_config

    switches = ("env.prompt_form=draft_turns", "actor.admissible_choice=true")
    cfg = valid_seen_config(roomy_server, alfworld_data, tiny_model_dir, tmp_path, *switches)
    for method in ("comap", "react", "imagine_and_act"):
        recorded_calls.clear()
        play(method, roomy_server, alfworld_data, tiny_model_dir, tmp_path, *switches)
        read = what_roles_read(cfg, method)
        assert {ROLE_OF_KIND[c["kind"]] for c in recorded_calls} == set(read), method
        for c in recorded_calls:
            role = read[ROLE_OF_KIND[c["kind"]]]
            assert ("Admissible commands:" in c["prompt"]) == role["admissible"], (method, c["kind"])
            if c["kind"] in ACTION_KINDS:
                assert (c["choices"] is not None) == role["decoded_among_admissible"], (method, c["kind"])
