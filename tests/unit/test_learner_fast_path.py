"""The learner (packed rows, target-position logits, one pass for a transition's CE target and its
rollout, optional bf16) computes the reference computation's losses and gradients (the test oracle
tests/fixtures/reference_path.py; tiny model, fp32); the comparison would catch a loss taken at the
wrong positions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from comap_async.wire.messages import ROLES
from learner.batches import Seq
from learner.packing import pack
from learner.peft_model import adapter_parameters, adapter_state, load_adapter_state
from tests.fixtures.learner import demo_record, make_trainer, reflection_record, wm_record

LOSSES = (
    "wm/ce",
    "wm/kl",
    "wm/change_nll",
    "policy/draft_ce",
    "policy/reflect_ce",
    "policy/bce",
    "wm/loss",
    "policy/loss",
)
RTOL = 1e-4  # fp32: the learner and the oracle differ only in summation order


def mixed_batch() -> dict:
    """Lengths that differ (padding and packing matter), a transition without a rollout, a rollout
    longer than its real next state, both reflection labels."""
    long_state = "Task: cool a mug.\nCurrent observation: You arrive at countertop 1. " + "You see a mug 1. " * 6
    return {
        "transitions": [
            {
                **wm_record(0, rollout="You arrive at fridge 1. The fridge 1 is open. In it, you see a egg 1."),
                "o": "You are in the middle of a room.",
            },
            {**wm_record(1, rollout="Nothing happens."), "s": long_state},
            {**wm_record(2, rollout=""), "o": "You arrive at fridge 1."},
        ],
        "demos": [demo_record(0), {"s": "Task: short.", "target": "look"}, {**demo_record(1), "s": long_state}],
        "reflections": [reflection_record(1), reflection_record(0)],
    }


def randomize_adapters(trainer, seed: int = 0) -> dict:
    """Non-zero LoRA A and B for every role (B starts at zero: the adapters would change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for role in ROLES:
            for _, p in adapter_parameters(trainer.model, role):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return {role: adapter_state(trainer.model, role) for role in ROLES}


def step_with_grads(trainer, batch) -> tuple[dict, dict]:
    """One ``train_step``; the metrics and the (clipped) gradients the optimizer was about to apply."""
    grads: dict = {}
    step = trainer.optimizer.step

    def capture(*a, **kw):
        for role in ("policy", "wm"):
            for name, p in adapter_parameters(trainer.model, role):
                grads[name] = p.grad.detach().clone()
        return step(*a, **kw)

    trainer.optimizer.step = capture
    return trainer.train_step([batch]), grads


def pair(tiny_model_dir, common: dict | None = None, **fast_cfg):
    """The oracle's trainer and the learner's with the same adapters (``common``: settings of both)."""
    common = common or {}
    ref = make_trainer(tiny_model_dir, reference=True, **{"gradient_checkpointing": True, "autocast": "off", **common})
    fast = make_trainer(tiny_model_dir, **{"gradient_checkpointing": False, **common, **fast_cfg})
    states = randomize_adapters(ref)
    for role, state in states.items():
        load_adapter_state(fast.model, role, state)
    return ref, fast


def worst_difference(a: tuple[dict, dict], b: tuple[dict, dict]) -> float:
    """The largest relative difference over the losses and the gradients of every LoRA tensor."""
    (ma, ga), (mb, gb) = a, b
    worst = 0.0
    for name in LOSSES:
        assert name in ma and name in mb, name
        worst = max(worst, abs(ma[name] - mb[name]) / max(abs(ma[name]), 1e-3))
    assert ga.keys() == gb.keys() and len(ga) > 0
    for name in ga:
        scale = max(float(ga[name].abs().max()), 1e-6)
        worst = max(worst, float((ga[name] - gb[name]).abs().max()) / scale)
    return worst


@pytest.mark.parametrize(("chunk_tokens", "checkpointing"), [(0, False), (0, True), (1, False), (400, False)])
def test_fast_path_losses_and_gradients_equal_the_reference_path(tiny_model_dir, chunk_tokens, checkpointing):
    """One pass per loss (0; with activation checkpointing too, as the GPU configs run it), one
    sequence per chunk (1), chunks of several sequences (400)."""
    ref, fast = pair(tiny_model_dir, chunk_tokens=chunk_tokens, gradient_checkpointing=checkpointing)
    a, b = step_with_grads(ref, mixed_batch()), step_with_grads(fast, mixed_batch())
    assert all(a[0][name] > 0 for name in LOSSES)  # every loss is really computed
    assert a[0]["learner/tokens"] == b[0]["learner/tokens"]  # the same training tokens are counted
    assert worst_difference(a, b) < RTOL


def test_the_comparison_catches_a_loss_taken_one_position_off(tiny_model_dir, monkeypatch):
    """Shift every predicting position by one (the classic label-shift bug): far outside tolerance."""
    import learner.trainer as trainer_mod

    ref, fast = pair(tiny_model_dir)
    real_pack = trainer_mod.pack

    def off_by_one(*args, **kwargs):
        p = real_pack(*args, **kwargs)
        return dataclasses.replace(p, cols=(p.cols + 1).clamp(max=p.input_ids.shape[1] - 1))

    monkeypatch.setattr(trainer_mod, "pack", off_by_one)
    assert worst_difference(step_with_grads(ref, mixed_batch()), step_with_grads(fast, mixed_batch())) > 100 * RTOL


def test_packed_attention_follows_the_layout_and_equals_the_dense_mask(tiny_model_dir, monkeypatch):
    """The learner's attention (per-unit causal kernels) gives the hidden states the dense
    [W, W] mask gives, at every non-padding position; and it is what the trainer really runs."""
    import learner.peft_model as model_mod
    from learner.peft_model import activate

    trainer = make_trainer(tiny_model_dir)
    assert trainer.forward.packed_attention
    enc = trainer.encoder
    rec = wm_record(0, rollout="You arrive at fridge 1. The fridge 1 is open.")
    s_seq, _ = enc.world_model_rollout(rec)
    units = [
        [enc.world_model_ce(rec), s_seq],
        [enc.draft({"s": "Task: short.", "target": "look"})],
        [enc.draft(demo_record(1))],
        [Seq(list(range(5, 25)), 15, 5)],
        [Seq(list(range(30, 40)), 6, 4)],
    ]
    p = pack(units, trainer.pad_id)
    assert len(p.layout) < len(units)  # some row holds two units
    decoder = trainer.model.get_base_model().get_decoder()
    activate(trainer.model, "wm", trainable=False)
    from transformers.modeling_utils import AttentionInterface

    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("packed_layout"))
        return model_mod.packed_attention(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, model_mod.PACKED_ATTENTION, spy)
    with torch.no_grad():
        dense = decoder(
            input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids, use_cache=False
        ).last_hidden_state
        packed = decoder(
            input_ids=p.input_ids,
            attention_mask=p.attention_mask,
            position_ids=p.position_ids,
            use_cache=False,
            packed_layout=p.layout,
        ).last_hidden_state
    assert calls and calls[0] is None and calls[-1] is p.layout
    real_positions = p.attention_mask[:, 0].sum(-1) > 1  # padding sees only itself
    real_positions[:, 0] = True
    assert torch.allclose(dense[real_positions], packed[real_positions], atol=1e-5)


