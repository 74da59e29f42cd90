"""``experiments/studies/learner_setting.py --same-actions``: the replay's walkthrough paths, and the same
demonstrated actions in the window form (each step's warm-up transition), read from a real LMDB
replay; a path whose step has no transition, or too few actions, is refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.studies.learner_setting import variant_settings, walkthrough_paths, window_demos  # noqa: E402
from tests.fixtures.broker import write_records  # noqa: E402


def path(episode: str, actions: list[str], **extra) -> dict:
    return {
        "id": episode, "episode": episode, "game": "g", "goal": "put a pen on the desk", "first": "You are in a room.",
        "turns": [[a, f"after {a}"] for a in actions], "targets": [True] * len(actions), **extra,
    }  # fmt: skip


def step(episode: str, t: int, action: str, **extra) -> dict:
    return {
        "id": f"{episode}:{t}", "episode": episode, "t": t, "phase": "warmup", "game": "g",
        "goal": "put a pen on the desk", "s": f"{episode} state {t}", "a_exec": action, **extra,
    }  # fmt: skip


def write(replay: Path, demos: list[dict], transitions: list[dict]) -> None:
    records = [("demos", f"d:{d['id']}".encode(), d) for d in demos]
    write_records(replay, records + [("transitions", f"t:{i}".encode(), t) for i, t in enumerate(transitions)])


def test_window_form_trains_exactly_the_paths_actions(tmp_path):
    a = path("e1", ["go to desk 1", "take pen 1 from desk 1"])
    b = path("e2", ["look", "go to shelf 1", "put pen 1 in/on shelf 1"])
    recovery = path("e1:1:r", ["go to desk 1", "look", "take pen 1 from desk 1"], recovery=True)
    recovery["episode"] = "e1"
    transitions = [step("e1", 0, "go to desk 1"), step("e1", 1, "take pen 1 from desk 1")]
    transitions += [step("e1", 1, "look", explore=True, id="e1:1:x"), step("e1", 1, "inventory", recovery=True)]
    transitions += [step("e2", t, action) for t, (action, _) in enumerate(b["turns"])]
    write(tmp_path, [a, b, recovery], transitions)

    paths = walkthrough_paths(tmp_path, 5, seed=0)
    assert sorted(p["id"] for p in paths) == ["e1", "e2"]  # the recovery branch is no walkthrough
    demos = window_demos(tmp_path, paths, seed=0)
    assert sorted((d["s"], d["target"]) for d in demos) == [
        ("e1 state 0", "go to desk 1"),
        ("e1 state 1", "take pen 1 from desk 1"),  # not the explore or recovery transition of the same t
        ("e2 state 0", "look"),
        ("e2 state 1", "go to shelf 1"),
        ("e2 state 2", "put pen 1 in/on shelf 1"),
    ]
    assert len(walkthrough_paths(tmp_path, 1, seed=0)) == 1  # taken until the actions reach --samples

    with pytest.raises(SystemExit, match="5 demonstrated actions, fewer than --samples 6"):
        walkthrough_paths(tmp_path, 6, seed=0)


def test_a_path_step_without_its_transition_is_refused(tmp_path):
    write(tmp_path, [path("e1", ["go to desk 1", "open drawer 1"])], [step("e1", 0, "go to desk 1")])
    with pytest.raises(SystemExit, match="episode e1's step 1 \\('open drawer 1'\\) has no warm-up transition"):
        window_demos(tmp_path, walkthrough_paths(tmp_path, 2, seed=0), seed=0)


def test_variant_settings_name_learner_keys_unless_env():
    assert variant_settings("env.prompt_form=window+demo_loss_share={}") == [
        "env.prompt_form=window",
        "learner.demo_loss_share={}",
    ]
