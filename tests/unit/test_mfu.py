"""The MFU benchmark's arithmetic (learner/flops.py): model FLOPs of LoRA training on a frozen base,
MFU against a card's peak, and the padding share of packed rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from comap_async.wire.records import RecordKind
from learner.batch_types import DraftBatch, MicroBatch, ReflectionBatch, WorldModelBatch, WorldModelUnit
from learner.batches import Seq
from learner.flops import (
    SHAPES,
    ModelDims,
    Pass,
    card_peak_tflops,
    flops_per_token,
    mfu,
    micro_batch_passes,
    padding,
    pass_flops,
)
from learner.packing import first_fit, pack

DIMS = ModelDims(layers=2, hidden=8, attn_width=16, vocab=100, params=1000, lora_params=10)


def test_a_trained_token_is_4n_plus_the_adapters_6n_plus_attention_12_l_d_t():
    seq = 32
    assert flops_per_token(DIMS, seq) == 4 * 1000 + 6 * 10 + 12 * 2 * 16 * seq
    # without backward (the EMA teacher's pass): 2N + 2 N_lora + 4 L d_attn T
    assert flops_per_token(DIMS, seq, backward=False) == 2 * 1000 + 2 * 10 + 4 * 2 * 16 * seq


def test_a_pass_counts_each_unit_over_its_own_length_and_the_head_at_projected_positions_only():
    p = Pass("wm", True, (30, 10), projected=5)
    units = 30 * flops_per_token(DIMS, 30) + 10 * flops_per_token(DIMS, 10)
    assert pass_flops(p, DIMS) == units + 4 * 8 * 100 * 5
    teacher = Pass("wm_teacher", False, (30, 10), projected=5)
    assert (
        pass_flops(teacher, DIMS)
        == 30 * flops_per_token(DIMS, 30, False) + 10 * flops_per_token(DIMS, 10, False) + 2 * 8 * 100 * 5
    )


def test_mfu_is_achieved_flops_over_gpus_times_the_peak():
    assert mfu(989e12 * 0.4 * 10, 10.0, 989.0) == pytest.approx(0.4)
    assert mfu(989e12 * 0.4 * 10, 10.0, 989.0, gpus=2) == pytest.approx(0.2)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_card_peaks_by_device_name(name, peak):
    assert card_peak_tflops(name) == peak


def test_the_dims_of_a_shape_match_the_model_transformers_builds():
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.peft_model import adapter_parameters, build_peft_model

    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **SHAPES["tiny"]))
    dims = ModelDims.from_shape(SHAPES["tiny"], lora_r=8)
    linears = [m for m in base.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert dims.params == sum(m.weight.numel() for m in linears)
    model = build_peft_model(base, 8, 16, 0.0, "all-linear", False)
    assert dims.lora_params == sum(p.numel() for _, p in adapter_parameters(model, "policy"))
    # Qwen3-4B: 3.63B matmul weights in its 36 layers (4.02B with the tied embedding)
    assert ModelDims.from_shape(SHAPES["qwen3-4b"], 8).params == 3_633_315_840


LENGTHS = (10, 6, 4, 3)


def test_the_padding_share_of_fixed_lengths():
    # first-fit by decreasing length into rows 10 wide: [10], [6, 4], [3] -> 3 rows, 23 real of 30
    assert first_fit(LENGTHS)[1] == 3
    pad = padding([Pass("policy", True, LENGTHS, 4)])
    assert (pad.real, pad.computed, pad.dense) == (23, 30, 40)
    assert pad.share == pytest.approx(7 / 30)
    assert pad.dense_share == pytest.approx(17 / 40)  # one row each, as wide as the longest
    # passes add up: a second pass of equal units has no padding
    both = padding([Pass("policy", True, LENGTHS, 4), Pass("wm", True, (5, 5), 2)])
    assert (both.real, both.computed) == (33, 40)


def test_the_count_lays_out_the_rows_pack_builds():
    units = [[Seq(list(range(1, n + 1)), n - 1, 1)] for n in LENGTHS]
    packed = pack(units, pad_id=0)
    assert tuple(packed.input_ids.shape) == (first_fit(LENGTHS)[1], max(LENGTHS))
    assert int((packed.position_ids > 0).sum()) + len(LENGTHS) == padding([Pass("p", True, LENGTHS, 4)]).real


def test_a_micro_batch_is_the_teacher_the_world_model_and_the_policy_passes():
    def seq(prompt: int, target: int) -> Seq:
        return Seq([1] * (prompt + target), prompt, target)

    ce, rollout, teacher = seq(20, 3), seq(20, 4), seq(25, 4)
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(policy_wm_aux=0.0, chunk_tokens=0),
        encoder=SimpleNamespace(truncated=0, demo_actions=0),
        micro_batch=lambda records: MicroBatch(
            world_model=WorldModelBatch([WorldModelUnit([ce, rollout], [True, False], teacher)]),
            drafts=DraftBatch([seq(10, 2)], [RecordKind.DEMO_STEP], records=1),
            reflections=ReflectionBatch([seq(12, 5)], [1], [RecordKind.SUFFIX_REFLECTION], [True]),
        ),
    )
    passes = micro_batch_passes(trainer, {"transitions": [{}], "demos": [{}], "reflections": [{}]})
    assert passes == [
        Pass("wm_teacher", False, (29,), 4),
        Pass("wm", True, (27,), 7),  # the prompt once, both targets after it
        Pass("policy", True, (12, 17), 7),
    ]
