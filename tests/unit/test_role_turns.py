"""``env.reflect_turns`` and ``env.wm_turns``: the reflection continues the draft's
conversation, so its prompt starts with the draft's, token for token (the server's prefix cache holds
that part); the world model and its teacher see the episode as their own conversation, so a step's prompt
extends the previous step's; the learner trains each in the same form from the conversation the actor
sent with the step."""

from __future__ import annotations

import msgspec
import pytest

from broker.ingest import Ingest
from comap_async.config import CoMapConfig
from comap_async.method.gates import SampleRule
from comap_async.prompts import (
    DECISION_PREFIX,
    ChatTemplate,
    Conversation,
    Prompts,
    reflect_messages,
    teacher_messages,
    world_model_messages,
)
from comap_async.prompts.template import FIT_LEFT_OUT_TURNS
from comap_async.wire.messages import Dialogue, Reflection, Transition
from learner.batches import Encoder
from tests.unit.test_draft_turns import FIRST, TASK, TURNS

STATE = f"Task: {TASK}\nCurrent observation: {TURNS[1][1]}\nAdmissible commands: go to cabinet 1, look"
DRAFT, IMAGINED = "go to cabinet 1", "You arrive at cabinet 1. The cabinet 1 is closed."


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from comap_async.models import load_model_and_tokenizer

    return load_model_and_tokenizer(str(tiny_model_dir))[1]


def turns_prompts(model_dir) -> Prompts:
    chat = ChatTemplate.from_model_dir(model_dir)
    return Prompts(chat, reflect_turns=True, wm_turns=True)


def test_the_reflection_continues_the_drafts_prompt_token_for_token(tiny_model_dir, tok):
    prompts = turns_prompts(tiny_model_dir)
    conversation = Conversation(TASK, FIRST, tuple(TURNS[:2]))
    draft = prompts.draft(conversation)
    reflection = prompts.reflect(STATE, DRAFT, IMAGINED, 0.95, conversation)
    assert reflection.startswith(draft + DRAFT) and reflection.endswith(DECISION_PREFIX)
    ids = tok(reflection, add_special_tokens=False)["input_ids"]
    draft_ids = tok(draft, add_special_tokens=False)["input_ids"]
    assert ids[: len(draft_ids)] == draft_ids  # what the server's prefix cache can serve
    added = reflection[len(draft) :]
    assert IMAGINED in added and "high" in added and "Admissible commands" not in reflection
    assert f"Task: {TASK}" not in added  # named once, in the draft's first turn
    # the imagined state stays out under the ablation no_future_state, as in the window form
    blind = Prompts(ChatTemplate.from_model_dir(tiny_model_dir), reflect_turns=True, future_state=False)
    assert IMAGINED not in blind.reflect(STATE, DRAFT, IMAGINED, 0.95, conversation)


def test_without_the_switch_the_reflection_renders_the_state_whatever_it_is_given(tiny_model_dir):
    chat = ChatTemplate.from_model_dir(tiny_model_dir)
    conversation = Conversation(TASK, FIRST, tuple(TURNS[:2]))
    window = Prompts(chat).reflect(STATE, DRAFT, IMAGINED, 0.5, conversation)
    assert window == chat.render(reflect_messages(STATE, DRAFT, IMAGINED, confidence=0.5)) + DECISION_PREFIX
    with pytest.raises(ValueError, match=r"env.prompt_form all_turns \(reflect_turns\)"):
        turns_prompts(tiny_model_dir).reflect(STATE, DRAFT, IMAGINED)


@pytest.mark.parametrize("switch", ["reflect_turns", "wm_turns"])
def test_each_roles_turns_come_with_all_turns_and_are_played_as_recorded(switch):
    cfg = CoMapConfig.model_validate({"env": {"prompt_form": "all_turns"}})
    assert getattr(cfg.env, switch) and cfg.env.draft_turns
    assert switch in cfg.method_switches
    assert switch not in cfg.playing(["draft_turns"]).method_switches
    assert not getattr(CoMapConfig.model_validate({"env": {"prompt_form": "draft_turns"}}).env, switch)


