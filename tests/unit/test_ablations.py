"""Training ablations: each switch changes exactly the one mechanism it
names, shown on the config, the learner's store requests and phases, and the tiny model's
training step. (The world-state gate ablations: tests/unit/test_gates.py.)"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import get_args

import pytest
import torch

from comap_async.config import ABLATIONS, AblationName, ConfigError, ablations, load_config
from comap_async.method.gates import SampleRule
from comap_async.method.routing import PHASE_STORES, phase_stores, store_requests
from comap_async.wire.messages import COEVOLVE, REFLECT_INIT, ROLES, WARMUP
from learner.loop import Learner, LearnerState
from learner.peft_model import adapter_state
from tests.fixtures.learner import demo_record, make_trainer, reflection_record, wm_record

ROLLOUT = "You arrive at fridge 1. The fridge 1 is open."


def batch():
    return {
        "transitions": [wm_record(i, rollout=ROLLOUT) for i in range(2)],
        "demos": [demo_record(i) for i in range(2)],
        "reflections": [reflection_record(1), reflection_record(0)],
    }


# ------------------------------------------------------------------ config
def test_the_ablations_are_one_sorted_set_of_names_that_refuses_contradictions(tmp_path):
    assert load_config(None).method.ablation == [] and set(ABLATIONS) == set(get_args(AblationName))
    cfg = load_config(None, ["method.ablation=[no_ws_gate_real, frozen_wm, no_ws_gate_real]"])
    assert cfg.method.ablation == ["frozen_wm", "no_ws_gate_real"]  # duplicates collapse, order-free, stored sorted
    one = load_config(None, ["method.ablation=frozen_wm"])
    assert one.method.ablation == ["frozen_wm"]  # one name, without brackets
    f = tmp_path / "frozen.yaml"
    f.write_text("method:\n  ablation: [no_action_gate, frozen_wm]\n")
    both = ablations(["no_action_gate", "frozen_wm"])
    assert load_config(f).method.ablation == ["frozen_wm", "no_action_gate"] == both
    assert SampleRule.from_config(cfg).future_state == "real"
    imagined = load_config(None, ["method.ablation=no_ws_gate_imagined"])
    assert SampleRule.from_config(imagined).future_state == "imagined"
    assert SampleRule.from_config(load_config(None)) == SampleRule()  # CoMap itself: the gates, the defaults
    with pytest.raises(ConfigError, match="method.ablation: no_wmsd and no_real_ce together leave the world model"):
        load_config(None, ["method.ablation=[no_wmsd, no_real_ce]"])
    with pytest.raises(ConfigError, match="contradict"):
        load_config(None, ["method.ablation=[no_ws_gate_real, no_ws_gate_imagined]"])
    with pytest.raises(ConfigError, match="method.ablation.0: Input should be 'frozen_wm', .*got 'no_wmsdd'"):
        load_config(None, ["method.ablation=no_wmsdd"])
    with pytest.raises(ValueError, match="contradict"):
        ablations(["no_ws_gate_real", "no_ws_gate_imagined"])  # a run's recorded list is checked as the field is


def test_the_switches_written_the_old_way_get_the_list_in_one_line(tmp_path):
    """``ablation: {frozen_wm: true}`` and ``--set ablation.frozen_wm=true`` (the ten booleans before the
    list) are refused with the line naming the new form, on defaults and on a config that has the list."""
    new = "now one list of the ablations switched on: method.ablation: [frozen_wm]"
    f = tmp_path / "old.yaml"
    f.write_text("ablation:\n  frozen_wm: true\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    assert str(exc.value) == f"{f}: ablation.frozen_wm: removed: {new}"
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["ablation.frozen_wm=true"])
    assert str(exc.value) == f"<defaults> (with --set): ablation.frozen_wm: removed: {new}"
    f.write_text("ablation: [no_action_gate]\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f, ["ablation.frozen_wm=true"])
    assert str(exc.value) == f"--set 'ablation.frozen_wm=true': ablation.frozen_wm: removed: {new}"
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["method.ablation={}"])
    assert "\n" not in str(exc.value) and "ablation: a list of the ablations switched on" in str(exc.value)


def test_the_list_outside_the_method_section_gets_its_new_place_in_one_line(tmp_path):
    """``ablation: [...]`` at the top level (before the method's section) and ``--set ablation=...``."""
    f = tmp_path / "old.yaml"
    f.write_text("ablation: [frozen_wm]\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    assert str(exc.value) == f"{f}: ablation: removed: now method.ablation"
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["ablation=[frozen_wm, no_action_gate]"])
    assert str(exc.value) == "<defaults> (with --set): ablation: removed: now method.ablation"


# ------------------------------------------------------------------ what the learner samples
@pytest.mark.parametrize(
    "name, phase, dropped",
    [
        ("frozen_wm", WARMUP, set()),
        ("frozen_wm", REFLECT_INIT, set()),
        ("frozen_wm", COEVOLVE, {"transitions"}),
        ("no_wm_warmup", WARMUP, {"transitions"}),
        ("no_wm_warmup", COEVOLVE, set()),
        ("no_expert_sft", WARMUP, set()),
        ("no_expert_sft", REFLECT_INIT, {"demos"}),
        ("no_expert_sft", COEVOLVE, {"demos"}),
        ("no_wmsd", COEVOLVE, set()),
        ("no_reflect_init", COEVOLVE, set()),
    ],
)
def test_phase_stores_drop_only_the_ablated_data(name, phase, dropped):
    ablation = [name]
    assert set(PHASE_STORES[phase]) - set(phase_stores(phase, ablation)) == dropped
    assert phase_stores(phase, []) == phase_stores(phase) == PHASE_STORES[phase]
    shares = {"transitions": 0.5, "reflections": 0.5}
    requested = {store for store, _, _ in store_requests(phase, 8, shares, random.Random(0), ablation)}
    assert requested == set(phase_stores(phase, ablation))  # warm-up anchors of frozen_wm's world model too


def _next_phase(ablation: list[str], phase: str, step: int) -> str | None:
    cfg = load_config(None, ["learner.phases.warmup.steps=2", "learner.phases.reflect_init.steps=3"])
    cfg = cfg.model_copy(update={"method": cfg.method.model_copy(update={"ablation": ablation})})
    learner = SimpleNamespace(cfg=cfg, state=LearnerState(phase=phase), trainer=SimpleNamespace(step=step))
    return Learner.next_phase(learner)


def test_no_reflect_init_goes_from_warmup_to_coevolution():
    assert _next_phase([], WARMUP, 2) == REFLECT_INIT
    assert _next_phase(["no_reflect_init"], WARMUP, 2) == COEVOLVE
    assert _next_phase(["no_reflect_init"], WARMUP, 1) is None


# ------------------------------------------------------------------ the training step
@pytest.mark.parametrize("reference", [False, True])
def test_no_wmsd_drops_the_kl_term(tiny_model_dir, monkeypatch, reference):
    full = make_trainer(tiny_model_dir, reference=reference).train_step([batch()])
    trainer = make_trainer(tiny_model_dir, reference=reference)
    trainer.ablation = ["no_wmsd"]
    monkeypatch.setattr(trainer, "teacher_logits", lambda seqs: pytest.fail("the teacher ran under no_wmsd"))
    m = trainer.train_step([batch()])
    assert "wm/kl" not in m and "wm/kl" in full and full["wm/kl"] > 0
    # same model, same seed, same records: the CE is unchanged and is the whole loss
    assert m["wm/ce"] == pytest.approx(full["wm/ce"], rel=1e-5) and m["wm/loss"] == pytest.approx(m["wm/ce"], rel=1e-6)


@pytest.mark.parametrize("reference", [False, True])
def test_no_real_ce_keeps_only_self_distillation(tiny_model_dir, reference):
    full = make_trainer(tiny_model_dir, reference=reference).train_step([batch()])
    trainer = make_trainer(tiny_model_dir, reference=reference)
    trainer.ablation = ["no_real_ce"]
    m = trainer.train_step([batch()])
    assert "wm/ce" not in m and "wm/change_nll" not in m
    assert m["wm/kl"] == pytest.approx(full["wm/kl"], rel=1e-5)
    assert m["wm/loss"] == pytest.approx(trainer.method.eta * m["wm/kl"], rel=1e-6)
    assert trainer.train_step([{"transitions": [wm_record(0, rollout="")]}])["learner/tokens"] == 0  # nothing to distil


def test_frozen_wm_keeps_world_model_and_teacher_identical(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir)
    trainer.train_step([batch()])  # warm-up: the world model trains and the teacher follows it
    before = {role: adapter_state(trainer.model, role) for role in ROLES}
    trainer.freeze_wm = True  # co-evolution under the ablation frozen_wm (the learner sets it per step)
    for _ in range(3):
        m = trainer.train_step([batch()])
    after = {role: adapter_state(trainer.model, role) for role in ROLES}
    for role in ("wm", "wm_teacher"):
        for k in before[role]:
            assert torch.equal(before[role][k], after[role][k]), (role, k)
    assert any(not torch.equal(before["policy"][k], after["policy"][k]) for k in before["policy"])  # policy trains
    assert not any(k.startswith("wm/") for k in m) and m["learner/grad_norm_wm"] == 0.0


def test_no_future_state_leaves_the_imagined_state_out_of_every_reflection_prompt(tiny_model_dir):
    """In the actors' reflection call and in the learner's reflection samples alike; the other
    prompts are unchanged."""
    from comap_async.prompts import ChatTemplate, Prompts
    from learner.batches import Encoder

    chat = ChatTemplate.from_model_dir(tiny_model_dir)
    full, ablated = Prompts(chat), Prompts(chat, future_state=False)
    imagined = "You arrive at fridge 1. The fridge 1 is closed."
    assert imagined in full.reflect("Task: cool a mug.", "go to fridge 1", imagined)
    prompt = ablated.reflect("Task: cool a mug.", "go to fridge 1", imagined)
    assert imagined not in prompt and "Imagined result" not in prompt and "Your draft action: go to fridge 1" in prompt
    assert ablated.world_model("s", "a") == full.world_model("s", "a") and ablated.draft("s") == full.draft("s")
    trainer = make_trainer(tiny_model_dir)
    record = reflection_record(1)
    for prompts, shown in ((full, True), (ablated, False)):
        enc = Encoder(trainer.encoder.tokenizer, prompts, trainer.encoder.max_seq_len)
        text = trainer.encoder.tokenizer.decode(enc.reflection(record).ids)
        assert (record["s_bar"] in text) is shown and record["target"] in text
