"""Prompts prefilled in the running batch's decode-step forward (``MIXED_STEP_TOKENS``), on the tiny model."""

from __future__ import annotations

import pytest

from comap_async.inference.adapters import read_adapter
from comap_async.inference.engine import Engine, Sequence
from comap_async.inference.prefix import PrefixCache
from comap_async.inference.token_sampling import SamplingParams, make_generator
from tests.fixtures.inference import AdapterFactory
from tests.integration.test_inference_engine import PROMPTS, make_engine, run

pytestmark = pytest.mark.timeout(120)

TEXTS = [
    *PROMPTS,
    "put the apple in the fridge. put the apple in the fridge. put the apple in the",
    PROMPTS[3] + " You go to the countertop 1.",
    "go to fridge 1",
    PROMPTS[0] + " you see an apple 1.",
]


def spy_forwards(eng: Engine, fail: bool | None = None) -> list[tuple[bool, list[int]]]:
    """Record each fused forward: whether its first part is the running batch, and the other parts' token
    counts. ``fail`` True: the first forward of a decode step and joining prompts raises; False: the first
    forward of several prompts and no decode step raises."""
    seen: list[tuple[bool, list[int]]] = []
    forward_parts = eng.fused.forward_parts

    def recording(parts):
        decode = parts[0].cache is eng._cache
        joining = [p.input_ids.numel() for p in parts[1:]]
        seen.append((decode, joining))
        if fail is not None and decode == fail and joining and sum(1 for d, j in seen if d == fail and j) == 1:
            raise RuntimeError("injected: the shared forward failed")
        return forward_parts(parts)

    eng.fused.forward_parts = recording
    return seen


def right_then_wrong(reference: list[Sequence]):
    """A proposer from a plain run's outputs (the tiny random model copies nothing from its prompts): the
    right next token, then a wrong one, so verify steps confirm one and reject one."""
    outputs = {(tuple(s.prompt_ids), s.params.max_tokens): s.out_ids for s in reference}

    def propose(seq: Sequence, k: int) -> list[int]:
        out, n = outputs[(tuple(seq.prompt_ids), seq.params.max_tokens)], len(seq.out_ids)
        return out[n : n + 1] + [(out[n + 1] + 1) % 512] if n + 2 < len(out) and k >= 2 else []

    return propose


def play(tiny_model_dir, adapters, mixed: int, spec: int = 0, fail: bool | None = None, proposer=None, stagger_s=0.004):
    extra = {} if proposer is None else {"proposer": proposer}
    eng = make_engine(
        tiny_model_dir,
        "fused",
        max_batch_size=4,
        mixed_step_tokens=mixed,
        speculative_tokens=spec,
        prefix_cache=PrefixCache(block=4),
        **extra,
    )
    seen = spy_forwards(eng, fail)
    eng.start()
    try:
        slots = []
        for files in adapters:
            eng.call(eng.slots.fill_spares).result(30)
            slot = eng.slots.take_spare()
            assert eng.slots.fill_spare(slot, files)
            slots.append(slot)
        tok = eng.tokenizer
        seqs = []
        for i, text in enumerate(TEXTS * 2):  # the second pass finds the first's prompts in the prefix cache
            sampled = i % 3 == 1
            params = SamplingParams(
                max_tokens=4 + 3 * (i % 4),
                temperature=1.0 if sampled else 0.0,
                top_p=0.9,
                seed=7 + i if sampled else None,
                ignore_eos=True,
                logprobs=2,
            )
            seqs.append(
                Sequence(
                    tok(text).input_ids,
                    params,
                    slot=[*slots, "__base__"][i % 3],
                    generator=make_generator(7 + i) if sampled else None,
                )
            )
        run(eng, seqs, stagger_s=stagger_s)
    finally:
        eng.stop()
    return seqs, eng, seen


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    factory = AdapterFactory(tiny_model_dir, tmp_path_factory.mktemp("mixed"))
    return [read_adapter(factory.random(name, seed=seed)) for name, seed in (("a", 3), ("b", 4))]


