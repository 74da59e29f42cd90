"""The learn step on the tiny model: every loss falls; checkpoints restore bit-identical state."""

from __future__ import annotations

import torch

from comap_async.wire.messages import ROLES
from learner.checkpoint import latest, load_checkpoint, save_checkpoint
from learner.peft_model import adapter_state
from tests.fixtures.learner import demo_record, make_trainer, reflection_record, wm_record

LOSSES = ("wm/ce", "wm/kl", "policy/draft_ce", "policy/reflect_ce", "policy/bce")


def fixed_batch():
    return {
        "transitions": [wm_record(i, rollout="You arrive at fridge 1. The fridge 1 is open.") for i in range(2)],
        "demos": [demo_record(i) for i in range(2)],
        "reflections": [reflection_record(1), reflection_record(0)],
    }


def test_each_loss_falls_by_half(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, lr=1e-2, bce_weight=1.0)
    first = trainer.train_step([fixed_batch()])
    for _ in range(40):
        last = trainer.train_step([fixed_batch()])
    for name in LOSSES:
        assert first[name] > 0, name
        assert last[name] <= 0.5 * first[name], f"{name}: {first[name]:.3f} -> {last[name]:.3f}"
    assert last["learner/tokens_per_s"] > 0


def test_grad_accumulation_splits_micro_batches(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, grad_accum=2)
    m = trainer.train_step([{"transitions": [wm_record(0)]}, {"demos": [demo_record(0)]}])
    assert trainer.step == 1 and "wm/ce" in m and "policy/draft_ce" in m


def _snapshot(trainer):
    adapters = {r: adapter_state(trainer.model, r) for r in ROLES}
    opt = trainer.optimizer.state_dict()["state"]
    return adapters, {k: {n: v.clone() for n, v in s.items()} for k, s in opt.items()}


def test_checkpoint_round_trip_is_bit_identical(tiny_model_dir, tmp_path):
    a = make_trainer(tiny_model_dir, lora_dropout=0.05)
    for _ in range(3):
        a.train_step([fixed_batch()])
    save_checkpoint(tmp_path, a, {"phase": "coevolve", "version": 2})
    saved = _snapshot(a)
    # a's own next step runs now, before b's construction re-seeds the process-global RNG
    ma = a.train_step([fixed_batch()])
    assert latest(tmp_path).name == "step-00000003"
    b = make_trainer(tiny_model_dir, lora_dropout=0.05)
    extra = load_checkpoint(latest(tmp_path), b)
    assert extra == {"phase": "coevolve", "version": 2} and b.step == 3
    (ad_a, opt_a), (ad_b, opt_b) = saved, _snapshot(b)
    for role in ROLES:
        assert ad_a[role].keys() == ad_b[role].keys()
        for k in ad_a[role]:
            assert torch.equal(ad_a[role][k], ad_b[role][k]), (role, k)
    assert opt_a.keys() == opt_b.keys()
    for k in opt_a:
        for n in opt_a[k]:
            assert torch.equal(opt_a[k][n], opt_b[k][n])
    # the next step, dropout RNG included, is identical too
    mb = b.train_step([fixed_batch()])
    assert ma["wm/ce"] == mb["wm/ce"] and ma["policy/loss"] == mb["policy/loss"]
    for k, v in adapter_state(a.model, "wm_teacher").items():
        assert torch.equal(v, adapter_state(b.model, "wm_teacher")[k])


def test_interrupted_checkpoint_is_ignored(tiny_model_dir, tmp_path):
    a = make_trainer(tiny_model_dir)
    a.train_step([fixed_batch()])
    save_checkpoint(tmp_path, a, {})
    (tmp_path / ".tmp-half").mkdir()  # a learner killed mid-write leaves only a temp dir
    (tmp_path / "step-00000009").mkdir()  # or a directory without its state file
    assert latest(tmp_path).name == "step-00000001"