def test_a_transitions_conversation_reaches_its_reflection_sample_and_the_learner_trains_the_sent_prompt(
    tiny_model_dir, tok
):
    prompts = turns_prompts(tiny_model_dir)
    conversation = Conversation(TASK, FIRST, tuple(TURNS[:3]))
    dialogue = Dialogue(task=TASK, first=FIRST, turns=list(conversation.turns))
    tr = Transition(
        seq=1, id="e:3", actor="a", env="alfworld", game="g", split="train", episode="e", t=3, o=TURNS[2][1],
        phase="coevolve", goal=TASK, s=STATE, a_draft=DRAFT, s_hat=IMAGINED, decision="REVISE",
        a_ref="go to sinkbasin 1", p_revise=0.9, q_ref=0.9, a_exec="go to sinkbasin 1",
        s_hat_exec=IMAGINED, s_hat_teacher=IMAGINED, s_next="You arrive at sinkbasin 1.", reward=0.0,
        done=False, won=False, expert_action=None, policy_version=1, wm_version=1, ts=1.0,
        facts=[], ws_score=1.0, draft_confidence=0.3, dialogue=dialogue,
    )  # fmt: skip
    raw = msgspec.msgpack.encode(tr)
    item = Ingest(rule=SampleRule()).prepare(msgspec.msgpack.decode(raw, type=Transition), raw)
    (packed,) = [rec for store, rec in item.records if store == "reflections"]
    sample = msgspec.msgpack.decode(packed)
    assert sample["y"] == 1 and Conversation.from_record(sample["dialogue"]) == conversation
    encoder = Encoder(tok, prompts, 4096)
    seq = encoder.reflection(sample)
    sent = prompts.reflect(STATE, DRAFT, sample["s_bar"], 0.3, conversation)  # what the actor asked the server
    assert seq.ids[: seq.start] == encoder._ids(sent) and encoder.truncated == 0
    # a reflection-init sample carries it the same way
    refl = Reflection(
        seq=1, id="e:3:r", actor="a", game="g", s=STATE, a_draft=DRAFT, s_bar=IMAGINED, target=DRAFT, y=0,
        policy_version=1, wm_version=1, ts=1.0, label="equal_draft", dialogue=dialogue,
    )  # fmt: skip
    raw = msgspec.msgpack.encode(refl)
    ((_, packed),) = Ingest(rule=SampleRule()).prepare(msgspec.msgpack.decode(raw, type=Reflection), raw).records
    assert Conversation.from_record(msgspec.msgpack.decode(packed)["dialogue"]) == conversation


def test_a_conversation_longer_than_the_learners_window_loses_whole_oldest_turns_and_keeps_the_target(
    tiny_model_dir, tok
):
    prompts = turns_prompts(tiny_model_dir)
    long = Conversation(TASK, FIRST, tuple(TURNS) * 5)
    record = {
        "s": STATE, "a_draft": DRAFT, "s_bar": IMAGINED, "target": "go to sinkbasin 1", "y": 1,
        "dialogue": {"task": TASK, "first": FIRST, "turns": [list(t) for t in long.turns]},
    }  # fmt: skip
    whole = Encoder(tok, prompts, 1 << 16).reflection(record)
    cap = whole.start - 40  # a few turns too long
    encoder = Encoder(tok, prompts, cap)
    seq = encoder.reflection(record)
    assert len(seq.ids) <= cap and seq.ids[seq.start :] == whole.ids[whole.start :]
    kept = Conversation(TASK, FIRST, long.turns[FIT_LEFT_OUT_TURNS:])  # one chunk of turns left out
    assert seq.ids[: seq.start] == encoder._ids(prompts.reflect(STATE, DRAFT, IMAGINED, None, kept))


def test_the_world_models_prompt_extends_the_previous_steps_and_the_teachers_adds_hindsight_last(tiny_model_dir, tok):
    prompts = turns_prompts(tiny_model_dir)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    steps = [Conversation(TASK, FIRST, tuple(TURNS[:n])) for n in range(len(TURNS))]
    wm = [prompts.world_model(STATE, TURNS[n][0], c) for n, c in enumerate(steps)]
    for before, after in zip(wm, wm[1:]):
        assert after.startswith(before) and ids(after)[: len(ids(before))] == ids(before)
    assert TURNS[1][1] in wm[2] and "Admissible commands" not in wm[-1]
    action, real = TURNS[2][0], TURNS[2][1]
    teacher = prompts.teacher(STATE, action, real, steps[2])
    last_turn = wm[2].rindex(f"Action: {action}")
    assert teacher.startswith(wm[2][:last_turn]) and real in teacher[last_turn:]
    assert teacher.count("Hindsight") == 1 and "Hindsight" not in wm[2]
    # without the switch both render s_t whatever they are given
    chat = ChatTemplate.from_model_dir(tiny_model_dir)
    assert Prompts(chat).world_model(STATE, action, steps[2]) == chat.render(world_model_messages(STATE, action))
    assert Prompts(chat).teacher(STATE, action, real, steps[2]) == chat.render(teacher_messages(STATE, action, real))
    with pytest.raises(ValueError, match=r"env.prompt_form all_turns \(wm_turns\)"):
        prompts.world_model(STATE, action)


