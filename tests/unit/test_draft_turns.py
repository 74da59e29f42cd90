"""``env.draft_turns`` (trajectory-form training): a warm-up path trains as one sequence
whose every demonstrated action sits exactly where the actors' prompt for that step ends, so one
sequence stands for the per-step samples of its actions (the same tokens, the same losses)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from broker.ingest import Ingest, record_counters
from comap_async.config import CoMapConfig
from comap_async.prompts import ChatTemplate, Conversation, Prompts
from comap_async.prompts.template import FIT_LEFT_OUT_TURNS
from comap_async.wire.messages import TurnDemos
from learner.batches import Encoder
from learner.packing import pack
from tests.fixtures.qwen3 import QWEN3_CHAT_TEMPLATE

TASK = "put a clean mug in coffeemachine."
FIRST = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, a sinkbasin 1."
)
TURNS = [
    ("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a mug 1, and a apple 2."),
    ("take apple 2 from countertop 1", "You pick up the apple 2 from the countertop 1."),  # explored: context
    ("take mug 1 from countertop 1", "Nothing happens."),
    ("go to sinkbasin 1", "You arrive at sinkbasin 1. On the sinkbasin 1, you see nothing."),
]
TARGETS = [True, False, True, True]


def path_record(targets=TARGETS) -> dict:
    return {"goal": TASK, "first": FIRST, "turns": [list(t) for t in TURNS], "targets": list(targets)}


def qwen3_chat() -> ChatTemplate:
    return ChatTemplate(QWEN3_CHAT_TEMPLATE, {"bos_token": "", "eos_token": "<|im_end|>"})


@pytest.fixture(params=["chatml", "qwen3"])
def encoder(tiny_model_dir, request):
    from comap_async.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(str(tiny_model_dir))
    chat = qwen3_chat() if request.param == "qwen3" else ChatTemplate.from_model_dir(tiny_model_dir)
    return Encoder(tok, Prompts(chat), 512)


def test_each_demonstrated_action_follows_exactly_the_prompt_the_actor_sends_at_that_step(encoder):
    seq = encoder.draft(path_record())
    assert encoder.demo_actions == 3
    loss = seq.loss
    assert loss is not None and len(loss) == seq.n_target
    for i, (action, _) in enumerate(TURNS):
        prompt = encoder._ids(encoder.prompts.draft(Conversation(TASK, FIRST, tuple(TURNS[:i]))))
        target = encoder._ids(action + encoder.eos)
        # the step's own per-step sample: the same prompt tokens, then the action and end of turn
        assert seq.ids[: len(prompt) + len(target)] == prompt + target, i
        span = range(len(prompt) - seq.start, len(prompt) - seq.start + len(target))
        assert [loss[j] for j in span] == [TARGETS[i]] * len(target), i
    assert seq.n_loss == sum(
        len(encoder._ids(a + encoder.eos)) for (a, _), on in zip(TURNS, TARGETS) if on
    )  # observations, and the explored action, carry no loss
    assert seq.ids[seq.start :][-1] == encoder.tokenizer.convert_tokens_to_ids(encoder.eos)  # ends with the last action


def test_a_path_ends_after_its_last_demonstrated_action_and_a_long_one_is_cut_at_a_whole_turn(encoder):
    whole = encoder.draft(path_record([True, False, True, False]))
    assert whole.n_loss == sum(len(encoder._ids(a + encoder.eos)) for a, _ in (TURNS[0], TURNS[2]))
    encoder.max_path_tokens = len(whole.ids) - 1  # the third action no longer fits
    encoder.truncated = 0
    cut = encoder.draft(path_record([True, False, True, False]))
    assert encoder.truncated == 1
    assert cut.n_loss == len(encoder._ids(TURNS[0][0] + encoder.eos))
    encoder.max_path_tokens = 1  # the first action always stays
    assert encoder.draft(path_record()).n_loss == len(encoder._ids(TURNS[0][0] + encoder.eos))


def test_packing_places_the_context_but_computes_losses_on_the_demonstrated_tokens_only(encoder):
    seq = encoder.draft(path_record())
    plain = encoder.draft({"s": "Task: cool a mug.\nCurrent observation: hi", "target": "go to fridge 1"})
    packed = pack([[seq], [plain]], 0)
    assert len(packed.targets) == seq.n_loss + plain.n_target
    assert packed.counts == [seq.n_loss, plain.n_target]
    first = packed.owner == 0
    kept = [seq.ids[seq.start + j] for j in range(seq.n_target) if seq.loss[j]]
    assert packed.targets[first].tolist() == kept
    # each loss token is predicted by the position before it in the packed row
    for k in torch.nonzero(first).flatten().tolist():
        r, c = int(packed.rows[k]), int(packed.cols[k])
        assert int(packed.input_ids[r, c + 1]) == int(packed.targets[k])


def test_a_trained_path_moves_the_per_step_draft_losses_of_its_actions(tiny_model_dir):
    """One step on a path lowers the loss of each of its demonstrated actions measured per step,
    the window form the probes and actors could score it in."""
    from tests.fixtures.learner import make_trainer

    trainer = make_trainer(tiny_model_dir, max_seq_len=512, lr=1e-2)
    enc = trainer.encoder

    def per_step() -> list[float]:
        return [
            _nll(trainer, enc.prompts.draft(Conversation(TASK, FIRST, tuple(TURNS[:i]))), action)
            for i, (action, _) in enumerate(TURNS)
            if TARGETS[i]
        ]

    before = per_step()
    for _ in range(3):
        metrics = trainer.train_step([{"demos": [path_record()]}])
        assert metrics["policy/demo_actions"] == 3
    after = per_step()
    assert all(a < b for a, b in zip(after, before)), (before, after)


def test_a_step_counts_the_imagined_episodes_among_its_demonstrations(tiny_model_dir):
    """``policy/imagined_demos``: how many of a step's demonstrations came from the imagined store (a path in
    the turns form, or a window-form step of one), so a run shows what
    ``comap_async.method.phases.IMAGINED_DEMO_SHARE`` trained."""
    from tests.fixtures.learner import make_trainer

    trainer = make_trainer(tiny_model_dir, max_seq_len=512)
    imagined = {**path_record([False, False, True, True]), "imagined": True}
    metrics = trainer.train_step([{"demos": [path_record(), imagined]}, {"demos": [imagined]}])
    assert metrics["policy/imagined_demos"] == 2
    assert trainer.train_step([{"demos": [path_record()]}])["policy/imagined_demos"] == 0


def _nll(trainer, prompt: str, action: str) -> float:
    from learner.peft_model import activate

    enc = trainer.encoder
    p, t = enc._ids(prompt), enc._ids(action + enc.eos)
    ids = torch.tensor([p + t])
    activate(trainer.model, "policy", trainable=False)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[0, len(p) - 1 : -1]
    return float(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(t)))


def test_the_broker_stores_a_path_as_one_demo_and_no_per_step_demo_for_its_steps():
    ingest = Ingest()
    msg = TurnDemos(
        seq=1, id="e1", actor="a", game="g", episode="e1", goal=TASK, first=FIRST,
        turns=TURNS, targets=TARGETS, policy_version=0, wm_version=0, ts=1.0,
    )  # fmt: skip
    item = ingest.prepare(msg, b"")
    ((store, raw),) = item.records
    rec = msgspec.msgpack.decode(raw)
    assert store == "demos" and rec["turns"] == [list(t) for t in TURNS] and rec["targets"] == TARGETS
    assert item.counters == record_counters("demos", rec) == {"stored_turn_demos": 1, "stored_demo_turns": 3}
    with pytest.raises(msgspec.ValidationError, match="one target flag per turn"):
        msgspec.convert({**msgspec.structs.asdict(msg), "targets": [True]}, TurnDemos)
    with pytest.raises(msgspec.ValidationError, match="at least one target"):
        msgspec.convert({**msgspec.structs.asdict(msg), "targets": [False] * 4}, TurnDemos)


def test_the_switch_is_a_play_switch_and_refuses_what_would_mix_prompt_forms():
    cfg = CoMapConfig.model_validate({"env": {"prompt_form": "draft_turns"}})
    assert "draft_turns" in cfg.method_switches
    for bad, name in (
        ({"learner": {"policy_wm_aux": 0.1}}, "learner.policy_wm_aux"),  # selecting by the window form's entropy
    ):
        with pytest.raises(ValueError, match=name):
            CoMapConfig.model_validate({"env": {"prompt_form": "draft_turns"}, **bad})
    # imagined episodes go as turns paths (tests/unit/test_imagined.py)
    CoMapConfig.model_validate({"env": {"prompt_form": "draft_turns"}, "actor": {"imagined_rollouts": 1}})


def test_an_episode_longer_than_the_servers_limit_leaves_out_its_oldest_turns(tiny_model_dir):
    cfg = CoMapConfig.model_validate(
        {
            "env": {"prompt_form": "draft_turns"},
            "inference": {"max_prompt_tokens": 600},
        }
    )
    prompts = Prompts.for_model(tiny_model_dir, cfg)
    long = Conversation(TASK, FIRST, tuple(TURNS) * 10)
    prompt = prompts.draft(long)
    assert prompts.count_tokens(prompt) <= 600
    whole = Prompts.for_model(tiny_model_dir, CoMapConfig())  # no limit applied
    kept = [k for k in range(1, len(long.turns)) if whole.draft(Conversation(TASK, FIRST, long.turns[-k:])) == prompt]
    assert kept, "not the first turn and the newest turns"
    # turns are left out FIT_LEFT_OUT_TURNS at a time: that many fewer would pass the limit
    left_out = len(long.turns) - kept[0]
    assert left_out % FIT_LEFT_OUT_TURNS == 0
    back = long.turns[-kept[0] - FIT_LEFT_OUT_TURNS :]
    assert prompts.count_tokens(whole.draft(Conversation(TASK, FIRST, back))) > 600
    # so most steps of a long episode extend the previous step's prompt (the server's prefix cache holds it)
    steps = [prompts.draft(Conversation(TASK, FIRST, long.turns[:n])) for n in range(len(long.turns))]
    extended = sum(b.startswith(a) for a, b in zip(steps, steps[1:]))
    assert extended >= len(steps) - 1 - (len(steps) // FIT_LEFT_OUT_TURNS + 1)
    # a short episode is rendered whole, and without the switch nothing counts tokens
    short = Conversation(TASK, FIRST, tuple(TURNS[:1]))
    assert prompts.count_tokens(whole.draft(short)) <= 600 and prompts.draft(short) == whole.draft(short)
    assert whole.count_tokens is None


def test_the_learner_cuts_a_path_at_its_length_cap_not_at_the_prompt_limit(tiny_model_dir):
    """The cap is the servers' prompt limit (``inference.max_prompt_tokens``), so no trained prompt is one
    the actors cut; a longer path ends after its last whole turn within it, not with its oldest turns left out."""
    from comap_async.config import LearnerConfig
    from comap_async.models import load_model_and_tokenizer

    cfg = CoMapConfig.model_validate({"env": {"prompt_form": "draft_turns"}, "inference": {"max_prompt_tokens": 300}})
    _, tok = load_model_and_tokenizer(str(tiny_model_dir))
    enc = Encoder.for_learner(tok, Prompts.for_model(tiny_model_dir, cfg), LearnerConfig(max_seq_len=512))
    assert enc.max_path_tokens == 300
    seq = enc.draft({"goal": TASK, "first": FIRST, "turns": TURNS * 6, "targets": [True] * 24})
    assert len(seq.ids) <= 300 and enc.truncated == 1 and 0 < enc.demo_actions < 24


def test_a_path_whose_demonstrations_lie_past_the_cap_trains_nothing_and_does_not_stop_the_step(tiny_model_dir):
    """A recovery path that learns only its last action (the prefix is context) can be longer than
    the path cap (``inference.max_prompt_tokens``): cut there, it holds no demonstrated action. It is left out
    of the step (counted as truncated), alone or beside a path that trains."""
    from tests.fixtures.learner import make_trainer

    trainer = make_trainer(tiny_model_dir)
    trainer.encoder.max_path_tokens = 500
    long_tail = {"goal": TASK, "first": FIRST, "turns": TURNS * 6, "targets": [False] * 23 + [True]}
    assert trainer.encoder.draft(long_tail).n_loss == 0 and trainer.encoder.truncated == 1
    assert trainer.encoder.draft(path_record()).n_loss > 0 and trainer.encoder.truncated == 1  # fits whole
    trainer.encoder.truncated = 0
    before = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    alone = trainer.train_step([{"demos": [long_tail], "transitions": [], "reflections": []}])
    assert alone["policy/draft_ce"] == 0.0 and alone["learner/truncated"] == 1
    after = [p.detach() for p in trainer.model.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing trained
    beside = trainer.train_step([{"demos": [long_tail, path_record()], "transitions": [], "reflections": []}])
    assert beside["policy/draft_ce"] > 0 and beside["learner/truncated"] == 1


def test_demo_loss_share_subsamples_the_frequent_words_turns_and_keeps_the_rest(tiny_model_dir):
    """``learner.demo_loss_share``: a ``go`` turn with share 0 is context; the ``take`` stays a demonstration;
    the sequence is the same tokens either way; a path whose every demonstration is subsampled keeps its last."""
    from comap_async.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(str(tiny_model_dir))
    prompts = Prompts(ChatTemplate.from_model_dir(tiny_model_dir))
    full = Encoder(tok, prompts, 512).draft(path_record())
    # the explored take picked up the apple: the last go is a delivery (its own word)
    sub_enc = Encoder(tok, prompts, 512, demo_loss_share={"go": 1e-9, "deliver": 1e-9})
    sub = sub_enc.draft(path_record())
    assert sub.ids == full.ids and sub.start == full.start
    assert sub_enc.demo_actions == 1  # only "take mug 1 from countertop 1"
    take = len(sub_enc._ids("take mug 1 from countertop 1" + sub_enc.eos))
    assert sub.n_loss == take
    changed = [j for j in range(full.n_target) if full.loss[j] != sub.loss[j]]
    assert changed and all(full.loss[j] and not sub.loss[j] for j in changed)  # only demonstrations became context
    only_go = Encoder(tok, prompts, 512, demo_loss_share={"go": 1e-9, "deliver": 1e-9, "take": 1e-9})
    last = only_go.draft(path_record())
    go = len(only_go._ids("go to sinkbasin 1" + only_go.eos))
    assert last.n_loss == go and last.loss[-go:] == [True] * go and only_go.demo_actions == 1


def test_demo_loss_share_covers_a_keeps_final_action_not_a_revises_nor_the_decision(tiny_model_dir):
    """A KEEP reflection whose final action's word is subsampled keeps the loss on its decision and
    ``Final Action:`` prefix only (the same tokens); a ``take`` keeps it on every token, and so does a
    REVISE's correction whatever its word; both the learner's packing and the reference
    oracle's collation leave the subsampled action's tokens out."""
    from comap_async.models import load_model_and_tokenizer
    from comap_async.prompts import reflection_head
    from learner.losses import IGNORE
    from tests.fixtures.reference_path import collate

    _, tok = load_model_and_tokenizer(str(tiny_model_dir))
    prompts = Prompts(ChatTemplate.from_model_dir(tiny_model_dir))
    rec = {"id": "r1", "s": FIRST, "a_draft": "go to sinkbasin 1", "s_bar": "Nothing happens.", "y": 0}
    go, take = rec | {"target": "go to sinkbasin 1"}, rec | {"target": "take mug 1 from countertop 1"}
    sub = Encoder(tok, prompts, 512, demo_loss_share={"go": 1e-9})
    full = Encoder(tok, prompts, 512).reflection(go)
    cut = sub.reflection(go)
    head = len(sub._ids(reflection_head("KEEP")))
    assert cut.ids == full.ids and full.loss is None
    assert cut.loss == [True] * head + [False] * (cut.n_target - head) and cut.n_loss == head
    assert sub.reflection(take).loss is None
    revise = go | {"y": 1, "a_draft": "look"}
    assert sub.reflection(revise).loss is None
    assert sub.reflection(revise).n_loss == Encoder(tok, prompts, 512).reflection(revise).n_target
    assert len(pack([[cut]], 0).targets) == head
    labels = collate([cut, full], 0)["labels"]
    assert int((labels[0] != IGNORE).sum()) == head and int((labels[1] != IGNORE).sum()) == full.n_target


def test_carries_loss_keeps_about_the_share_stably():
    from learner.batches import carries_loss

    share = {"go": 0.25}
    kept = [carries_loss("go to shelf 1", f"path-{i}:3", share) for i in range(4000)]
    assert 0.22 < sum(kept) / len(kept) < 0.28
    assert kept == [carries_loss("go to shelf 1", f"path-{i}:3", share) for i in range(4000)]  # the same every pass
    assert all(carries_loss("take mug 1 from countertop 1", f"p:{i}", share) for i in range(100))


def test_demo_loss_share_needs_the_turns_form():
    from comap_async.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs env.prompt_form draft_turns or all_turns"):
        load_config(None, ["learner.demo_loss_share={go: 0.2}"])
    cfg = load_config(None, ["env.prompt_form=draft_turns", "learner.demo_loss_share={go: 0.2, open: 0.2}"])
    assert cfg.learner.demo_loss_share == {"go": 0.2, "open": 0.2}


def test_the_task_is_named_once_in_the_first_turn(tiny_model_dir):
    from comap_async.prompts import draft_turn_messages

    conversation = Conversation(TASK, FIRST, tuple(TURNS))
    users = [m["content"] for m in draft_turn_messages(conversation) if m["role"] == "user"]
    assert users[0].startswith(f"Task: {TASK}") and users[1:] == [o for _, o in TURNS]
    prompts = Prompts.for_model(tiny_model_dir, CoMapConfig.model_validate({"env": {"prompt_form": "draft_turns"}}))
    assert prompts.draft(conversation).count(f"Task: {TASK}") == 1


RECORDED = {"window": [], "draft_turns": ["draft_turns"], "all_turns": ["draft_turns", "reflect_turns", "wm_turns"]}
"""Each prompt form by the switch names runs recorded before it was one field (ablation.json, the fingerprint)."""


@pytest.mark.parametrize("form", list(RECORDED))
def test_a_prompt_form_is_recorded_by_its_switch_names_and_played_back_from_them(form):
    from comap_async.config import load_config
    from comap_async.method.fingerprint import method_settings

    cfg = load_config(None, [f"env.prompt_form={form}"])
    names = RECORDED[form]
    assert cfg.method_switches == names and method_settings(cfg)["methods"] == sorted(names)
    assert [cfg.env.draft_turns, cfg.env.reflect_turns, cfg.env.wm_turns] == [
        n in names for n in ("draft_turns", "reflect_turns", "wm_turns")
    ]
    for played in (CoMapConfig(), CoMapConfig.model_validate({"env": {"prompt_form": "all_turns"}})):
        assert played.playing(names).env.prompt_form == form
        assert played.playing([*names, "show_location"]).env.prompt_form == form
    with pytest.raises(AttributeError):  # read from the form, never set by its old names
        cfg.env.draft_turns = True


@pytest.mark.parametrize(
    "names",
    [["draft_turns", "reflect_turns"], ["draft_turns", "wm_turns"], ["draft_turns", "task_every_turn"]],
    ids=["reflect-only", "wm-only", "task-every-turn"],
)
def test_a_recorded_set_no_prompt_form_expresses_is_refused_in_one_line(names):
    from comap_async.config import ConfigError

    with pytest.raises(ConfigError, match="cannot be played as it trained") as refused:
        CoMapConfig().playing(names)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("old", ["draft_turns", "reflect_turns", "wm_turns", "task_every_turn"])
def test_the_old_switches_are_refused_with_their_replacement(old):
    from comap_async.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"env.{old}: removed: ") as refused:
        load_config(None, [f"env.{old}=true"])
    assert ("prompt_form" in str(refused.value)) == (old != "task_every_turn")


def test_a_go_while_carrying_is_a_delivery_and_keeps_its_loss_under_the_go_share(tiny_model_dir):
    """``go: ~0`` subsamples search steps; the ``go`` after a successful ``take`` (a delivery) keeps its
    loss unless ``deliver`` has a share; a failed ``take`` carries nothing; a ``move`` ends carrying."""
    from comap_async.models import load_model_and_tokenizer
    from learner.batches import carrying_after, loss_word

    assert carrying_after(False, "take mug 1 from countertop 1", "You pick up the mug 1 from the countertop 1.")
    assert not carrying_after(False, "take mug 1 from countertop 1", "Nothing happens.")
    assert not carrying_after(True, "move mug 1 to shelf 1", "You move the mug 1 to the shelf 1.")
    assert carrying_after(True, "go to shelf 1", "You arrive at shelf 1.")
    assert loss_word("go to shelf 1", True) == "deliver" and loss_word("go to shelf 1", False) == "go"
    _, tok = load_model_and_tokenizer(str(tiny_model_dir))
    prompts = Prompts(ChatTemplate.from_model_dir(tiny_model_dir))
    turns = [
        ("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a mug 1."),
        ("take mug 1 from countertop 1", "You pick up the mug 1 from the countertop 1."),
        ("go to shelf 1", "You arrive at shelf 1. On the shelf 1, you see nothing."),
        ("move mug 1 to shelf 1", "You move the mug 1 to the shelf 1."),
        ("go to desk 1", "You arrive at desk 1."),
    ]
    record = {"goal": TASK, "first": FIRST, "turns": [list(t) for t in turns], "targets": [True] * 5}
    enc = Encoder(tok, prompts, 512, demo_loss_share={"go": 1e-9})
    enc.draft(record)
    assert enc.demo_actions == 3  # take, the delivery, move: not the search go's
    also = Encoder(tok, prompts, 512, demo_loss_share={"go": 1e-9, "deliver": 1e-9})
    also.draft(record)
    assert also.demo_actions == 2


def test_qwen3s_template_drops_a_past_turns_think_block_and_the_turns_prompts_still_extend_each_other():
    """Qwen3's template writes a past answer without the empty ``<think></think>`` block its generation
    prompt put before it: rendered plainly, step 1's prompt does not start with step 0's prompt, answer
    and end of turn, and a warm-up path could not train as one sequence. Every turns-form prompt (draft,
    reflection, world model) keeps the block where the model saw it when it answered."""
    from comap_async.prompts import draft_turn_messages

    chat = qwen3_chat()
    prompts = Prompts(chat, reflect_turns=True, wm_turns=True)
    c0, c1 = Conversation(TASK, FIRST), Conversation(TASK, FIRST, tuple(TURNS[:1]))
    step0, answer = prompts.draft(c0), TURNS[0][0] + "<|im_end|>"
    assert step0.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not chat.render(draft_turn_messages(c1)).startswith(step0 + answer)  # the template's own render
    for i in range(1, len(TURNS)):
        before, now = Conversation(TASK, FIRST, tuple(TURNS[: i - 1])), Conversation(TASK, FIRST, tuple(TURNS[:i]))
        assert prompts.draft(now).startswith(prompts.draft(before) + TURNS[i - 1][0] + "<|im_end|>"), i
        # the world model's conversation: step i extends step i-1 by the real observation
        wm_before = prompts.world_model("", TURNS[i - 1][0], before)
        assert prompts.world_model("", TURNS[i][0], now).startswith(wm_before + TURNS[i - 1][1] + "<|im_end|>"), i
    # the reflection continues the draft's conversation: the draft's prompt, the draft, end of turn
    draft_prompt = prompts.draft(c1)
    reflection = prompts.reflect("", "go to fridge 1", "The fridge 1 is closed.", None, c1)
    assert reflection.startswith(draft_prompt + "go to fridge 1<|im_end|>")
    past = "<|im_start|>assistant\n" + TURNS[0][0]  # the past answer as the template writes it: no block
    assert past in chat.render(draft_turn_messages(c1)) and past not in draft_prompt
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" + TURNS[0][0] in draft_prompt


def test_a_qwen3_learner_trains_a_warm_up_path(tmp_path):
    """The learner step that raised ("this model's chat template does not extend a conversation turn by
    turn") on a Qwen3 model with ``env.draft_turns``."""
    from comap_async.models import build_tiny_model
    from tests.fixtures.learner import make_trainer

    model = build_tiny_model(tmp_path / "qwen3", arch="qwen3", chat_template=QWEN3_CHAT_TEMPLATE)
    trainer = make_trainer(model, max_seq_len=512)
    metrics = trainer.train_step([{"demos": [path_record()]}])
    assert metrics["policy/demo_actions"] == 3 and metrics["policy/draft_ce"] > 0
