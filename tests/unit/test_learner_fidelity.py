"""The learner's fidelity to the paper: per-phase LR schedule, per-role clipping, a dropout-free
teacher, phase-tagged micro-batches and phase-filtered sampling (docs/design.md sections 5, 6, 11)."""

from __future__ import annotations

import asyncio
import random

import msgpack
import pytest
import torch

from broker.replay_sampling import sample
from broker.store import ReplayStore, WriteItem
from comap_async.config import LearnerConfig
from learner.checkpoint import latest, load_checkpoint, save_checkpoint
from tests.fixtures.learner import demo_record, make_trainer, reflection_record, wm_record

ROLLOUT = "You arrive at fridge 1. The fridge 1 is open."


# ---------------------------------------------------------------- point 7: LR schedule per phase


def _schedule(**cfg):
    from learner.schedule import PhaseSchedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return PhaseSchedule(opt, LearnerConfig(**cfg))  # the run's warm-up share, learner.schedule.WARMUP_RATIO


def _phases(warmup: int, reflect_init: int, coevolve: int, /, **peak_lr: float) -> dict:
    """``learner.phases`` with these step budgets, and a phase's own peak rate where named."""
    steps = {"warmup": warmup, "reflect_init": reflect_init, "coevolve": coevolve}
    return {phase: {"steps": n, **({"lr": peak_lr[phase]} if phase in peak_lr else {})} for phase, n in steps.items()}


def test_each_phase_warms_up_to_the_peak_and_decays_over_its_own_budget():
    """configs/local.yaml's budgets: warm-up SFT (20 steps) reaches the peak rate and ends near the
    floor; reflection initialisation starts its own warm-up; co-evolution decays over
    ``phases.coevolve.steps`` from its own start and stays flat at the floor afterwards."""
    lr = 1e-4
    sched = _schedule(lr=lr, phases=_phases(20, 5, 1000))
    warm = [sched.lr_at(s) for s in range(20)]
    assert max(warm) == pytest.approx(lr) and warm[-1] < 0.2 * lr
    sched.enter("reflect_init", 20)
    refl = [sched.lr_at(s) for s in range(20, 25)]
    assert refl[0] == pytest.approx(lr) and refl == sorted(refl, reverse=True)
    sched.enter("coevolve", 25)
    co = [sched.lr_at(s) for s in range(25, 25 + 1200)]
    assert co[:30] == sorted(co[:30]) and co[29] == pytest.approx(lr)  # 30 = 3% of 1000 steps of warm-up
    assert co[1000] == pytest.approx(0.1 * lr) and co[-1] == co[1000]  # flat at the floor after its steps
    with pytest.raises(ValueError, match="unknown phase"):
        sched.enter("rounds", 0)


def test_reflection_initialisation_peaks_at_its_own_rate_when_set():
    sched = _schedule(lr=1e-3, phases=_phases(20, 5, 100, reflect_init=2e-4))
    assert max(sched.lr_at(s) for s in range(20)) == pytest.approx(1e-3)
    sched.enter("reflect_init", 20)
    assert sched.lr_at(20) == pytest.approx(2e-4) and max(sched.lr_at(s) for s in range(20, 25)) == pytest.approx(2e-4)
    sched.enter("coevolve", 25)
    assert max(sched.lr_at(s) for s in range(25, 125)) == pytest.approx(1e-3)  # co-evolution: back to lr


def test_coevolution_peaks_at_its_own_rate_when_set():
    sched = _schedule(lr=1e-3, phases=_phases(20, 5, 100, coevolve=1e-4))
    sched.enter("reflect_init", 20)
    assert max(sched.lr_at(s) for s in range(20, 25)) == pytest.approx(1e-3)  # reflect_init's lr unset: lr
    sched.enter("coevolve", 25)
    co = [sched.lr_at(s) for s in range(25, 125)]
    assert max(co) == pytest.approx(1e-4) and co[3] == pytest.approx(1e-4)  # 3 = 3% of 100 steps of warm-up