def test_fast_dropout_drops_at_rate_p_rescales_and_is_reproducible():
    from learner.peft_model import FastDropout

    drop = FastDropout(0.05)
    x = torch.ones(400, 1000)
    torch.manual_seed(0)
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.95) < 2e-3
    assert torch.allclose(y[kept], torch.tensor(1 / 0.95))
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)  # the default generator: checkpointed RNG state replays it
    drop.eval()
    assert drop(x) is x


def test_pack_shares_a_prompt_and_keeps_units_apart():
    prompt = [5, 6, 7]
    ce, rollout = Seq(prompt + [8, 9], 3, 2), Seq(prompt + [10, 11, 12, 13], 3, 3)  # token 13 carries no loss
    short, other = Seq([20, 21, 22], 2, 1), Seq([30, 31, 32, 33], 3, 1)
    p = pack([[ce, rollout], [short], [other]], pad_id=0)
    # rows as wide as the longest unit; the two short units share the second row (longest first)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12], [30, 31, 32, 33, 20, 21, 22, 0]]
    # the rollout's positions continue the prompt's, as if the CE target were not there
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 2, 3, 0, 1, 2, 0]]
    m = p.attention_mask[:, 0]
    assert m[0, 5].tolist() == [True] * 3 + [False, False] + [True, False, False]  # rollout: prompt + itself
    assert m[0, 4].tolist() == [True] * 5 + [False] * 3  # the CE target: prompt + itself
    assert m[1, 6].tolist() == [False] * 4 + [True] * 3 + [False]  # a unit never sees its row neighbour
    assert m[1, 7].tolist() == [False] * 7 + [True]  # padding sees itself only
    assert p.targets.tolist() == [8, 9, 10, 11, 12, 22, 33]
    assert p.rows.tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert p.cols.tolist() == [2, 3, 2, 5, 6, 5, 2]  # the prompt's last position predicts both first tokens
    assert p.owner.tolist() == [0, 0, 1, 1, 1, 2, 3] and p.first == [0, 2, 5, 6] and p.counts == [2, 3, 1, 1]
    assert p.tokens == 5 + 7 + 3 + 4  # the sequences' own lengths, as the oracle counts them
    with pytest.raises(ValueError, match="same prompt"):
        pack([[ce, short]], pad_id=0)


