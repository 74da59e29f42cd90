"""The fused forward (what the embedded server runs the Llama family on) against transformers + peft on the tiny model.

fp32: the same logits to 1e-4 for a padded batch that mixes the base model and three adapters,
for a prefill that continues cached keys/values, and over decode steps.
bf16 (the default on CPUs with bf16 instructions) has stated tolerances, measured on this tiny
random model with strong random adapters (B ~ N(0, 0.3)), which magnify rounding more than
SmolLM2 does:
* its logprobs are no further from fp32 transformers than transformers' own bf16 model is
  (x1.25; measured 0.38-0.49 nats at worst over the vocabulary vs 0.44-0.53 for transformers);
* over 12-token greedy continuations of four prompts on mixed adapters, every token it picks is
  the reference's choice or a near-tie (within 0.25 nats: measured 0.15), at most 6 of 48 are
  near-ties (measured 3), and the logprob it reports for its token is within 0.4 nats (measured 0.30).
"""

from __future__ import annotations

import pytest
import torch

from comap_async.inference.adapters import BASE, SlotManager, read_adapter
from comap_async.inference.fused import FusedLlama
from comap_async.inference.kvcache import BatchCache
from comap_async.inference.layout import prepare_for_inference
from comap_async.models import load_model_and_tokenizer
from tests.fixtures.inference import AdapterFactory, Reference

pytestmark = pytest.mark.timeout(180)