def test_train_step_uses_the_phase_schedule(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, lr=1e-3, warmup_ratio=0.5, phases=_phases(4, 3, 8))
    got = [trainer.train_step([{"demos": [demo_record(0)]}])["learner/lr"] for _ in range(4)]
    trainer.scheduler.enter("reflect_init", 4)
    got += [trainer.train_step([{"demos": [demo_record(0)]}])["learner/lr"] for _ in range(3)]
    # warm-up: 2 warm-up steps of 4, then the cosine from the peak; reflect_init: 1 of 3, then the cosine
    assert got == pytest.approx([5e-4, 1e-3, 1e-3, 5.5e-4, 1e-3, 1e-3, 5.5e-4])
    assert trainer.optimizer.param_groups[0]["lr"] == got[-1]  # the rate the optimizer stepped with


def test_a_resumed_trainer_gets_the_same_rate_as_an_uninterrupted_one(tiny_model_dir, tmp_path):
    kw = dict(lr=1e-3, warmup_ratio=0.5, phases=_phases(2, 6, 8))
    a = make_trainer(tiny_model_dir, **kw)
    for _ in range(2):
        a.train_step([{"demos": [demo_record(0)]}])
    a.scheduler.enter("reflect_init", 2)
    for _ in range(2):
        a.train_step([{"demos": [demo_record(0)]}])
    save_checkpoint(tmp_path, a, {"state": {"phase": "reflect_init", "phase_start": 2}})
    expected = [a.train_step([{"demos": [demo_record(0)]}])["learner/lr"] for _ in range(2)]
    b = make_trainer(tiny_model_dir, **kw)  # a fresh trainer starts in warm-up at step 0
    load_checkpoint(latest(tmp_path), b)
    assert (b.scheduler.phase, b.scheduler.phase_start, b.step) == ("reflect_init", 2, 4)
    assert [b.train_step([{"demos": [demo_record(0)]}])["learner/lr"] for _ in range(2)] == expected


# ---------------------------------------------------------------- point 7: clipping per role


def _policy_grads_at_update(trainer, micro):
    from learner.peft_model import adapter_parameters

    seen = {}
    step = trainer.optimizer.step

    def capture(*a, **kw):  # the gradients the optimizer is about to apply, after clipping
        for role in ("policy", "wm"):
            seen[role] = [p.grad.clone() for _, p in adapter_parameters(trainer.model, role) if p.grad is not None]
        return step(*a, **kw)

    trainer.optimizer.step = capture
    metrics = trainer.train_step(micro)
    return seen, metrics


def test_a_large_world_model_gradient_does_not_scale_the_policy_gradient(tiny_model_dir):
    """The world-model gradient (norm well above 1) is clipped to 1 on its own; the policy gradient
    is exactly what it is when the policy trains alone (joint clipping scaled it down)."""
    wm = [wm_record(i, rollout=ROLLOUT) for i in range(2)]
    both, m = _policy_grads_at_update(
        make_trainer(tiny_model_dir, draft_weight=0.01), [{"transitions": wm, "demos": [demo_record(0)]}]
    )
    alone, m_alone = _policy_grads_at_update(
        make_trainer(tiny_model_dir, draft_weight=0.01), [{"demos": [demo_record(0)]}]
    )
    assert len(both["policy"]) == len(alone["policy"]) > 0
    for g, h in zip(both["policy"], alone["policy"]):
        assert torch.equal(g, h)
    assert m["learner/grad_norm_wm"] > 2.0 and 0 < m["learner/grad_norm_policy"] < 1.0  # joint clipping would bite
    assert m["learner/grad_norm_policy"] == pytest.approx(m_alone["learner/grad_norm_policy"])
    assert m["learner/grad_norm"] == pytest.approx(
        (m["learner/grad_norm_wm"] ** 2 + m["learner/grad_norm_policy"] ** 2) ** 0.5
    )
    wm_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in both["wm"]]))
    assert wm_norm == pytest.approx(1.0, rel=1e-3)


# ---------------------------------------------------------------- point 8: teacher without dropout


