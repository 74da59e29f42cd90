"""One learner step's loss terms, gradients and metrics, pinned (tiny model, fp32).

The numbers were computed by the learner before its batches became typed (learner/batch_types.py)
and its losses were composed in one function (:func:`learner.losses.step_loss`): that change was
meant to move no figure, and this test holds every later change of the same kind to it. A change
that means to move a figure (a loss term's definition, the encoding of a record) updates them, and
says so. The tolerance covers the summation order of another BLAS, not a changed term.
"""

from __future__ import annotations

import pytest
import torch

from comap_async.wire.messages import ROLES
from learner.peft_model import adapter_parameters
from tests.fixtures.learner import demo_record, make_trainer, reflection_record, wm_record

PINNED_REL = 1e-4


def path_record(**extra) -> dict:
    """A warm-up path (the turns form of a demonstration)."""
    return {
        "id": "p0",
        "goal": "put a mug in fridge.",
        "first": "You are in the middle of a room.",
        "turns": [
            ["go to countertop 1", "You arrive at countertop 1."],
            ["take apple 1 from countertop 1", "You pick up the apple 1."],
            ["take mug 1 from countertop 1", "You pick up the mug 1."],
        ],
        "targets": [True, False, True],
        **extra,
    }


def every_kind() -> list[dict]:
    """Two micro-batches holding every kind of record the broker serves: transitions with and
    without a rollout, demonstrations in the window form (a real and an imagined one) and the turns
    form (a real and an imagined path), reflection samples labelled by the gate and by a suffix."""
    long_state = "Task: cool a mug.\nCurrent observation: You arrive at countertop 1. " + "You see a mug 1. " * 6
    first = {
        "transitions": [
            {**wm_record(0, rollout="You arrive at fridge 1. The fridge 1 is open."), "o": "You are in a room."},
            {**wm_record(1, rollout="Nothing happens."), "s": long_state},
            {**wm_record(2, rollout=""), "o": "You arrive at fridge 1."},
        ],
        "demos": [demo_record(0), {**demo_record(1), "source": "imagined"}, path_record()],
        "reflections": [
            {**reflection_record(1), "source": "suffix", "id": "r0"},
            {**reflection_record(0), "source": "suffix", "id": "r1"},
            {**reflection_record(1), "source": "gate", "id": "r2"},
        ],
    }
    second = {
        "transitions": [{**wm_record(3, rollout="The fridge 1 is closed."), "o": "You arrive at fridge 1."}],
        "demos": [path_record(id="p1", imagined=True)],
        "reflections": [{**reflection_record(0), "source": "gate", "id": "r3"}],
    }
    return [first, second]


