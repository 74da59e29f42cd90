"""Each loss on hand-made tensors; EMA is real weight averaging."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comap_async.method.decision import revise_probability
from learner import losses
from learner.ema import ema_update, paired_lora_tensors
from learner.peft_model import adapter_parameters
from tests.fixtures.learner import demo_record, make_trainer, reflection_record, wm_record


def test_kl_zero_when_logits_match_and_positive_otherwise():
    torch.manual_seed(0)
    s = torch.randn(2, 3, 7)
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert losses.self_distillation_kl(s, s.clone(), mask).item() == pytest.approx(0.0, abs=1e-7)
    assert losses.self_distillation_kl(s, s + 5.0, mask).item() == pytest.approx(0.0, abs=1e-6)  # shift-invariant
    t = torch.randn(2, 3, 7)
    kl = losses.self_distillation_kl(s, t, mask)
    assert kl.item() > 0
    expected = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1).mean()
    assert kl.item() == pytest.approx(expected.item(), rel=1e-5)


def test_kl_counts_only_rollout_tokens():
    torch.manual_seed(1)
    s, t = torch.randn(1, 4, 5), torch.randn(1, 4, 5)
    mask = torch.tensor([[True, True, False, False]])
    t_changed = t.clone()
    t_changed[0, 2:] = torch.randn(2, 5) * 10  # outside the rollout: must not matter
    assert losses.self_distillation_kl(s, t, mask) == losses.self_distillation_kl(s, t_changed, mask)
    assert losses.self_distillation_kl(s, t, torch.zeros_like(mask)).item() == 0.0


def test_kl_has_no_teacher_gradient():
    s = torch.randn(1, 2, 4, requires_grad=True)
    t = torch.randn(1, 2, 4, requires_grad=True)
    losses.self_distillation_kl(s, t, torch.ones(1, 2, dtype=torch.bool)).backward()
    assert s.grad is not None and t.grad is None


def test_rollout_positions_align_predicting_logits():
    pos, mask = losses.rollout_positions(torch.tensor([3, 5]), torch.tensor([2, 1]), seq_len=8)
    assert pos.tolist() == [[2, 3], [4, 5]] and mask.tolist() == [[True, True], [True, False]]


def test_bce_matches_torch_on_two_token_probability():
    torch.manual_seed(2)
    logits = torch.randn(5, 11)
    keep, revise = 3, 7
    y = torch.tensor([1, 0, 1, 1, 0])
    p = torch.softmax(torch.stack([logits[:, keep], logits[:, revise]], -1), -1)[:, 1]
    expected = F.binary_cross_entropy(p, y.float())
    assert losses.revise_bce(logits, keep, revise, y).item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.allclose(revise_probability(logits[:, keep], logits[:, revise]), p)


def test_masked_prompt_tokens_contribute_nothing():
    torch.manual_seed(3)
    logits = torch.randn(1, 5, 9)
    labels = torch.tensor([[-100, -100, 4, 2, -100]])
    base = losses.masked_token_ce(logits, labels)
    changed = logits.clone()
    changed[0, 0] = torch.randn(9) * 50  # predicts a masked prompt token (position 1)
    changed[0, 4] = torch.randn(9) * 50  # the last position predicts nothing
    assert losses.masked_token_ce(changed, labels) == base
    expected = F.cross_entropy(logits[0, 1:3], torch.tensor([4, 2]))
    assert base.item() == pytest.approx(expected.item(), rel=1e-6)
    assert losses.masked_token_ce(logits, torch.full((1, 5), -100)).item() == 0.0


def test_ema_after_one_step_and_frozen_base(tiny_trainer):
    model = tiny_trainer.model
    old_teacher = {n: p.detach().clone() for n, p in adapter_parameters(model, "wm_teacher")}
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    assert base_before
    tiny_trainer.train_step(
        [{"transitions": [wm_record(0), wm_record(1)], "demos": [demo_record()], "reflections": [reflection_record(1)]}]
    )
    params = dict(model.named_parameters())
    checked = 0
    for name, old in old_teacher.items():
        student = params[name.replace(".wm_teacher.", ".wm.")].detach()
        assert torch.allclose(params[name].detach(), 0.99 * old + 0.01 * student, atol=1e-7), name
        checked += 1
    assert checked == len(paired_lora_tensors(model)) > 0
    # the student moved (so the check above is not trivially true)
    assert any(not torch.equal(params[n.replace(".wm_teacher.", ".wm.")], old) for n, old in old_teacher.items())
    for name, before in base_before.items():
        assert torch.equal(params[name].detach(), before), f"base weight {name} changed"


def test_ema_update_is_weight_averaging():
    t, s = torch.ones(3), torch.full((3,), 3.0)
    ema_update([(t, s)], 0.75)
    assert torch.allclose(t, torch.full((3,), 1.5))


def test_balanced_bce_weighs_each_label_alike_and_is_plain_on_a_balanced_mix():
    torch.manual_seed(3)
    logits = torch.randn(4, 11)
    keep, revise = 3, 7
    y = torch.tensor([1, 1, 1, 0])
    w = losses.label_balance_weights(y, (25, 75))  # 75 % REVISE seen so far
    assert w.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0])
    logp = torch.log_softmax(torch.stack([logits[:, keep], logits[:, revise]], -1), -1)
    per = -torch.where(y == 1, logp[:, 1], logp[:, 0])
    assert losses.revise_bce(logits, keep, revise, y, w).item() == pytest.approx((per * w).mean().item(), rel=1e-5)
    # the two labels' total weights are equal on the mix they were computed from
    assert float(w[y == 1].sum()) / 3 * 75 == pytest.approx(float(w[y == 0].sum()) * 25)
    assert losses.label_balance_weights(y, (40, 40)).tolist() == [1.0] * 4
    assert losses.label_balance_weights(y, (0, 0)).tolist() == [1.0] * 4  # nothing seen yet: unweighted


def test_trainer_balances_the_bce_by_the_labels_it_has_trained_on(tiny_trainer, tmp_path):
    from learner.checkpoint import load_checkpoint, save_checkpoint

    tiny_trainer.method = tiny_trainer.method.model_copy(update={"bce_balance": True})
    refl = [reflection_record(1), reflection_record(1), reflection_record(1), reflection_record(0)]
    tiny_trainer.train_step([{"reflections": refl}])
    assert tiny_trainer.label_counts == [1, 3]
    # wired into the loss: at counts 1:3 the lone KEEP sample weighs 3 times each REVISE one
    _, _, balanced, _ = tiny_trainer.policy_losses([], refl)
    tiny_trainer.method = tiny_trainer.method.model_copy(update={"bce_balance": False})
    _, _, plain, _ = tiny_trainer.policy_losses([], refl)
    _, _, keep_only, _ = tiny_trainer.policy_losses([], refl[3:])
    _, _, revise_only, _ = tiny_trainer.policy_losses([], refl[:3])
    expected = (3 * (2 / 3) * float(revise_only) + 2 * float(keep_only)) / 4
    assert float(balanced) == pytest.approx(expected, rel=1e-4)
    assert float(plain) == pytest.approx((3 * float(revise_only) + float(keep_only)) / 4, rel=1e-4)
    path = save_checkpoint(tmp_path, tiny_trainer, {})
    tiny_trainer.label_counts = [0, 0]
    load_checkpoint(path, tiny_trainer)
    assert tiny_trainer.label_counts == [1, 3]  # resumed, the balance goes on where it was


@pytest.mark.parametrize("reference", [False, True])
def test_the_gates_own_labels_leave_the_bce_when_switched_off(tiny_model_dir, reference):
    """``method.bce_gate_labels`` false: only suffix-labelled samples train ``p``; the gate's samples
    still train the reflection's text, and the label counts (``bce_balance``) leave them out too."""
    suffix = [dict(reflection_record(1), source="suffix"), dict(reflection_record(0), source="suffix")]
    gate = [dict(reflection_record(0), source="gate"), dict(reflection_record(0), source="gate")]
    tiny_trainer = make_trainer(tiny_model_dir, reference=reference)
    tiny_trainer.method = tiny_trainer.method.model_copy(update={"bce_balance": False, "bce_gate_labels": True})
    _, reflect_all, bce_all, _ = tiny_trainer.policy_losses([], suffix + gate)
    _, _, bce_suffix, _ = tiny_trainer.policy_losses([], suffix)
    _, _, bce_gate, _ = tiny_trainer.policy_losses([], gate)
    assert float(bce_all) == pytest.approx((float(bce_suffix) + float(bce_gate)) / 2, rel=1e-4)
    tiny_trainer.method = tiny_trainer.method.model_copy(update={"bce_gate_labels": False})
    _, reflect_off, bce_off, _ = tiny_trainer.policy_losses([], suffix + gate)
    assert float(bce_off) == pytest.approx(float(bce_suffix), rel=1e-4)
    assert float(bce_off) != pytest.approx(float(bce_all), rel=1e-3)
    assert float(reflect_off) == pytest.approx(float(reflect_all), rel=1e-5)  # the text is trained alike
    _, _, bce_none, _ = tiny_trainer.policy_losses([], gate)
    assert float(bce_none) == 0.0  # no sample carries a label p may learn from
    tiny_trainer.label_counts = [0, 0]
    tiny_trainer.train_step([{"reflections": suffix + gate}])
    assert tiny_trainer.label_counts == [1, 1]
