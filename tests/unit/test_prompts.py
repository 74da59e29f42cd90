"""Prompt rendering and tolerant parsing."""

from __future__ import annotations

import pytest

from comap_async import prompts
from comap_async.prompts import (
    ChatTemplate,
    Prompts,
    parse_action,
    parse_reflection,
    render_state,
)


def test_render_state_keeps_last_k_and_admissible():
    hist = [
        ("go to desk 1", "You arrive at desk 1."),
        ("open drawer 1", "You open the drawer 1."),
        ("look", "You are facing the drawer 1."),
    ]
    s = render_state("put a pen in drawer.", hist, "Nothing happens.", ["look", "inventory"], k=2)
    assert "go to desk 1" not in s and "open drawer 1" in s and "look" in s
    assert s.startswith("Task: put a pen in drawer.") and "Admissible commands: look, inventory" in s
    assert "Admissible" not in render_state("t", hist, "o", ["look"], k=0, show_admissible=False)
    assert "Recent history" not in render_state("t", hist, "o", k=0)


def test_the_location_is_shown_after_the_history_unless_the_window_already_shows_it():
    room = "This room is called the hallway. In it, you see: a painting"
    hist = [("look around", room), ("open door to kitchen", "The door is already open.")]
    s = render_state("find a plant", hist[1:], "The door is already open.", k=2, location=room)
    assert s.index("Recent history:") < s.index("Where you are: " + room) < s.index("Current observation:")
    assert "Where you are" not in render_state("find a plant", hist[1:], "o", k=2)  # none given: none shown
    assert "Where you are" not in render_state("find a plant", hist, "o", k=2, location=room)  # in the window
    assert "Where you are" not in render_state("find a plant", [], room, k=2, location=room)  # the observation


def test_a_whole_history_state_extends_the_previous_steps_up_to_its_current_observation():
    """With a window as long as the episode (``env.history_k`` >= steps), step t+1's state starts with
    step t's up to ``Current observation``: the prefix cache serves that part of each prompt
    (``benchmarks/coevolve_throughput.py``, ``fast_history``). With the 3-pair window it stops once
    the window slides."""
    hist = [(f"go to desk {i}", f"You arrive at desk {i}.") for i in range(1, 8)]
    for k in (50, 3):
        for t in range(2, len(hist)):
            before = render_state("put a pen in drawer.", hist[:t], hist[t - 1][1], ["look"], k=k)
            after = render_state("put a pen in drawer.", hist[: t + 1], hist[t][1], ["inventory"], k=k)
            head = before[: before.index("Current observation:")]
            assert after.startswith(head) is (t + 1 <= k), (k, t)


@pytest.mark.parametrize(
    "text, value",
    [
        ("go to fridge 1", "go to fridge 1"),
        ("> go to fridge 1.\nmore text", "go to fridge 1"),
        ("Action: open drawer 2", "open drawer 2"),
        ("\n\n  'take pen 1 from desk 1'  ", "take pen 1 from desk 1"),
        ("", None),
        ("   \n  ", None),
        ("<one command>", None),  # the reflection prompt's placeholder, copied (seen in a honcho run)
        (" <one command>\n", None),
    ],
)
def test_parse_action(text, value):
    assert parse_action(text).value == value


@pytest.mark.parametrize(
    "completion, decision, action",
    [
        (" REVISE\nFinal Action: open fridge 1", "REVISE", "open fridge 1"),
        (" keep\nfinal action: go to desk 1.", "KEEP", "go to desk 1"),
        ("Decision: KEEP\nFinal Action: look", "KEEP", "look"),
        (" maybe\nFinal Action: look", None, "look"),
        (" REVISE", "REVISE", None),
        (" REVISE\nFinal Action: <one command>", "REVISE", None),
        ("", None, None),
    ],
)
def test_parse_reflection_tolerates_junk(completion, decision, action):
    r = parse_reflection(completion)
    assert (r.decision, r.final_action) == (decision, action)
    assert (r.problem is None) == (decision is not None and action is not None)


