"""What each role of an evaluation method reads (evaluator/roles_read.py): today's defaults, the config
fields it follows, and agreement with the real prompt builders rendering a fixed ALFWorld state."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.episodes import Episode, EpisodeContext
from comap_async.config import EVAL_METHODS, load_config
from comap_async.envs.base import StepResult
from comap_async.prompts import ChatTemplate, DecisionTokens, Prompts, turns_of
from evaluator.roles_read import probe_requests, what_roles_read

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "configs" / "local.yaml"
WINDOW_FORM = ["env.prompt_form=window", "learner.demo_loss_share={}"]  # the share needs the turns form

TURNS = {"history": "turns", "k": None}
WINDOW3 = {"history": "window", "k": 3}


def seen(admissible: bool, history: dict, decoded: bool | None) -> dict:
    return {"admissible": admissible, **history, "decoded_among_admissible": decoded}


def test_todays_defaults_what_each_arm_reads():
    """configs/local.yaml (env.prompt_form draft_turns, show_admissible on,
    actor.admissible_choice on): the draft reads the episode's turns without the admissible list yet is
    decoded among it; every other role reads the rendered state, a window of 3 steps with the list."""
    cfg = load_config(LOCAL)
    draft = seen(False, TURNS, True)
    world = seen(True, WINDOW3, None)
    assert what_roles_read(cfg, "draft_only") == {"draft": draft}
    assert what_roles_read(cfg, "comap") == {
        "draft": draft,
        "world_model": world,
        "reflection": seen(True, WINDOW3, True),
    }
    assert what_roles_read(cfg, "react") == {"react": seen(True, WINDOW3, True)}
    assert what_roles_read(cfg, "imagine_and_act") == {
        "draft": draft,
        "world_model": world,
        "imagine_and_act": seen(True, WINDOW3, True),
    }
    assert what_roles_read(cfg, "lookahead") == {"draft": draft, "world_model": world, "critic": world}
    # the oracle bound: the CoMap loop with the true next state in place of the world model's prediction
    assert what_roles_read(cfg, "comap_oracle") == {"draft": draft, "reflection": seen(True, WINDOW3, True)}
    # co-evolution's loop also asks the teacher, which reads what the world model reads
    assert what_roles_read(cfg, "comap", training=True)["teacher"] == world


def test_every_drafting_method_drafts_from_the_same_text():
    """draft_only's draft and the CoMap loop's (and Imagine-and-Act's, the look-ahead's candidates') read
    the identical prompt and are decoded among the identical commands."""
    cfg = load_config(LOCAL)

    def draft(method: str):
        return next(r for r in probe_requests(cfg, method) if r.last and r.role == "draft")

    first = draft("draft_only")
    for method in ("comap", "comap_oracle", "imagine_and_act", "lookahead"):
        assert (draft(method).prompt, draft(method).choices) == (first.prompt, first.choices), method


def test_it_follows_the_config_fields_the_prompts_read():
    window = load_config(LOCAL, WINDOW_FORM)
    assert what_roles_read(window, "draft_only") == {"draft": seen(True, WINDOW3, True)}
    turns = load_config(LOCAL, ["env.prompt_form=all_turns"])
    read = what_roles_read(turns, "comap", training=True)
    assert all(read[r] == seen(False, TURNS, read[r]["decoded_among_admissible"]) for r in read)
    assert what_roles_read(turns, "react") == {"react": seen(True, WINDOW3, True)}  # ReAct renders s_t
    hidden = load_config(LOCAL, ["env.show_admissible=false"])
    for method in EVAL_METHODS:
        assert not any(r["admissible"] for r in what_roles_read(hidden, method).values()), method
    free = load_config(LOCAL, ["actor.admissible_choice=false"])
    for method in EVAL_METHODS:
        assert not any(r["decoded_among_admissible"] for r in what_roles_read(free, method).values()), method
    bare = load_config(LOCAL, [*WINDOW_FORM, "env.history_k=0"])
    assert what_roles_read(bare, "react") == {"react": seen(True, {"history": "none", "k": 0}, True)}
    assert what_roles_read(load_config(LOCAL, [*WINDOW_FORM, "env.history_k=5"]), "react")["react"]["k"] == 5


def test_only_comap_is_played_in_training():
    with pytest.raises(ValueError, match="only comap"):
        what_roles_read(load_config(LOCAL), "react", training=True)


# ---- against the real prompt builders, on one fixed ALFWorld state ----------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FIRST = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a fridge 1 and a sinkbasin 1."
)
PLAYED = [
    ("go to cabinet 1", "You arrive at cabinet 1. The cabinet 1 is closed."),
    ("open cabinet 1", "You open the cabinet 1. The cabinet 1 is open. In it, you see nothing."),
    ("go to fridge 1", "You arrive at fridge 1. The fridge 1 is closed."),
    ("open fridge 1", "You open the fridge 1. The fridge 1 is open. In it, you see an apple 1."),
    ("take apple 1 from fridge 1", "You pick up the apple 1 from the fridge 1."),
]
ADMISSIBLE = ("close fridge 1", "go to cabinet 1", "go to sinkbasin 1", "inventory", "look")


def played_episode(cfg) -> Episode:
    """The fixed state: five steps played, the apple in hand."""
    ctx = EpisodeContext("t", cfg, None, None, lambda facts, o: facts | {o}, lambda: None)

    def result(observation: str) -> StepResult:
        return StepResult(observation, False, False, ADMISSIBLE, None, info={"task": "put a clean apple in fridge."})

    ep = Episode(ctx, SimpleNamespace(name="g"), "e", result(FIRST))
    for action, observation in PLAYED:
        ep.advance(action, result(observation))
    return ep


def rendered(cfg) -> dict[str, str]:
    """Each role's prompt at the fixed state, rendered by the real builders with the state each method hands
    it (actors/eval_methods.py, actors/episodes.py): the draft the draft's view, the others ``s_t``."""
    ep = played_episode(cfg)
    prompts = Prompts.from_config(
        ChatTemplate(CHATML), cfg, DecisionTokens(" KEEP", " REVISE", 0, 1), DecisionTokens(" NO", " YES", 2, 3)
    )
    s, view, a, s_hat = ep.state(), ep.draft_state(), "go to sinkbasin 1", "You arrive at sinkbasin 1."
    return {
        "draft": prompts.draft(view),
        "world_model": prompts.world_model(s, a, turns_of(view)),
        "teacher": prompts.teacher(s, a, s_hat, turns_of(view)),
        "reflection": prompts.reflect(s, a, s_hat, 0.7, turns_of(view)),
        "react": prompts.react(s),
        "imagine_and_act": prompts.choose(s, a, s_hat),
        "critic": prompts.critic(s, [(a, s_hat)]),
    }


@pytest.mark.parametrize(
    "overrides",
    [[], WINDOW_FORM, ["env.prompt_form=all_turns"], ["env.show_admissible=false"]],
    ids=["local", "window", "all-turns", "no-list"],
)
def test_what_a_role_is_said_to_read_is_what_its_real_prompt_shows(overrides):
    cfg = load_config(LOCAL, overrides)
    prompts = rendered(cfg)
    for method in EVAL_METHODS:
        for role, read in what_roles_read(cfg, method, training=method == "comap").items():
            text, where = prompts[role], f"{method}/{role}"
            assert ("Admissible commands: " + ", ".join(ADMISSIBLE) in text) == read["admissible"], where
            shown = sum(f"> {action}\n{observation}" in text for action, observation in PLAYED)
            if read["history"] == "turns":  # every step, the first observation too
                assert FIRST in text and all(action in text for action, _ in PLAYED), where
            else:
                assert FIRST not in text and shown == read["k"] == cfg.env.history_k, where