@pytest.mark.parametrize("spec", [0, 4])
def test_prompts_prefilled_in_the_decode_step_generate_what_prefilling_alone_does(tiny_model_dir, adapters, spec):
    """Two adapters and the base model in one batch, greedy and seeded top-p rows, prompts partly served by
    the prefix cache, with and without verify steps: every row's tokens and logprobs are those of the engine
    that prefills each prompt alone, and prompts did share forwards with decode steps."""
    reference, _, _ = play(tiny_model_dir, adapters, mixed=0)
    proposer = right_then_wrong(reference) if spec else None
    alone, plain, plain_seen = play(tiny_model_dir, adapters, mixed=0, spec=spec, proposer=proposer)
    mixed, eng, seen = play(tiny_model_dir, adapters, mixed=2048, spec=spec, proposer=proposer)
    assert plain.stats.mixed_prefills == 0 and all(not joining for _, joining in plain_seen)
    with_decode = [joining for decode, joining in seen if decode and joining]
    assert with_decode, "no prompt was prefilled in a decode step's forward"
    assert eng.stats.mixed_prefills >= len(with_decode)
    assert eng.prefix.hits > 0
    if spec:
        assert eng.stats.accepted_tokens > 0
        assert (eng.stats.proposed_tokens, eng.stats.accepted_tokens) == (
            plain.stats.proposed_tokens,
            plain.stats.accepted_tokens,
        )
    for ref, got in zip(alone, mixed):
        assert got.finish_reason == ref.finish_reason == "length"
        assert got.out_ids == ref.out_ids
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, ref.token_logprobs)) < 1e-4
        assert [[t for t, _ in top] for top in got.top_logprobs] == [[t for t, _ in top] for top in ref.top_logprobs]


def test_prompts_over_the_budget_are_prefilled_alone(tiny_model_dir, adapters):
    """``mixed_step_tokens`` bounds the tokens prefilled beside a decode step: a longer prompt gets a forward
    of its own, and no shared forward carries more than the budget."""
    budget = 12
    seqs, eng, seen = play(tiny_model_dir, adapters, mixed=budget)
    assert all(s.finish_reason == "length" for s in seqs)
    shared = [sum(joining) for decode, joining in seen if joining or not decode]
    assert max(sum(joining) for _, joining in seen) <= budget
    # prompts alone: forwards that are not the running batch's and carry no other prompt, of more tokens
    assert any(not decode and not joining for decode, joining in seen)
    assert shared and eng.stats.mixed_prefills > 0


def test_a_failed_mixed_forward_fails_the_running_rows_and_prefills_the_joining_prompts_alone(tiny_model_dir, adapters):
    """The running rows share their fate with the batch's cache (as a failed decode step); a joining
    prompt's own cache is rebuilt, so it is prefilled again alone and generates what it would have."""
    alone, _, _ = play(tiny_model_dir, adapters, mixed=0)
    mixed, eng, seen = play(tiny_model_dir, adapters, mixed=2048, fail=True)
    failed = [s for s in mixed if s.finish_reason == "error"]
    assert failed and all("injected" in str(s.error) for s in failed)
    assert eng.stats.failed == len(failed)
    first_mixed = next(joining for decode, joining in seen if decode and joining)
    assert len(failed) < len(mixed) - len(first_mixed)  # only the batch that was decoding
    for ref, got in zip(alone, mixed):
        if got.finish_reason != "error":
            assert got.out_ids == ref.out_ids
    assert eng.fatal is None  # the engine thread went on serving


def test_a_failed_forward_of_prompts_alone_prefills_each_again_on_its_own(tiny_model_dir, adapters):
    """With no row decoding, the joining prompts share one forward; if it fails, each is prefilled again
    alone and nothing fails (the error is logged, not lost: ``engine.shared_prefill_failed``)."""
    alone, _, _ = play(tiny_model_dir, adapters, mixed=0, stagger_s=None)
    mixed, eng, seen = play(tiny_model_dir, adapters, mixed=2048, fail=False, stagger_s=None)
    assert any(not decode and joining for decode, joining in seen), "no forward of prompts alone was shared"
    assert eng.stats.failed == 0
    for ref, got in zip(alone, mixed):
        assert got.finish_reason == "length" and got.out_ids == ref.out_ids