def test_chat_template_matches_transformers(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = ChatTemplate.from_model_dir(tiny_model_dir)
    for msgs in (
        prompts.draft_messages("Task: x"),
        prompts.teacher_messages("s", "a", "real"),
        [{"role": "user", "content": "no system message"}],
    ):
        assert chat.render(msgs) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    p = Prompts(chat)
    assert p.reflect("s", "go to desk 1", "You arrive.").endswith("<|im_start|>assistant\nDecision:")
    assert "Hindsight" in p.teacher("s", "a", "You arrive at desk 1.")
    assert "Hindsight" not in p.world_model("s", "a")


def test_missing_chat_template_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate.from_model_dir(tmp_path)


def test_skeleton_rendering_equals_full_render(tiny_model_dir):
    chat = ChatTemplate.from_model_dir(tiny_model_dir)
    for i in range(6):  # past the verification window too
        msgs = prompts.reflect_messages(f"Task: t{i}\n{{{{ not jinja }}}} %s", f"go to desk {i}", "You arrive.")
        assert chat.render(msgs) == chat._full(msgs, True)


def test_template_that_transforms_content_falls_back_to_full_render():
    chat = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim | upper }}{% endfor %}")
    msgs = [{"role": "user", "content": "  hello "}]
    for _ in range(5):
        assert chat.render(msgs) == "<user>HELLO"
    only_if = ChatTemplate(
        "{% for m in messages %}{% if 'x' in m['content'] %}X{% endif %}[{{ m['content'] }}]{% endfor %}"
    )
    assert only_if.render([{"role": "user", "content": "abc"}]) == "[abc]"
    assert only_if.render([{"role": "user", "content": "xyz"}]) == "X[xyz]"  # caught by verification
    for _ in range(5):
        assert only_if.render([{"role": "user", "content": "xy"}]) == "X[xy]"


@pytest.mark.parametrize(
    "completion, value, problem",
    [
        (" The apple is here.\nAction: take apple 1 from countertop 1", "take apple 1 from countertop 1", None),
        (" First look.\nAction: go to desk 1\nAction: open drawer 2", "open drawer 2", None),  # the last action line
        (" I will go to the desk.", None, "no_action"),
    ],
)
def test_parse_react(completion, value, problem):
    from comap_async.prompts import parse_react

    assert parse_react(completion) == prompts.Parsed(value, problem)


def test_baseline_prompts_end_where_generation_starts():
    p = Prompts(ChatTemplate("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"))
    react = p.react("Task: x")
    assert react.endswith("[assistant]" + prompts.THOUGHT_PREFIX) and "Action: <one command>" in react
    choose = p.choose("Task: x", "open drawer 1", "The drawer 1 is open.")
    assert choose.endswith("[assistant]" + prompts.FINAL_PREFIX)
    assert "Candidate action: open drawer 1" in choose and "The drawer 1 is open." in choose
    assert prompts.DECISION_PREFIX not in choose  # no KEEP/REVISE decision: nothing for an action gate to read


def test_environments_share_prompts_and_differ_only_in_the_system_messages():
    from comap_async.config import load_config

    chat = ChatTemplate("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]")
    alf = Prompts.from_config(chat, load_config(None, []))
    sw = Prompts.from_config(chat, load_config(None, ["env.name=scienceworld", "env.split=dev"]))
    # ALFWorld's prompts are what they were before there was a second environment
    assert alf.draft("Task: x") == Prompts(chat).draft("Task: x")
    assert f"[system]{prompts.SYSTEM_AGENT}[user]" in alf.draft("Task: x")
    for role, args in [
        ("draft", ("Task: x",)),
        ("reflect", ("Task: x", "look around", "You see.")),
        ("react", ("Task: x",)),
        ("choose", ("Task: x", "look around", "You see.")),
        ("world_model", ("Task: x", "look around")),
        ("teacher", ("Task: x", "look around", "ok")),
    ]:
        a, s = getattr(alf, role)(*args), getattr(sw, role)(*args)
        system = (
            prompts.wording_for("scienceworld").world
            if role in ("world_model", "teacher")
            else prompts.wording_for("scienceworld").agent
        )
        assert s.startswith(f"[system]{system}[user]") and "household" not in s
        assert a.split("[user]", 1)[1] == s.split("[user]", 1)[1]  # the rest is shared word for word
    with pytest.raises(ValueError, match="unknown environment 'webshop'; known: alfworld, scienceworld"):
        prompts.wording_for("webshop")


def test_the_drafts_confidence_is_shown_as_a_word_only_when_given():
    from comap_async.prompts import confidence_word, reflect_messages

    assert [confidence_word(c) for c in (0.97, 0.9, 0.75, 0.6, 0.59, 0.0)] == [
        "high",
        "high",
        "medium",
        "medium",
        "low",
        "low",
    ]
    plain = reflect_messages("Task: x", "go to desk 1", "You arrive at desk 1.")[1]["content"]
    shown = reflect_messages("Task: x", "go to desk 1", "You arrive at desk 1.", confidence=0.42)[1]["content"]
    assert "confidence" not in plain
    assert shown == plain.replace(
        "Your draft action: go to desk 1\n", "Your draft action: go to desk 1\nYour confidence in the draft: low\n"
    )