def test_the_learner_trains_the_world_model_and_its_teacher_on_the_prompts_the_actor_sent(tiny_model_dir, tok):
    prompts = turns_prompts(tiny_model_dir)
    conversation = Conversation(TASK, FIRST, tuple(TURNS[:3]))
    action, real, rollout = TURNS[3][0], TURNS[3][1], "You arrive at sinkbasin 1."
    record = {
        "s": STATE, "a_exec": action, "s_next": real, "s_hat_exec": rollout, "o": TURNS[2][1],
        "dialogue": {"task": TASK, "first": FIRST, "turns": [list(t) for t in conversation.turns]},
    }  # fmt: skip
    encoder = Encoder(tok, prompts, 4096)
    ce = encoder.world_model_ce(record)
    assert ce.ids[: ce.start] == encoder._ids(prompts.world_model(STATE, action, conversation))
    student, teacher = encoder.world_model_rollout(record)
    assert student.ids[: student.start] == encoder._ids(prompts.world_model(STATE, action, conversation))
    assert teacher.ids[: teacher.start] == encoder._ids(prompts.teacher(STATE, action, real, conversation))
    assert student.ids[student.start :] == teacher.ids[teacher.start :] == encoder._ids(rollout)
    # a window too short for the whole conversation: whole oldest turns go, the target stays whole
    long = {**record, "dialogue": {**record["dialogue"], "turns": [list(t) for t in TURNS] * 5}}
    unlimited = Encoder(tok, prompts, 1 << 16)
    whole = unlimited.world_model_ce(long)
    short = Encoder(tok, prompts, whole.start - 40)
    cut = short.world_model_ce(long)
    assert len(cut.ids) <= whole.start - 40 and cut.ids[cut.start :] == whole.ids[whole.start :]
    kept = Conversation(TASK, FIRST, (tuple(TURNS) * 5)[FIT_LEFT_OUT_TURNS:])
    assert cut.ids[: cut.start] == short._ids(prompts.world_model(STATE, action, kept))
    assert (unlimited.truncated, short.truncated) == (0, 1)  # learner/truncated counts a prompt that lost turns


def test_a_learner_step_trains_every_role_from_records_in_the_turns_form(tiny_model_dir):
    """A co-evolution step over transitions and reflection samples that carry their conversation: the
    world model's CE and self-distillation and the reflection's losses are all computed, finite, on
    the conversation prompts."""
    from tests.fixtures.learner import make_trainer

    trainer = make_trainer(tiny_model_dir, max_seq_len=512)
    trainer.encoder.prompts = turns_prompts(tiny_model_dir)
    dialogue = {"task": TASK, "first": FIRST, "turns": [list(t) for t in TURNS[:2]]}
    wm = {
        "s": STATE, "a_exec": TURNS[2][0], "s_next": TURNS[2][1], "s_hat_exec": IMAGINED, "o": TURNS[1][1],
        "dialogue": dialogue,
    }  # fmt: skip
    refl = {"id": "e:2", "s": STATE, "a_draft": DRAFT, "s_bar": IMAGINED, "target": TURNS[2][0], "y": 1}
    metrics = trainer.train_step([{"transitions": [wm], "reflections": [{**refl, "dialogue": dialogue}]}])
    for key in ("wm/ce", "wm/kl", "policy/bce", "policy/reflect_ce"):
        assert metrics[key] > 0 and metrics[key] < 100, (key, metrics[key])
    # a window-form sample cannot be read in this form
    with pytest.raises(ValueError, match=r"all_turns \(reflect_turns\)"):
        trainer.train_step([{"reflections": [refl]}])


def test_a_malformed_conversation_is_refused_on_the_wire():
    from comap_async.wire.protocol import ProtocolError, as_map, decode
    from tests.fixtures.messages import transition

    good = as_map(transition(3)) | {"dialogue": {"task": TASK, "first": FIRST, "turns": [list(TURNS[0])]}}
    assert decode(msgspec.msgpack.encode(good)).dialogue.turns == [TURNS[0]]
    for bad in ({"task": TASK, "first": FIRST, "turns": [["go to desk 1"]]}, {"task": TASK, "turns": []}, "turns"):
        with pytest.raises(ProtocolError):
            decode(msgspec.msgpack.encode(good | {"dialogue": bad}))


def test_a_reflection_fitted_to_the_servers_limit_leaves_room_for_its_continuation(tiny_model_dir, tok):
    """A reflection that leaves out its Final Action line is continued from its prompt plus the decision's
    head (``actors/llm.py``): that request must fit the servers' limit too. Left unreserved, a 50-step
    evaluation game sent 2,053 tokens against 2,048 and the evaluation lost its success rate."""
    import dataclasses

    from comap_async.prompts import reflection_head

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=True)["input_ids"])

    conversation = Conversation(TASK, FIRST, tuple(TURNS) * 4)
    whole = turns_prompts(tiny_model_dir).reflect(STATE, DRAFT, IMAGINED, 0.95, conversation)
    head = reflection_head("REVISE")
    assert count(whole + head) > count(whole) + 1
    # the prompt alone fits the limit, its continuation does not: its oldest turns go
    prompts = dataclasses.replace(turns_prompts(tiny_model_dir), max_prompt_tokens=count(whole) + 1, count_tokens=count)
    fitted = prompts.reflect(STATE, DRAFT, IMAGINED, 0.95, conversation)
    assert fitted != whole and count(fitted + head) <= count(whole) + 1
    # the learner fits to its own room, whose target already holds the head: nothing reserved there
    assert prompts.reflect(STATE, DRAFT, IMAGINED, 0.95, conversation, count(whole), count) == whole