def test_teacher_logits_inside_a_train_step_are_an_eval_mode_forward(tiny_model_dir, monkeypatch):
    """With LoRA dropout 0.5 the teacher's logits (the distillation target) equal a dropout-free
    forward of the teacher adapter; in train mode they were a noisy sample."""
    from learner import losses
    from learner.peft_model import activate, adapter_parameters
    from tests.fixtures.reference_path import collate, window_logits

    trainer = make_trainer(tiny_model_dir, lora_dropout=0.5)
    torch.manual_seed(1)
    with torch.no_grad():  # a teacher that differs from zero-initialised LoRA B, so dropout would show
        for _, p in adapter_parameters(trainer.model, "wm_teacher"):
            p.normal_(0, 0.5)
    rec = wm_record(0, rollout=ROLLOUT)
    _, t_seq = trainer.encoder.world_model_rollout(rec)
    activate(trainer.model, "wm_teacher", trainable=False)
    trainer.model.eval()
    with torch.no_grad():
        logits, win = window_logits(trainer.forward, collate([t_seq], trainer.pad_id))
        pos, _ = losses.rollout_positions(win["starts"], win["lengths"], logits.shape[1])
        expected = losses.gather_positions(logits, pos)

    captured = []
    kl = losses.self_distillation_kl

    def spy(student, teacher, mask):
        captured.append(teacher.detach().clone())
        return kl(student, teacher, mask)

    monkeypatch.setattr(losses, "self_distillation_kl", spy)
    for _ in range(2):  # the teacher changes only by the EMA step after each: compare the first
        trainer.train_step([{"transitions": [rec]}])
    assert torch.allclose(captured[0], expected, atol=1e-5)
    assert trainer.model.training is False  # train_step leaves the model in eval mode, as before


# ---------------------------------------------------------------- point 9: phase-filtered sampling

CAPS = {"transitions": 1000, "reflections": 1000, "demos": 1000, "episodes": 10}


def fill(st: ReplayStore, store: str, phases: list[str | None]) -> None:
    def rec(i, ph):
        return {"id": i, "policy_version": 0, **({"phase": ph} if ph else {})}

    st.write([WriteItem(f"{store}:{i}".encode(), [(store, msgpack.packb(rec(i, ph)))]) for i, ph in enumerate(phases)])


def test_a_phases_filter_serves_only_those_phases_and_counts_the_rest(tmp_path):
    st = ReplayStore(tmp_path, CAPS)
    fill(st, "transitions", ["warmup"] * 190 + ["coevolve"] * 10)
    res = sample(st, "transitions", 4, window=1000, current_policy=0, max_staleness=4, seed=3, phases=["coevolve"])
    assert len(res.items) == 4 and {r["phase"] for r in res.items} == {"coevolve"} and res.phase_skipped > 0
    # more than there are: every matching item once, the scan ends at the window
    res = sample(st, "transitions", 50, window=1000, current_policy=0, max_staleness=4, seed=3, phases=["coevolve"])
    assert sorted(r["id"] for r in res.items) == list(range(190, 200)) and res.phase_skipped == 190
    none = sample(st, "transitions", 4, window=1000, current_policy=0, max_staleness=4, seed=3, phases=["reflect_init"])
    assert none.items == [] and none.phase_skipped == 200
    both = sample(
        st, "transitions", 8, window=1000, current_policy=0, max_staleness=4, seed=3, phases=["warmup", "coevolve"]
    )
    unfiltered = sample(st, "transitions", 8, window=1000, current_policy=0, max_staleness=4, seed=3)
    assert [r["id"] for r in both.items] == [r["id"] for r in unfiltered.items] and both.phase_skipped == 0
    with pytest.raises(ValueError, match="phases"):
        sample(st, "transitions", 4, window=1000, current_policy=0, max_staleness=4, phases=["later"])


def test_reflection_samples_without_a_phase_count_as_reflect_init(tmp_path):
    st = ReplayStore(tmp_path, CAPS)
    fill(st, "reflections", [None] * 5 + ["coevolve"] * 5)  # suffix-labelled samples carry no phase
    res = sample(st, "reflections", 10, window=1000, current_policy=0, max_staleness=4, seed=0, phases=["reflect_init"])
    assert sorted(r["id"] for r in res.items) == list(range(5)) and res.phase_skipped == 5


