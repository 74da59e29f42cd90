"""PaW's auxiliary loss: the policy predicts next observations of the real transitions
with the highest action entropy, under a noise-tolerant loss and an adaptive weight; off unless
switched on. Pure functions by hand, then the tiny trainer with its real LoRA adapters."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from learner.paw import AdaptiveWeight, generalized_ce, select_by_entropy, token_entropy
from tests.fixtures.learner import demo_record, make_trainer, wm_record


def test_generalized_ce_between_ce_and_mae():
    torch.manual_seed(0)
    logits, targets = torch.randn(6, 9), torch.tensor([0, 3, 8, 1, 1, 5])
    ce = F.cross_entropy(logits, targets)
    assert generalized_ce(logits, targets, 1e-4).item() == pytest.approx(ce.item(), rel=1e-3)
    p = torch.softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert generalized_ce(logits, targets, 1.0).item() == pytest.approx((1 - p).mean().item(), rel=1e-5)
    # a token the model finds impossible costs at most 1/q: bounded, unlike the cross-entropy
    hopeless = torch.tensor([[-50.0, 50.0]])
    assert generalized_ce(hopeless, torch.tensor([0]), 0.7).item() == pytest.approx(1 / 0.7, rel=1e-4)


def test_selection_takes_the_highest_entropy_share():
    ent = torch.tensor([0.1, 2.0, 0.5, 1.5])
    assert select_by_entropy(ent, 0.5) == [1, 3]
    assert select_by_entropy(ent, 0.1) == [1]  # at least one
    assert select_by_entropy(ent, 1.0) == [1, 3, 2, 0]
    assert select_by_entropy(torch.tensor([]), 0.5) == []
    assert token_entropy(torch.zeros(1, 4)).item() == pytest.approx(torch.log(torch.tensor(4.0)).item())


def test_adaptive_weight_tracks_the_policy_loss():
    w = AdaptiveWeight(0.1, momentum=0.5)
    assert w.update(2.0, 4.0) == pytest.approx(0.1 * 2.0 / 4.0)
    assert w.update(2.0, 0.0) == pytest.approx(0.1 * 2.0 / 2.0)  # EMAs: policy 2, aux 2
    assert AdaptiveWeight(0.1).update(5.0, 1e-9) == pytest.approx(1.0)  # capped at 10 x base


def records():
    return [
        wm_record(i, rollout="") | {"s_next": nxt}
        for i, nxt in enumerate(
            [
                "You arrive at fridge 1. The fridge 1 is closed.",
                "Nothing happens.",
                "You open the fridge 1.",
                "You pick up the mug 1 from the countertop 1.",
            ]
        )
    ]


def test_off_by_default_and_on_with_its_switch(tiny_model_dir):
    off = make_trainer(tiny_model_dir, autocast="off")
    mb = {"transitions": records(), "demos": [demo_record(0)]}
    assert not any(k.startswith("policy/wm_aux") for k in off.train_step([mb]))
    on = make_trainer(tiny_model_dir, autocast="off", policy_wm_aux=0.2)
    metrics = on.train_step([mb])
    assert metrics["policy/wm_aux_selected"] == 2 and metrics["policy/wm_aux_weight"] > 0


def test_it_trains_on_the_transitions_the_policy_is_least_sure_of(tiny_model_dir):
    from learner.packing import pack
    from learner.peft_model import activate

    trainer = make_trainer(tiny_model_dir, autocast="off", policy_wm_aux=0.2)
    recs, enc = records(), trainer.encoder
    activate(trainer.model, "policy", trainable=False)
    with torch.no_grad():  # the expected term, by hand, before the step changes the weights
        entropies = []
        for r in recs:
            seq = enc.draft({"s": r["s"], "target": r["a_exec"]})
            entropies.append(float(token_entropy(trainer.forward.target_logits(pack([[seq]], trainer.pad_id))).mean()))
        top = sorted(range(len(recs)), key=lambda i: -entropies[i])[:2]
        packed = pack([[enc.world_model_ce(recs[i])] for i in top], trainer.pad_id)
        expected = generalized_ce(trainer.forward.target_logits(packed), packed.targets, 0.7).item()
    metrics = trainer.train_step([{"transitions": recs, "demos": [demo_record(0)]}])
    assert metrics["policy/wm_aux"] == pytest.approx(expected, rel=1e-4)
    assert metrics["policy/wm_aux_entropy"] == pytest.approx(sum(entropies) / 4, rel=1e-4)


def test_acting_entropy_selects_the_drafts_the_actor_was_least_sure_of(tiny_model_dir):
    from learner.packing import pack
    from learner.peft_model import activate

    trainer = make_trainer(tiny_model_dir, autocast="off", policy_wm_aux=0.2, paw_entropy="acting")
    # an unmeasured confidence (None) is no candidate: 3 candidates, half of them -> 2
    recs = [r | {"draft_confidence": c} for r, c in zip(records(), [0.9, 0.2, None, 0.5])]
    activate(trainer.model, "policy", trainable=False)
    with torch.no_grad():
        packed = pack([[trainer.encoder.world_model_ce(recs[i])] for i in (1, 3)], trainer.pad_id)
        expected = generalized_ce(trainer.forward.target_logits(packed), packed.targets, 0.7).item()
    metrics = trainer.train_step([{"transitions": recs, "demos": [demo_record(0)]}])
    assert metrics["policy/wm_aux_selected"] == 2
    assert metrics["policy/wm_aux"] == pytest.approx(expected, rel=1e-4)
    assert metrics["policy/wm_aux_entropy"] == pytest.approx(-(math.log(0.9) + math.log(0.2) + math.log(0.5)) / 3)
    none = [r | {"draft_confidence": None} for r in records()]
    assert not any(
        k.startswith("policy/wm_aux") for k in trainer.train_step([{"transitions": none, "demos": [demo_record(0)]}])
    )


def test_the_turns_form_takes_pa_w_with_the_actors_entropy():
    """PaW's entropy follows the prompt form: the learner's policy's in the window form, the actors' (their
    drafts' confidence, which ``actor.reflect_confidence`` measures) in the turns forms."""
    from comap_async.config import load_config
    from learner.paw import paw_entropy

    assert paw_entropy(load_config(None, ["learner.policy_wm_aux=0.2"])) == "prompt"
    turns = ["env.prompt_form=draft_turns", "learner.policy_wm_aux=0.2"]
    with pytest.raises(ValueError, match="reflect_confidence"):
        load_config(None, [*turns, "actor.reflect_confidence=false"])
    cfg = load_config(None, [*turns, "actor.reflect_confidence=true"])
    assert paw_entropy(cfg) == "acting"
    assert paw_entropy(load_config(None, ["env.prompt_form=all_turns", "actor.reflect_confidence=true"])) == "acting"