def test_a_pinned_checkpoint_outlives_the_rotation(tiny_model_dir, tmp_path):
    """A phase's first checkpoint stays (a fork redoes the phase from it); the others rotate."""
    a = make_trainer(tiny_model_dir)
    for step in range(1, 7):
        a.step = step  # the rotation reads only the step's number
        save_checkpoint(tmp_path, a, {}, keep=2, pin=step == 2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000005", "step-00000006"]
    assert latest(tmp_path).name == "step-00000006"


def test_the_pinned_checkpoints_version_keeps_its_adapters(tiny_model_dir, tmp_path):
    """The adapters published at a pinned checkpoint's step outlive the adapters' rotation too: a
    fork from that version needs both (a run's first co-evolution version once lost its adapters, its
    checkpoint kept)."""
    import json

    from learner.checkpoint import pinned_steps
    from learner.publish import rotate_adapter_dirs

    a = make_trainer(tiny_model_dir)
    ckpts, adapters = tmp_path / "checkpoints", tmp_path / "adapters"
    for version in range(1, 9):
        a.step = 10 * version
        save_checkpoint(ckpts, a, {}, keep=2, pin=version == 3)
        for role in ROLES:
            d = adapters / f"{role}-v{version}"
            d.mkdir(parents=True)
            (d / "comap.json").write_text(json.dumps({"version": version, "step": a.step}))
        rotate_adapter_dirs(adapters, keep_dirs=2, keep_steps=pinned_steps(ckpts))
    assert pinned_steps(ckpts) == {30}
    assert sorted(p.name for p in adapters.glob("policy-v*")) == ["policy-v3", "policy-v7", "policy-v8"]
    assert len(list(adapters.iterdir())) == 3 * len(ROLES)


def test_padded_batch_losses_equal_per_sequence_losses(tiny_model_dir):
    """Left padding, position ids and the logits window change nothing: a batch of mixed lengths
    gives the token-weighted mean of each sequence's own unpadded loss."""
    from learner import losses
    from tests.fixtures.reference_path import collate, window_logits

    trainer = make_trainer(tiny_model_dir)
    model, enc = trainer.model, trainer.encoder
    seqs = [
        enc.draft(demo_record(0)),
        enc.draft({"s": "Task: short.", "target": "look"}),
        enc.reflection(reflection_record(1)),
    ]
    assert len({len(s.ids) for s in seqs}) == 3
    from learner.peft_model import activate

    activate(model, "policy", trainable=False)
    with torch.no_grad():
        batch = collate(seqs, trainer.pad_id)
        logits, win = window_logits(trainer.forward, batch)
        assert logits.shape[1] < batch["input_ids"].shape[1]  # only the window was projected
        batched = losses.masked_token_ce(logits, win["labels"]).item()
        total, count = 0.0, 0
        for s in seqs:
            ids = torch.tensor([s.ids])
            full = model(input_ids=ids).logits
            labels = torch.full_like(ids, -100)
            labels[0, s.start : s.start + s.n_target] = ids[0, s.start : s.start + s.n_target]
            total += losses.masked_token_ce(full, labels).item() * s.n_target
            count += s.n_target
    assert abs(batched - total / count) < 1e-4


def test_checkpoint_during_a_step_holds_the_last_completed_step_and_abort_is_prompt(tiny_model_dir, tmp_path):
    import threading
    import time as _time

    from learner.trainer import StepAborted

    trainer = make_trainer(tiny_model_dir, lora_dropout=0.05)
    trainer.train_step([fixed_batch()])
    before = {r: adapter_state(trainer.model, r) for r in ROLES}
    rng_before = trainer.rng_at_step_start
    errors: list[BaseException] = []

    def long_step():
        try:
            trainer.train_step([fixed_batch() for _ in range(40)])
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    t = threading.Thread(target=long_step)
    t.start()
    _time.sleep(0.3)
    assert t.is_alive(), "the step should still be running"
    path = save_checkpoint(tmp_path, trainer, {})
    t0 = _time.monotonic()
    trainer.abort = True
    t.join(30)
    assert _time.monotonic() - t0 < 5 and isinstance(errors[0], StepAborted)
    assert path.name == "step-00000001" and trainer.step == 1
    saved = torch.load(path / "state.pt", weights_only=False)
    for role in ROLES:
        for k, v in before[role].items():
            assert torch.equal(saved["adapters"][role][k], v)
    assert torch.equal(saved["rng"]["torch"], rng_before["torch"])


def test_truncated_prompts_are_counted_per_step(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, max_seq_len=256)  # the short prompts take ~170 tokens
    long_state = demo_record(0) | {"s": "Task: cool a mug.\n" + "You arrive at countertop 1. " * 40}
    m = trainer.train_step([{"demos": [long_state, demo_record(1)]}])
    assert m["learner/truncated"] == 1  # only the long prompt was cut; the target survived
    m = trainer.train_step([{"demos": [demo_record(1)]}])
    assert m["learner/truncated"] == 0  # counted per step, not cumulatively
    seq = trainer.encoder.draft(long_state)
    full = trainer.encoder._ids(trainer.encoder.prompts.draft(long_state["s"]))
    assert len(seq.ids) == 256 and seq.n_target > 0
    # the middle goes: the head (system prompt, task) and the tail (current state, question) stay
    from learner.batches import KEEP_HEAD

    head = min(KEEP_HEAD, (256 - seq.n_target) // 2)
    assert seq.ids[:head] == full[:head] and seq.ids[head : seq.start] == full[len(full) - (seq.start - head) :]


def test_change_token_nll_counts_only_tokens_new_to_the_previous_observation(tiny_model_dir):
    """``wm/change_nll`` is the CE over the real next observation's tokens that the observation
    before the action did not contain (end of text excluded), computed from the same logits."""
    from learner import losses
    from learner.batches import change_token_flags
    from learner.peft_model import activate
    from tests.fixtures.reference_path import collate, window_logits

    assert change_token_flags([5, 6, 7, 5], [5, 9]) == [False, True, True, False]
    trainer = make_trainer(tiny_model_dir)
    enc = trainer.encoder
    rec = {**wm_record(0), "o": "You arrive at countertop 1. On the countertop 1, you see a mug 1."}
    seq = enc.world_model_ce(rec)
    target = seq.ids[seq.start : seq.start + seq.n_target]
    before = set(enc._ids(rec["o"]))
    assert seq.change == [t not in before and t != enc.tokenizer.eos_token_id for t in target]
    assert 0 < sum(seq.change) < len(target)  # "arrive at" is shared, "fridge ... closed" is new

    activate(trainer.model, "wm", trainable=False)
    with torch.no_grad():
        logits, win = window_logits(trainer.forward, collate([seq], trainer.pad_id))
        per_token = torch.nn.functional.cross_entropy(
            logits[0, :-1].float(), win["labels"][0, 1:].clamp(min=0), reduction="none"
        )
        targets = win["labels"][0, 1:] != losses.IGNORE
        flags = torch.zeros_like(targets)
        flags[targets] = torch.tensor(seq.change)
        expected = per_token[flags].mean().item()
    m = trainer.train_step([{"transitions": [rec]}])
    assert abs(m["wm/change_nll"] - expected) < 1e-4
    assert "wm/change_nll" not in trainer.train_step([{"demos": [demo_record(0)]}])


def test_a_checkpoint_resumes_on_any_device(tiny_model_dir, tmp_path, monkeypatch):
    """Resuming on CUDA crashed: the whole checkpoint was loaded to the learner's device, the CPU RNG
    state with it, and torch.set_rng_state refuses a non-CPU tensor. Loaded to the meta device here
    (what a CUDA map_location did to it), it must come back exactly as saved."""
    import torch

    from learner.checkpoint import load_checkpoint, save_checkpoint
    from tests.fixtures.learner import make_trainer, wm_record

    t = make_trainer(tiny_model_dir)
    t.train_step([{"transitions": [wm_record()]}])
    path = save_checkpoint(tmp_path, t, {"state": {}})
    saved = t.rng_at_step_start["torch"].clone()
    real_load = torch.load

    def load_elsewhere(f, map_location=None, **kw):  # what map_location=<the learner's device> did
        state = real_load(f, map_location="cpu", **kw)
        state["rng"]["torch"] = (
            state["rng"]["torch"].to("meta") if map_location not in ("cpu", None) else state["rng"]["torch"]
        )
        return state

    monkeypatch.setattr(torch, "load", load_elsewhere)
    fresh = make_trainer(tiny_model_dir)
    fresh.device = "meta"
    load_checkpoint(path, fresh)
    assert torch.equal(torch.get_rng_state(), saved) and fresh.step == t.step


def test_the_bce_weight_is_the_one_trained(tiny_model_dir):
    """``method.bce_weight`` (every phase's): the loss trained is the logged terms at that weight."""
    batch = {"reflections": [reflection_record(1), reflection_record(0)]}
    for weight in (1.0, 0.0):
        trainer = make_trainer(tiny_model_dir, bce_weight=weight)
        m = trainer.train_step([batch])
        assert m["policy/bce"] > 0
        assert abs(m["policy/loss"] - (m["policy/reflect_ce"] + weight * m["policy/bce"])) < 1e-5