def randomized(trainer):
    """Non-zero LoRA A and B for every role, from a fixed seed (B starts at zero)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for role in ROLES:
            for _, p in adapter_parameters(trainer.model, role):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return trainer


def step(trainer, micro_batches) -> tuple[dict, dict]:
    """One ``train_step``: its metrics, and per role two summaries of the (clipped) gradient the
    optimizer was about to apply: its sum and its projection on a fixed random direction."""
    grads: dict = {}
    optimizer_step = trainer.optimizer.step

    def capture(*a, **kw):
        for role in ("policy", "wm"):
            g = torch.cat([p.grad.detach().flatten() for _, p in adapter_parameters(trainer.model, role)])
            direction = torch.randn(g.shape, generator=torch.Generator().manual_seed(1))
            grads[role] = (float(g.sum()), float(g @ direction))
        return optimizer_step(*a, **kw)

    trainer.optimizer.step = capture
    return trainer.train_step(micro_batches), grads


# computed by the learner before its batches were typed and its losses composed in one place
PINNED_METRICS = {
    "wm/ce": 8.353827158610027,
    "wm/kl": 4.887088060379028,
    "wm/loss": 10.797371188799541,
    "policy/draft_ce": 8.74504386054145,
    "policy/reflect_ce": 9.722520781726372,
    "policy/bce": 1.8321881666779518,
    "policy/loss": 18.4858865239346,
    "policy/wm_aux": 1.4143622517585754,
    "policy/wm_aux_weight": 2.0,
    "policy/wm_aux_selected": 1.5,
    "policy/wm_aux_entropy": 3.776292562484741,
    "wm/change_nll": 8.859636828303337,
    "policy/revise_label_share": 0.5,
    "learner/truncated": 0,
    "policy/demo_actions": 8,
    "policy/imagined_demos": 2,
    "learner/lr": 0.003,
    "learner/grad_norm": 49.44231350509282,
    "learner/grad_norm_policy": 42.7235221862793,
    "learner/grad_norm_wm": 24.884593963623047,
    "learner/tokens": 2933,
}
PINNED_GRADS = {
    "policy": (-0.7688286304473877, 0.46635350584983826),
    "wm": (1.6017605066299438, 1.6956285238265991),
}


def test_a_step_over_every_kind_of_record_moves_no_figure(tiny_model_dir):
    trainer = randomized(
        make_trainer(
            tiny_model_dir,
            autocast="off",
            chunk_tokens=300,
            bce_gate_labels=False,
            bce_balance=True,
            policy_wm_aux=0.2,
            demo_loss_share={"go": 1e-9},
        )
    )
    metrics, grads = step(trainer, every_kind())
    metrics = {k: v for k, v in metrics.items() if k not in ("learner/tokens_per_s", "learner/step_s")}
    assert metrics.keys() == PINNED_METRICS.keys()
    for name, value in PINNED_METRICS.items():
        assert metrics[name] == pytest.approx(value, rel=PINNED_REL, abs=1e-7), name
    for role, (total, projection) in PINNED_GRADS.items():
        assert grads[role][0] == pytest.approx(total, rel=PINNED_REL, abs=1e-6), role
        assert grads[role][1] == pytest.approx(projection, rel=PINNED_REL, abs=1e-6), role


def test_each_record_is_of_one_kind_decided_by_its_store_and_fields():
    from comap_async.wire.records import RecordKind, is_imagined, record_kind

    assert record_kind("transitions", wm_record()) is RecordKind.TRANSITION
    assert record_kind("demos", demo_record()) is RecordKind.DEMO_STEP
    assert record_kind("demos", path_record()) is RecordKind.DEMO_PATH
    assert record_kind("reflections", {**reflection_record(), "source": "suffix"}) is RecordKind.SUFFIX_REFLECTION
    assert record_kind("reflections", {**reflection_record(), "source": "gate"}) is RecordKind.GATE_REFLECTION
    assert record_kind("reflections", reflection_record()) is RecordKind.GATE_REFLECTION  # the gate's by default
    assert is_imagined(path_record(imagined=True)) and is_imagined({**demo_record(), "source": "imagined"})
    assert not is_imagined(path_record()) and not is_imagined(demo_record())
    with pytest.raises(ValueError, match="episodes"):
        record_kind("episodes", {})


def test_a_micro_batch_is_read_once_into_its_typed_batches(tiny_model_dir):
    from comap_async.wire.records import RecordKind

    trainer = make_trainer(tiny_model_dir, bce_gate_labels=False)
    first, second = every_kind()
    batch = trainer.micro_batch(first)
    units = batch.world_model.units
    assert [u.is_ce for u in units] == [[True, False], [True, False], [True]]  # the last has no rollout
    assert [u.teacher is not None for u in units] == [True, True, False]
    assert batch.world_model.n_ce == sum(u.seqs[0].n_target for u in units)
    assert batch.drafts.kinds == [RecordKind.DEMO_STEP, RecordKind.DEMO_STEP, RecordKind.DEMO_PATH]
    assert (batch.drafts.records, batch.drafts.imagined) == (3, 1)
    r = batch.reflections
    assert r.kinds == [RecordKind.SUFFIX_REFLECTION] * 2 + [RecordKind.GATE_REFLECTION]
    assert (r.y, r.in_bce, r.label_counts()) == ([1, 0, 1], [True, True, False], [1, 1])
    assert batch.transitions == first["transitions"]  # as served, for PaW
    assert [s.y for s in batch.policy_samples()] == [None, None, None, 1, 0, 1]  # drafts first
    trainer.method = trainer.method.model_copy(update={"bce_gate_labels": True})
    assert trainer.micro_batch(second).reflections.in_bce == [True]
    trainer.freeze_wm = True
    assert trainer.micro_batch(first).world_model.units == []  # a frozen world model reads no transition


def test_one_composition_weighs_each_term_and_names_its_metrics():
    from learner.losses import LossWeights, StepTerms, step_loss

    w = LossWeights(draft=2.0, reflect=0.5, bce=0.1, eta=0.25, wm_aux=3.0)
    total, metrics = step_loss(StepTerms(wm_ce=1.0, wm_kl=4.0, draft_ce=1.0, reflect_ce=2.0, bce=5.0, wm_aux=0.5), w)
    assert metrics == {
        "wm/ce": 1.0,
        "wm/kl": 4.0,
        "wm/loss": 1.0 + 0.25 * 4.0,
        "policy/draft_ce": 1.0,
        "policy/reflect_ce": 2.0,
        "policy/bce": 5.0,
        "policy/loss": 2.0 * 1.0 + 0.5 * 2.0 + 0.1 * 5.0,
        "policy/wm_aux": 0.5,
        "policy/wm_aux_weight": 3.0,
    }
    assert total == pytest.approx(2.0 + 3.5 + 1.5)
    # a term that is None is neither in the loss nor logged (an ablation's, a role not in this pass)
    total, metrics = step_loss(StepTerms(wm_kl=4.0), w)
    assert (total, metrics) == (1.0, {"wm/kl": 4.0, "wm/loss": 1.0})
    assert step_loss(StepTerms(), w) == (0.0, {})
    # tensors: the loss to differentiate, each term's gradient its weight
    terms = {
        name: torch.tensor(1.0, requires_grad=True) for name in ("wm_ce", "wm_kl", "draft_ce", "reflect_ce", "bce")
    }
    total, metrics = step_loss(StepTerms(**terms), w)
    total.backward()
    assert [float(t.grad) for t in terms.values()] == [1.0, 0.25, 2.0, 0.5, pytest.approx(0.1)]
    assert isinstance(metrics["policy/loss"], float)