def test_a_phases_filter_draws_in_proportion_to_n_when_half_match(tmp_path):
    st = ReplayStore(tmp_path, {**CAPS, "transitions": 5000})
    fill(st, "transitions", ["warmup", "coevolve"] * 2000)
    drawn = []
    get_many = st.get_many
    st.get_many = lambda name, idx: (drawn.extend(idx), get_many(name, idx))[1]
    res = sample(st, "transitions", 8, window=4000, current_policy=0, max_staleness=4, seed=1, phases=["coevolve"])
    assert len(res.items) == 8 and len(drawn) <= 64


# ---------------------------------------------------------------- points 3 and 9: what the learner fetches


def test_store_requests_filter_by_phase_and_draw_the_mixed_in_shares():
    from comap_async.method.routing import store_requests

    rng = random.Random(0)
    shares = {"transitions": 0.5, "reflections": 0.5}
    assert store_requests("warmup", 4, shares, rng) == [("demos", 4, None), ("transitions", 4, None)]
    assert store_requests("reflect_init", 4, shares, rng) == [("demos", 4, None), ("reflections", 4, ["reflect_init"])]
    assert store_requests("reflect_init", 2, shares, rng, sizes={"reflections": 6}) == [
        ("demos", 2, None),
        ("reflections", 6, ["reflect_init"]),
    ]  # reflection-mode init trains no world model
    assert store_requests("coevolve", 4, {}, rng) == [
        ("demos", 4, None),
        ("transitions", 4, ["coevolve"]),
        ("reflections", 4, ["coevolve"]),
    ]
    mixed = {"transitions": 0, "reflections": 0}
    total = dict(mixed)
    earlier = {"transitions": ["warmup"], "reflections": ["reflect_init"]}
    for _ in range(500):  # a share for a store nothing is mixed into (transitions) draws nothing
        for store, n, phases in store_requests("coevolve", 4, {"transitions": 0.25, "reflections": 0.5}, rng):
            if store in total:
                total[store] += n
                mixed[store] += n if phases == earlier[store] else 0
    assert total == {"transitions": 2000, "reflections": 2000}
    assert mixed["transitions"] == 0 and 0.45 < mixed["reflections"] / 2000 < 0.55


def test_suffix_labelled_reflection_samples_are_never_stale():
    from broker.replay_sampling import is_stale

    old = {"policy_version": 1, "y": 1}
    assert is_stale(old, current_policy=9, max_staleness=4)
    assert not is_stale({**old, "source": "suffix"}, current_policy=9, max_staleness=4)
    assert not is_stale({**old, "source": "gate"}, current_policy=5, max_staleness=4)


def test_reflection_mode_initialisation_is_sized_by_its_samples_and_capped_in_time():
    from types import SimpleNamespace

    from comap_async.config import load_config
    from learner.loop import Learner, LearnerState

    cfg = load_config(None, ["learner.phases.reflect_init.steps=3", "learner.phases.reflect_init.max_minutes=1"])
    state = LearnerState(phase="reflect_init", phase_start=10, phase_budget=40)
    learner = SimpleNamespace(cfg=cfg, state=state, trainer=SimpleNamespace(step=30))
    assert Learner.next_phase(learner) is None  # 20 of 40 steps: the data's budget, not the phase's steps
    learner.trainer.step = 50
    assert Learner.next_phase(learner) == "coevolve"
    learner.trainer.step, state.phase_seconds = 20, 61.0
    assert Learner.next_phase(learner) == "coevolve"  # out of time