PROMPTS = [
    "You arrive at countertop 1. On the countertop 1, you see a mug 2.",
    "go to fridge 1",
    "Your task is to: put a clean apple in fridge. You open the fridge 1.",
    "look",
]
TIE_NATS, PICKED_NATS, MAX_TIES = 0.25, 0.4, 6


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from peft import LoraConfig

    factory = AdapterFactory(tiny_model_dir, tmp_path_factory.mktemp("fused-adapters"))
    paths = [factory.random(f"a{i}", seed=20 + i) for i in range(3)]
    model, tok = load_model_and_tokenizer(str(tiny_model_dir))
    prepare_for_inference(model)
    slots = SlotManager(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"), spares=0)
    names = [slots.add_slow(read_adapter(p)) for p in paths]
    return model, tok, slots, names, paths, Reference(tiny_model_dir)


def _padded(tok, prompts: list[str]):
    """Left-padded ids, mask and positions of prompts of different lengths (as the engine's batch)."""
    seqs = [tok(p).input_ids for p in prompts]
    n = max(map(len, seqs))
    ids = torch.tensor([[0] * (n - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return seqs, ids, mask, positions


def _reference_logprobs(ref: Reference, ids: list[int], path) -> torch.Tensor:
    return ref.logprobs(ids, path)


def test_fp32_logits_equal_transformers_on_a_mixed_padded_batch(setup):
    model, tok, slots, names, paths, ref = setup
    fused = FusedLlama(model, slots.stacks, torch.float32)
    row_slots = [BASE, names[0], names[1], names[2]]
    row_paths = [None, *paths]
    seqs, ids, mask, positions = _padded(tok, PROMPTS)
    cache = BatchCache(len(fused.layers), transposed=True)
    rows = slots.stacks.rows_for(row_slots, BASE)
    logits = fused.forward(ids, positions, mask, cache, rows)
    cache.mask = mask
    follow = [[11, 12, 13]] * len(PROMPTS)  # three decode steps with fixed tokens
    steps = [torch.log_softmax(logits, -1)]
    for k in range(3):
        m = cache.extend_mask()
        pos = torch.tensor([[len(s) + k] for s in seqs])
        steps.append(torch.log_softmax(fused.forward(torch.tensor([[f[k]] for f in follow]), pos, m, cache, rows), -1))
    for r, (s, path) in enumerate(zip(seqs, row_paths)):
        expect = _reference_logprobs(ref, s + follow[r], path)
        for k, got in enumerate(steps):
            assert (got[r] - expect[len(s) - 1 + k]).abs().max() < 1e-4, (r, k)


def test_fp32_prefill_continues_cached_keys_and_values(setup):
    """A prompt whose first tokens come from the cache (the prefix cache's case): same logits."""
    model, tok, slots, names, paths, ref = setup
    fused = FusedLlama(model, slots.stacks, torch.float32)
    ids = tok(PROMPTS[2]).input_ids
    rows = slots.stacks.rows_for([names[1]], BASE)
    cache = BatchCache(len(fused.layers), transposed=True)
    cut = 7
    fused.forward(torch.tensor([ids[:cut]]), torch.arange(cut)[None], torch.ones(1, cut, dtype=torch.long), cache, rows)
    rest = torch.tensor([ids[cut:]])
    logits = fused.forward(
        rest, torch.arange(cut, len(ids))[None], torch.ones(1, len(ids), dtype=torch.long), cache, rows, last_only=False
    )
    expect = _reference_logprobs(ref, ids, paths[1])[cut:]
    assert (torch.log_softmax(logits, -1) - expect).abs().max() < 1e-4


def test_bf16_greedy_tokens_are_the_reference_or_near_ties(setup):
    model, tok, slots, names, paths, ref = setup
    fused = FusedLlama(model, slots.stacks, torch.bfloat16)
    row_slots = [names[0], BASE, names[2], names[1]]
    row_paths = [paths[0], None, paths[2], paths[1]]
    seqs, ids, mask, positions = _padded(tok, PROMPTS)
    cache = BatchCache(len(fused.layers), transposed=True)
    rows = slots.stacks.rows_for(row_slots, BASE)
    lp = torch.log_softmax(fused.forward(ids, positions, mask, cache, rows), -1)
    cache.mask = mask
    outs: list[list[int]] = [[] for _ in seqs]
    picked: list[list[float]] = [[] for _ in seqs]
    for k in range(12):
        nxt = lp.argmax(-1)
        for r in range(len(seqs)):
            outs[r].append(int(nxt[r]))
            picked[r].append(float(lp[r, nxt[r]]))
        m = cache.extend_mask()
        pos = torch.tensor([[len(s) + k] for s in seqs])
        lp = torch.log_softmax(fused.forward(nxt[:, None], pos, m, cache, rows), -1)
    ties = 0
    for r, (s, path) in enumerate(zip(seqs, row_paths)):
        expect = _reference_logprobs(ref, s + outs[r], path)
        for k, t in enumerate(outs[r]):
            row = expect[len(s) - 1 + k]
            gap = float(row.max() - row[t])  # 0 when the reference picks the same token
            assert gap <= TIE_NATS, (r, k, gap)
            assert abs(picked[r][k] - float(row[t])) <= PICKED_NATS, (r, k)
            ties += gap > 0
    assert ties <= MAX_TIES  # the tolerance admits near-ties, not a different model


def test_bf16_logprobs_are_as_close_as_transformers_bf16(setup, tiny_model_dir):
    from peft import PeftModel

    model, tok, slots, names, paths, ref = setup
    fused = FusedLlama(model, slots.stacks, torch.bfloat16)
    hf16, _ = load_model_and_tokenizer(str(tiny_model_dir), "bfloat16")
    worst_fused = worst_hf = 0.0
    for prompt, slot, path in zip(PROMPTS, [names[0], BASE, names[2], names[1]], [paths[0], None, paths[2], paths[1]]):
        ids = tok(prompt).input_ids
        expect = ref.logprobs(ids, path)
        rows = slots.stacks.rows_for([slot], BASE)
        n = len(ids)
        got = fused.forward(
            torch.tensor([ids]),
            torch.arange(n)[None],
            torch.ones(1, n, dtype=torch.long),
            BatchCache(len(fused.layers), transposed=True),
            rows,
            last_only=False,
        )
        worst_fused = max(worst_fused, float((torch.log_softmax(got, -1) - expect).abs().max()))
        m = hf16 if path is None else PeftModel.from_pretrained(hf16, str(path)).eval()
        with torch.inference_mode():
            theirs = torch.log_softmax(m(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        if path is not None:
            hf16 = m.unload()
        worst_hf = max(worst_hf, float((theirs - expect).abs().max()))
    assert worst_fused <= 1.25 * worst_hf, (worst_fused, worst_hf)


def test_adapter_the_fused_forward_cannot_apply_is_refused(tiny_model_dir, tmp_path):
    """A LoRA on the LM head would be silently ignored by the fused forward: loading it is an error."""
    from peft import LoraConfig, get_peft_model

    from comap_async.config import InferenceConfig
    from comap_async.inference.server import build_fused
    from comap_async.inference.token_sampling import RequestError

    base, _ = load_model_and_tokenizer(str(tiny_model_dir))
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])).save_pretrained(
        str(tmp_path / "head")
    )
    model, _ = load_model_and_tokenizer(str(tiny_model_dir))
    slots = SlotManager(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"), spares=0)
    assert build_fused(model, slots, InferenceConfig(dtype="float32")) is not None  # decided from the model
    with pytest.raises(RequestError, match="lm_head.*learner.target_modules"):
        slots.add_slow(read_adapter(tmp_path / "head"))
    assert slots.peft is None or not slots.peft.peft_config  # nothing half-loaded stays behind


def test_attend_equals_scaled_dot_product_attention():
    """Grouped queries, left padding and a causal prefill block, against torch's SDPA."""
    from comap_async.inference.fused import attend, attention_bias

    torch.manual_seed(0)
    b, t, n, hq, hkv, d = 3, 4, 9, 6, 2, 8
    q = torch.randn(b, t, hq, d)
    k, v = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :1] = 0
    bias = attention_bias(mask, t).expand(b, hkv, hq // hkv, t, n).reshape(b * hkv, hq // hkv * t, n)
    got = attend(q, k.transpose(-1, -2), v, bias).view(b, t, hq, d)
    allowed = mask.bool()[:, None, None, :] & (torch.arange(n) <= n - t + torch.arange(t)[:, None])[None, None]
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=allowed, scale=1.0, enable_gqa=True
    ).transpose(1, 2)
    assert (got - expect).abs().max() < 1e-5