def test_bf16_autocast_stays_close_to_fp32(tiny_model_dir):
    """bf16 matmuls (the CPU default where the CPU has bf16 instructions): losses within 2 %, each
    role's gradient pointing the same way (cosine > 0.95: 0.96-0.97 here, on a random model whose
    random adapters are far larger than trained ones); the trained tensors stay fp32."""
    ref, fast = pair(tiny_model_dir, autocast="bf16")
    (ma, ga), (mb, gb) = step_with_grads(ref, mixed_batch()), step_with_grads(fast, mixed_batch())
    for name in LOSSES:
        assert mb[name] == pytest.approx(ma[name], rel=2e-2, abs=1e-3), name
    for role in ("policy", "wm"):
        names = [n for n, _ in adapter_parameters(ref.model, role)]
        x, y = (torch.cat([g[n].flatten() for n in names]) for g in (ga, gb))
        assert torch.nn.functional.cosine_similarity(x, y, dim=0) > 0.95, role
    assert all(p.dtype == torch.float32 for role in ROLES for _, p in adapter_parameters(fast.model, role))
    base = fast.model.get_base_model().get_decoder().layers[0].self_attn.q_proj.base_layer
    assert base.weight.dtype == torch.bfloat16


def test_autocast_auto_follows_the_hardware(monkeypatch):
    import learner.forward as forward_mod

    assert forward_mod.resolve_autocast("off", "cpu") is None
    assert forward_mod.resolve_autocast("bf16", "cpu") == torch.bfloat16
    monkeypatch.setattr(forward_mod, "cpu_has_native_bf16", lambda: True)
    assert forward_mod.resolve_autocast("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(forward_mod, "cpu_has_native_bf16", lambda: False)
    assert forward_mod.resolve_autocast("auto", "cpu") is None


def test_chunk_by_tokens_keeps_every_unit_within_the_budget_longest_first():
    from learner.packing import chunk_by_tokens

    units = [3, 9, 1, 4, 4, 12]
    chunks = chunk_by_tokens(10, units, lambda n: n)
    assert sorted(u for c in chunks for u in c) == sorted(units)  # nothing dropped or repeated
    assert chunks == [[12], [9], [4, 4], [3, 1]]  # greedy over the sorted units; one over the budget stands alone
    assert chunk_by_tokens(0, units, lambda n: n) == [units]  # 0: one chunk, the order kept


def test_subsampled_targets_give_the_reference_losses(tiny_model_dir):
    """``learner.demo_loss_share``: a warm-up path's subsampled turns and a reflection's subsampled
    final action carry no loss in the learner or the oracle (the oracle's labels honour ``Seq.loss``)."""
    path = {
        "id": "p0",
        "goal": "put a mug in fridge.",
        "first": "You are in the middle of a room.",
        "turns": [
            ["go to countertop 1", "You arrive at countertop 1."],
            ["take mug 1 from countertop 1", "You pick up the mug 1."],
        ],
        "targets": [True, True],
    }
    batch = mixed_batch()
    batch["demos"].append(path)
    batch["reflections"] = [r | {"id": f"r{i}"} for i, r in enumerate(batch["reflections"])]
    ref, fast = pair(tiny_model_dir, {"demo_loss_share": {"go": 1e-9}})
    a, b = step_with_grads(ref, batch), step_with_grads(fast, batch)
    assert worst_difference(a, b) < RTOL
    plain_ref, _ = pair(tiny_model_dir)
    c = step_with_grads(plain_ref, batch)
    assert c[0]["policy/reflect_ce"] != pytest.approx(a[0]["policy/reflect_ce"], rel=1e-3)  # the share acted