async def test_wait_for_reflections_sizes_the_phase_by_epochs_over_the_samples_held():
    from types import SimpleNamespace

    from comap_async.config import load_config
    from learner.loop import Learner, LearnerState

    class Broker:
        async def get_stats(self):
            return {"stores": {"reflections": {"count": 90}}}

    class Scheduler:
        def enter(self, *args):
            self.entered = args

    def learner_with(*overrides):
        cfg = load_config(
            None,
            [
                "learner.phases.reflect_init.min_samples=64",
                "learner.phases.reflect_init.epochs=1.5",
                "learner.batch_size=4",
                "learner.phases.reflect_init.steps=10",
                *overrides,
            ],
        )
        learner = SimpleNamespace(
            cfg=cfg,
            state=LearnerState(phase="reflect_init", phase_start=7),
            stop=asyncio.Event(),
            trainer=SimpleNamespace(scheduler=Scheduler()),
            dp=None,
            log=SimpleNamespace(info=lambda *a, **k: None),
        )
        learner.wait_for_store = lambda *a: Learner.wait_for_store(learner, *a)
        learner.global_batch = Learner.global_batch.fget(learner)
        learner.wait_for_phase_data = lambda *a: Learner.wait_for_phase_data(learner, *a)
        learner.follow_budget = lambda phase: Learner.follow_budget(learner, phase)
        return learner

    learner = learner_with()
    assert await Learner.wait_for_reflections(learner, Broker()) == 90
    assert learner.state.phase_budget == 34  # ceil(1.5 * 90 / 4)
    assert learner.trainer.scheduler.entered == ("reflect_init", 7, 34)
    # an optimizer step over 2 accumulated micro-batches trains 8 samples: an epoch is half the steps
    learner = learner_with("learner.grad_accum=2")
    await Learner.wait_for_reflections(learner, Broker())
    assert learner.state.phase_budget == 17  # ceil(1.5 * 90 / 8)
    # 6 reflection samples per micro-batch (learner.phases.reflect_init.batch_size): 12 per optimizer step
    learner = learner_with("learner.grad_accum=2", "learner.phases.reflect_init.batch_size=6")
    await Learner.wait_for_reflections(learner, Broker())
    assert learner.state.phase_budget == 12  # ceil(1.5 * 90 / 12), at least the phase's steps (10)


class FakeBroker:
    """``sample`` from in-memory lists, honouring ``phases`` as the broker does."""

    def __init__(self, stores):
        self.stores, self.calls = stores, []

    async def sample(self, store, n, seed=None, phases=None):
        from comap_async.wire.messages import Batch

        self.calls.append((store, n, phases))
        default = {"reflections": "reflect_init"}.get(store)
        items = [r for r in self.stores.get(store, []) if phases is None or (r.get("phase") or default) in phases]
        return Batch(req=0, store=store, items=items[:n], stale_skipped=0, available=len(items))


async def test_the_prefetcher_tags_micro_batches_and_reflect_init_needs_reflections():
    from learner.loop import LearnerState
    from learner.prefetch import Prefetcher

    class Log:
        def info(self, *a, **kw):
            pass

    stores = {"demos": [demo_record(0)], "transitions": [{**wm_record(0), "phase": "warmup"}]}
    state = LearnerState(phase="warmup")
    pf = Prefetcher(FakeBroker(stores), state, 2, 4, 0, Log())
    task = asyncio.create_task(pf.run())
    try:
        mb = await asyncio.wait_for(pf.queue.get(), 5)
        assert mb.phase == "warmup" and set(mb.stores) == {"demos", "transitions"}
        state.phase = "reflect_init"  # no reflection sample yet: nothing is queued for this phase
        while not pf.queue.empty():
            pf.queue.get_nowait()
        await asyncio.sleep(1.2)
        assert all(m.phase == "warmup" for m in list(pf.queue._queue))  # only what was in flight
        while not pf.queue.empty():
            pf.queue.get_nowait()
        stores["reflections"] = [reflection_record(1), {**reflection_record(0), "phase": "coevolve"}]
        mb = await asyncio.wait_for(pf.queue.get(), 5)
        while mb.phase != "reflect_init":
            mb = await asyncio.wait_for(pf.queue.get(), 5)
        assert mb.stores["reflections"] == [reflection_record(1)]  # the suffix-labelled sample only
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_revise_label_share_is_the_share_of_y1_among_trained_reflection_samples(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, grad_accum=2)
    m = trainer.train_step(
        [
            {"reflections": [reflection_record(1), reflection_record(0)]},
            {"reflections": [reflection_record(1), reflection_record(1)]},
        ]
    )
    assert m["policy/revise_label_share"] == pytest.approx(0.75)
    assert "policy/revise_label_share" not in trainer.train_step([{"demos": [demo_record(0)]}])


def test_learner_config_rejects_a_phase_setting_out_of_range():
    with pytest.raises(ValueError):
        LearnerConfig(phases={"coevolve": {"lr": 0.0}})
    with pytest.raises(ValueError):
        LearnerConfig(phases={"reflect_init": {"min_samples": 0}})
