"""The batching engine in-process on the tiny model: continuous batching must not change results."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from comap_async.inference.adapters import SlotManager, read_adapter
from comap_async.inference.engine import Engine, Sequence
from comap_async.inference.layout import prepare_for_inference
from comap_async.inference.token_sampling import SamplingParams
from comap_async.models import load_model_and_tokenizer
from tests.fixtures.inference import AdapterFactory

pytestmark = pytest.mark.timeout(120)

PROMPTS = [
    "You arrive at countertop 1. On the countertop",
    "go to",
    "look",
    "Your task is to: put a clean apple in fridge. You open the fridge 1. The fridge 1 is open.",
]


def make_engine(tiny_model_dir, forward: str, dtype: str = "float32", **kw) -> Engine:
    """An engine on the tiny model on ``forward`` (``fused`` in ``dtype``, or ``transformers``)."""
    from peft import LoraConfig

    from comap_async.config import InferenceConfig
    from comap_async.inference.prefill import MIXED_STEP_TOKENS
    from comap_async.inference.server import build_fused

    model, tok = load_model_and_tokenizer(str(tiny_model_dir))
    prepare_for_inference(model)
    slots = SlotManager(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"), spares=1)
    inf = InferenceConfig(dtype=dtype, max_batch_size=kw.get("max_batch_size", 3))
    fused = build_fused(model, slots, inf, forward=forward)
    assert (fused is not None) == (forward == "fused")
    defaults = {"max_batch_size": 3, "batch_wait_ms": 0, "mixed_step_tokens": MIXED_STEP_TOKENS}
    return Engine(model, tok, slots, **{**defaults, **kw}, fused=fused)


# Every behaviour below holds on both forwards; the fused one runs in fp32 here so results can be
# compared with transformers token for token (its bf16 tolerance is tested on its own).
@pytest.fixture(params=["transformers", "fused"])
def engine(request, tiny_model_dir):
    eng = make_engine(tiny_model_dir, request.param)
    eng.start()
    eng.call(eng.slots.fill_spares).result(30)
    yield eng
    eng.stop()


def run(eng: Engine, seqs: list[Sequence], stagger_s: float | None = 0.0) -> None:
    """Submit the sequences one by one, ``stagger_s`` apart (None: all in one submit, so the first admission
    finds them all waiting), and wait for every one to finish."""
    done = threading.Semaphore(0)
    for s in seqs:
        s.on_done = lambda _s: done.release()
    if stagger_s is None:
        eng.submit(seqs)
    else:
        for s in seqs:
            eng.submit([s])
            time.sleep(stagger_s)
    for _ in seqs:
        assert done.acquire(timeout=60)


def test_staggered_batching_equals_generate(engine, tiny_model_dir):
    """8 greedy sequences of different lengths join and leave a batch of 3: same tokens as HF generate."""
    ref, tok = load_model_and_tokenizer(str(tiny_model_dir))
    seqs = [
        Sequence(tok(p).input_ids, SamplingParams(max_tokens=5 + 4 * i, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(PROMPTS * 2)
    ]
    run(engine, seqs, stagger_s=0.003)
    assert engine.stats.batch_rows > engine.stats.steps  # rows were really batched
    for s in seqs:
        ids = torch.tensor([s.prompt_ids])
        out = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=s.params.max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )
        assert s.out_ids == out[0, ids.shape[1] :].tolist()
        assert s.finish_reason == "length" and s.text == tok.decode(s.out_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_across_batch_company(engine, tiny_model_dir):
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    from comap_async.inference.token_sampling import make_generator

    alone = Sequence(tok(PROMPTS[0]).input_ids, params, generator=make_generator(5))
    run(engine, [alone])
    crowd = [
        Sequence(tok(p).input_ids, params, generator=make_generator(5 if i == 0 else i)) for i, p in enumerate(PROMPTS)
    ]
    run(engine, crowd)
    assert crowd[0].out_ids == alone.out_ids


def test_adapter_with_another_shape_takes_the_slow_path(engine, tiny_model_dir, tmp_path):
    """r=4 does not fit the r=8 spares: built on the engine thread, and it works in a mixed batch."""
    path = AdapterFactory(tiny_model_dir, tmp_path).random("r4", seed=9, r=4)
    files = read_adapter(path)
    spare = engine.slots.take_spare()
    assert spare is not None and not engine.slots.fill_spare(spare, files)
    engine.slots.give_back(spare)
    slot = engine.call(lambda: engine.slots.add_slow(files)).result(30)
    tok = engine.tokenizer
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    seqs = [Sequence(tok(PROMPTS[3]).input_ids, p, slot=s) for s in (slot, "__base__", slot)]
    run(engine, seqs)
    from peft import PeftModel

    ref, _ = load_model_and_tokenizer(str(tiny_model_dir))
    ref = PeftModel.from_pretrained(ref, str(path)).eval()
    ids = torch.tensor([seqs[0].prompt_ids + seqs[0].out_ids])
    with torch.inference_mode():
        lp = torch.log_softmax(ref(input_ids=ids).logits[0].float(), -1)
    n = len(seqs[0].prompt_ids)
    expect = [float(lp[n - 1 + i, t]) for i, t in enumerate(seqs[0].out_ids)]
    assert max(abs(a - b) for a, b in zip(expect, seqs[0].token_logprobs)) < 1e-3
    assert seqs[0].out_ids == seqs[2].out_ids != seqs[1].out_ids
    assert engine.slots.stacked  # the batched (stacked) LoRA path produced these, with r=4 padded to 8
    engine.call(lambda: engine.slots.delete(slot)).result(30)
    assert slot not in engine.slots.peft.peft_config


def _saved(tiny_model_dir, out, **lora):
    import torch as _t
    from peft import LoraConfig, get_peft_model

    base, _ = load_model_and_tokenizer(str(tiny_model_dir))
    _t.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", **lora))
    with _t.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    model.save_pretrained(str(out))
    return out


def test_lora_bias_adapter_falls_back_to_peft_forward(engine, tiny_model_dir, tmp_path):
    """The stacked path has no B bias: such an adapter switches the engine to peft's mixed forward,
    and the fused forward, which has no peft forward to fall back to, refuses it."""
    from peft import PeftModel

    from comap_async.inference.token_sampling import RequestError

    path = _saved(tiny_model_dir, tmp_path / "biased", lora_bias=True)
    files = read_adapter(path)
    if engine.fused is not None:
        with pytest.raises(RequestError, match="fused forward .* does not apply"):
            engine.call(lambda: engine.slots.add_slow(files)).result(30)
        assert engine.slots.stacked and len(engine.slots.peft.peft_config) == 1  # only the spare is left
        return
    slot = engine.call(lambda: engine.slots.add_slow(files)).result(30)
    assert not engine.slots.stacked
    tok = engine.tokenizer
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(tok(PROMPTS[2]).input_ids, p, slot=s) for s in (slot, "__base__")]
    run(engine, seqs)
    assert seqs[0].error is None, repr(seqs[0].error)
    ref, _ = load_model_and_tokenizer(str(tiny_model_dir))
    ref = PeftModel.from_pretrained(ref, str(path)).eval()
    ids = torch.tensor([seqs[0].prompt_ids])
    out = ref.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    assert seqs[0].out_ids == out[0, ids.shape[1] :].tolist() != seqs[1].out_ids


def test_dora_adapters_are_refused(engine, tiny_model_dir, tmp_path):
    from comap_async.inference.token_sampling import RequestError

    files = read_adapter(_saved(tiny_model_dir, tmp_path / "dora", use_dora=True))
    with pytest.raises(RequestError, match="DoRA"):
        engine.call(lambda: engine.slots.add_slow(files)).result(30)
    assert engine.slots.stacked


def test_stop_string_and_cancel(engine):
    tok = engine.tokenizer
    free = Sequence(tok(PROMPTS[0]).input_ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    run(engine, [free])
    stop = free.text[5:8]
    cut = Sequence(
        tok(PROMPTS[0]).input_ids,
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True),
    )
    gone = Sequence(tok(PROMPTS[1]).input_ids, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    gone.cancelled = True
    run(engine, [cut, gone])
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop) + len(stop)]
    assert gone.finish_reason == "abort" and len(gone.out_ids) <= 1


@pytest.mark.parametrize("forward", ["transformers", "fused"])
def test_prefix_cache_reuses_prompt_starts_without_changing_results(tiny_model_dir, forward):
    from comap_async.inference.prefix import PrefixCache

    eng = make_engine(tiny_model_dir, forward, max_batch_size=4, prefix_cache=PrefixCache(block=4))
    slots, tok = eng.slots, eng.tokenizer
    eng.start()
    try:
        eng.call(slots.fill_spares).result(30)
        p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
        long_prompt = tok(PROMPTS[3]).input_ids
        first = Sequence(long_prompt, p)
        run(eng, [first])
        # the reply's keys and values are stored after ``on_done`` (at the end of the engine's step): an op on
        # the engine thread runs after it, so the count is read once they are in
        eng.call(lambda: None).result(30)
        assert eng.prefix.hits == 0 and len(eng.prefix) == (len(long_prompt) + p.max_tokens - 1) // 4
        again = [Sequence(long_prompt, p), Sequence(long_prompt[:-3] + tok(" look").input_ids, p)]
        run(eng, again)
        assert eng.prefix.hits >= 2 * 4 * ((len(long_prompt) - 4) // 4)
        assert again[0].out_ids == first.out_ids
        assert max(abs(a - b) for a, b in zip(again[0].token_logprobs, first.token_logprobs)) < 1e-4
        # another slot never sees the base model's cached keys/values
        spare = slots.take_spare()
        hits = eng.prefix.hits
        run(eng, [Sequence(long_prompt, p, slot=spare)])
        assert eng.prefix.hits == hits
    finally:
        eng.stop()


@pytest.mark.parametrize("forward", ["transformers", "fused"])
@pytest.mark.parametrize("spec", [0, 3])
def test_replies_in_the_prefix_cache_serve_the_next_turn_without_changing_results(tiny_model_dir, forward, spec):
    """A finished row's generated tokens join the prefix cache, so a next
    turn that repeats prompt and reply is prefilled from after the reply, and it generates what a server
    without any prefix cache does. Rows share the batch (left padding); with ``spec`` every verify step
    confirms one proposed token and rejects the next, so the rows hold masked columns when they finish."""
    from comap_async.inference.prefix import PrefixCache

    p = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2)
    reference: dict[tuple[int, ...], list[int]] = {}

    def right_then_wrong(seq: Sequence, k: int) -> list[int]:
        out = reference[tuple(seq.prompt_ids)]
        n = len(seq.out_ids)
        return out[n : n + 1] + [(out[n + 1] + 1) % 512] if n + 2 < len(out) and k >= 2 else []

    def conversation(eng: Engine) -> tuple[list[Sequence], list[Sequence], int]:
        tok = eng.tokenizer
        first = [Sequence(tok(t).input_ids, p) for t in PROMPTS]
        run(eng, first)
        second = [Sequence(s.prompt_ids + s.out_ids + tok(" > look").input_ids, p) for s in first]
        hits = eng.prefix.hits if eng.prefix is not None else 0
        run(eng, second)
        return first, second, (eng.prefix.hits - hits if eng.prefix is not None else 0)

    results = {}
    for name, kw in {
        "none": {},
        "outputs": {"prefix_cache": PrefixCache(block=4)},
    }.items():
        if name != "none":
            kw |= {"speculative_tokens": spec, "proposer": right_then_wrong}
        eng = make_engine(tiny_model_dir, forward, max_batch_size=4, **kw)
        eng.start()
        try:
            eng.call(eng.slots.fill_spares).result(30)
            results[name] = conversation(eng)
            if spec and name != "none":
                assert eng.stats.accepted_tokens > 0 and eng.stats.proposed_tokens == 2 * eng.stats.accepted_tokens
        finally:
            eng.stop()
        if name == "none":
            reference.update({tuple(s.prompt_ids): s.out_ids for turn in results[name][:2] for s in turn})
    first, second, _ = results["none"]
    _, _, output_hits = results["outputs"]
    # each second prompt found its first turn's whole reply but the last token (never fed back)
    assert output_hits == sum((len(s.prompt_ids) + len(s.out_ids) - 1) // 4 * 4 for s in first)
    assert output_hits > sum(len(s.prompt_ids) // 4 * 4 for s in first)
    for ref, got in zip(second, results["outputs"][1]):
        assert got.out_ids == ref.out_ids
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, ref.token_logprobs)) < 1e-4


def test_a_slot_given_back_while_a_spare_is_built_does_not_grow_the_pool(engine):
    """``_recycle`` gives a retired slot back from the event loop while the engine thread may be
    building a spare for the same gap: the pool must stay at its size (it grew by one before)."""
    slots = engine.slots
    target = slots.spare_target
    taken = slots.take_spare()
    assert taken is not None and len(slots.spares) == target - 1
    add = slots._add

    def add_then_give_back(name, config):  # the give-back lands while the new spare is being built
        add(name, config)
        assert slots.give_back(taken)

    slots._add = add_then_give_back
    try:
        assert engine.call(slots.new_spare).result(30) is None  # built, found the pool full, dropped
    finally:
        slots._add = add
    assert len(slots.spares) == target and taken in slots.spares
    engine.call(slots.fill_spares).result(30)
    assert len(slots.spares) == target


def test_choice_decoding_keeps_the_free_greedy_path_and_otherwise_stays_in_the_choices(engine):
    """Decoding to a list of choices: where the unconstrained greedy output is a choice it is the
    output, token for token; where it is not, the output is still exactly one choice; a batch mixes
    constrained and free rows without changing the free one."""
    from comap_async.inference.choices import ChoiceTrie

    tok = engine.tokenizer
    eos = engine.eos_ids
    free = Sequence(tok(PROMPTS[3]).input_ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    run(engine, [free])
    others = [tok(c, add_special_tokens=False).input_ids for c in ("go to fridge 1", "look")]
    assert all(o != free.out_ids for o in others)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    kept = Sequence(tok(PROMPTS[3]).input_ids, params, constraint=ChoiceTrie([free.out_ids, *others], eos))
    # the same choices without the free output's first token: the greedy path cannot be taken
    elsewhere = [o for o in others if o[0] != free.out_ids[0]]
    forced = Sequence(tok(PROMPTS[3]).input_ids, params, constraint=ChoiceTrie(elsewhere, eos))
    company = Sequence(tok(PROMPTS[3]).input_ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    run(engine, [kept, forced, company])
    assert kept.out_ids[:-1] == free.out_ids and kept.out_ids[-1] in eos and kept.finish_reason == "stop"
    assert forced.out_ids[:-1] in elsewhere and forced.out_ids[-1] in eos
    assert company.out_ids == free.out_ids
    # reported logprobs are the model's own, unmasked: the kept path's equal the free path's
    assert kept.token_logprobs[:-1] == pytest.approx(free.token_logprobs, abs=1e-4)


@pytest.mark.parametrize("forward", ["transformers", "fused"])
@pytest.mark.parametrize("speculative_tokens", [0, 3])
def test_forced_choice_tokens_give_the_tokens_of_decoding_one_at_a_time(tiny_model_dir, forward, speculative_tokens):
    """Rows decoded to a list of choices whose tokens are mostly forced (shared prefixes, one object per
    receptacle), greedy and seeded-sampled, beside free rows: with ``forced_tokens`` every row's tokens,
    logprobs and finish are those of decoding one token a step, in fewer steps; with prompt-lookup
    speculation too, the free rows' proposals beside the constrained rows' forced tokens."""
    from comap_async.inference.choices import ChoiceTrie
    from comap_async.inference.token_sampling import make_generator

    commands = ["take apple 1 from countertop 1", "take mug 2 from cabinet 3", "go to countertop 1", "look"]

    def play(forced_tokens: int) -> tuple[list[Sequence], Engine]:
        eng = make_engine(tiny_model_dir, forward, speculative_tokens=speculative_tokens, forced_tokens=forced_tokens)
        eng.start()
        tok = eng.tokenizer
        trie = ChoiceTrie([tok(c, add_special_tokens=False).input_ids for c in commands], eng.eos_ids)
        seqs = []
        try:
            for i, text in enumerate(PROMPTS + PROMPTS[:2]):
                sampled = i % 2 == 1
                params = SamplingParams(max_tokens=12, temperature=1.0 if sampled else 0.0, seed=5 + i, logprobs=2)
                gen = make_generator(5 + i) if sampled else None
                constraint = trie if i % 3 != 2 else None
                seqs.append(Sequence(tok(text).input_ids, params, generator=gen, constraint=constraint))
            run(eng, seqs, stagger_s=0.002)
        finally:
            eng.stop()
        return seqs, eng

    reference, plain = play(0)
    forced, eng = play(4)
    assert plain.stats.forced_tokens == 0 and eng.stats.forced_tokens > 0
    assert eng.stats.steps < plain.stats.steps
    for ref, got in zip(reference, forced):
        assert got.out_ids == ref.out_ids and (got.finish_reason, got.text) == (ref.finish_reason, ref.text)
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, ref.token_logprobs)) < 1e-4
        assert [[t for t, _ in top] for top in got.top_logprobs] == [[t for t, _ in top] for top in ref.top_logprobs]
    constrained = [s for s in forced if s.constraint is not None]
    assert {s.text for s in constrained} <= set(commands) and len({s.text for s in constrained}) > 1


@pytest.mark.parametrize("forward", ["transformers", "fused"])
def test_speculative_decoding_gives_the_tokens_of_decoding_one_at_a_time(tiny_model_dir, tmp_path, forward):
    """The verify step (the engine's ``speculative_tokens``) on a batch of 3 that rows join and leave, mixing
    the base model and an adapter, greedy and seeded top-p rows, a stop string and short budgets: every
    row's tokens, logprobs and finish are those of decoding one token a step, whether a proposal is right
    throughout, right then wrong, or wrong at once. The tiny random model copies nothing from its
    prompts, so the proposals here come from the plain run's outputs (the right ones) with a wrong
    token put in per row; the prompt-lookup proposer runs in the last pass."""
    from comap_async.inference.speculative import ngram_proposal
    from comap_async.inference.token_sampling import make_generator

    adapter = read_adapter(AdapterFactory(tiny_model_dir, tmp_path).random("a", seed=3))
    repeating = "put the apple in the fridge. put the apple in the fridge. put the apple in the"
    texts = [repeating, *PROMPTS, repeating + " fridge", PROMPTS[3] + " " + PROMPTS[3]]

    def play(speculative_tokens: int, proposer=ngram_proposal) -> tuple[list[Sequence], Engine]:
        eng = make_engine(tiny_model_dir, forward, speculative_tokens=speculative_tokens, proposer=proposer)
        eng.start()
        try:
            eng.call(eng.slots.fill_spares).result(30)
            slot = eng.slots.take_spare()
            assert eng.slots.fill_spare(slot, adapter)
            tok = eng.tokenizer
            seqs = []
            for i, text in enumerate(texts):
                sampled = i % 3 == 1
                params = SamplingParams(
                    max_tokens=6 + 5 * (i % 4),
                    temperature=1.0 if sampled else 0.0,
                    top_p=0.9 if i % 2 else 1.0,
                    seed=11 + i if sampled else None,
                    ignore_eos=True,
                    logprobs=2,
                    stop=(" fridge",) if i == 5 else (),
                )
                gen = make_generator(11 + i) if sampled else None
                seqs.append(Sequence(tok(text).input_ids, params, slot=slot if i % 2 else "__base__", generator=gen))
            run(eng, seqs, stagger_s=0.002)
        finally:
            eng.stop()
        return seqs, eng

    reference, plain = play(0)
    assert plain.stats.verify_steps == plain.stats.proposed_tokens == 0
    # prompts of different lengths share the batch: the shorter rows' left padding is attended and masked
    shortest = min(len(s.prompt_ids) for s in reference)
    assert plain.stats.attended_columns > plain.stats.real_columns >= plain.stats.batch_rows * shortest
    outputs = {tuple(s.prompt_ids): s.out_ids for s in reference}
    wrong_at = {tuple(s.prompt_ids): i % 3 for i, s in enumerate(reference)}  # 0: never wrong

    def from_reference(seq: Sequence, k: int) -> list[int]:
        key = tuple(seq.prompt_ids)
        n, out = len(seq.out_ids), outputs[key]
        right = out[n : n + k]
        at = wrong_at[key]
        if at and at - 1 < len(right):  # wrong at once (1) or after one right token (2)
            right = right[: at - 1] + [(right[at - 1] + 1) % 512]
        return right

    for proposer in (from_reference, ngram_proposal):
        speculated, eng = play(4, proposer)
        st = eng.stats
        assert st.verify_steps > 0 and st.proposed_tokens >= st.accepted_tokens
        # every decode and verify step's attention is counted: each row reads at least its prompt
        shortest = min(len(s.prompt_ids) for s in speculated)
        assert st.attended_columns > st.real_columns >= st.batch_rows * shortest
        assert st.generated_tokens == plain.stats.generated_tokens
        for ref, spec in zip(reference, speculated):
            assert spec.out_ids == ref.out_ids
            assert (spec.finish_reason, spec.text) == (ref.finish_reason, ref.text)
            assert max(abs(a - b) for a, b in zip(spec.token_logprobs, ref.token_logprobs)) < 1e-4
            assert [[t for t, _ in top] for top in spec.top_logprobs] == [
                [t for t, _ in top] for top in ref.top_logprobs
            ]
        if proposer is from_reference:  # the random model's own outputs rarely repeat its prompt
            # right proposals save steps: fewer steps than tokens in the rows never proposed wrong
            assert (
                st.accepted_tokens
                >= sum(len(s.out_ids) - 1 for s, w in zip(speculated, wrong_at.values()) if not w) // 2
            )


def test_waiting_sequences_are_admitted_lowest_priority_first(tiny_model_dir):
    """One row at a time, everything queued before the engine starts: the evaluator's -1 goes ahead of
    the actors' earlier 0s, which keep their arrival order; each sequence's tokens are its own either way."""
    eng = make_engine(tiny_model_dir, "fused", max_batch_size=1)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = eng.tokenizer(PROMPTS[0]).input_ids
    seqs = [Sequence(list(ids), params, adapter=n, priority=p) for n, p in [("a", 0), ("b", 0), ("eval", -1), ("c", 0)]]
    finished: list[str] = []
    done = threading.Semaphore(0)
    for s in seqs:
        s.on_done = lambda s_: (finished.append(s_.adapter), done.release())
    eng.submit(seqs)
    eng.start()
    try:
        for _ in seqs:
            assert done.acquire(timeout=60)
    finally:
        eng.stop()
    assert finished == ["eval", "a", "b", "c"]
    assert len({tuple(s.out_ids) for s in seqs}) == 1 and all(s.finish_reason == "length" for s in seqs)


@pytest.mark.parametrize("hold_s", [0.0, 0.2, 30.0])
def test_priority_hold_keeps_worse_priorities_waiting_while_a_better_one_runs(tiny_model_dir, hold_s):
    """``inference.priority_hold_s``: an actor's call (priority 0) arriving while an evaluator's (-1) decodes
    joins the batch at once without a hold (the batch has room), after the hold when it is shorter than the
    evaluator's call, else when the evaluator's call has finished; its tokens are the same either way."""
    eng = make_engine(tiny_model_dir, "fused", max_batch_size=3, priority_hold_s=hold_s)
    ids = eng.tokenizer(PROMPTS[0]).input_ids
    evaluator = Sequence(list(ids), SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True), priority=-1)
    evaluator.on_token = lambda _s: time.sleep(0.005)  # ~0.6 s of decoding, whatever the machine
    actor = Sequence(list(ids), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    ended: dict[str, float] = {}
    done = threading.Semaphore(0)
    for name, s in (("evaluator", evaluator), ("actor", actor)):
        s.on_done = lambda _s, name=name: (ended.__setitem__(name, time.monotonic()), done.release())
    eng.start()
    try:
        eng.submit([evaluator])
        while evaluator.t_first is None:
            time.sleep(0.001)
        actor.t_submit = time.monotonic()
        eng.submit([actor])
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
    finally:
        eng.stop()
    waited = actor.t_first - actor.t_submit
    if hold_s == 0:
        assert actor.t_first < ended["evaluator"] and waited < 0.2
    elif hold_s < 1:
        assert hold_s <= waited and actor.t_first < ended["evaluator"]
    else:
        assert actor.t_first >= ended["evaluator"]
    assert actor.out_ids == evaluator.out_ids[:4]


def test_joins_and_leaves_in_place_give_the_same_tokens_with_and_without_verify_steps(tiny_model_dir):
    """Rows joining and leaving the batch's KV cache in place: the same tokens for greedy and seeded sampled
    rows of different lengths joining and leaving a batch of 3, with and without speculative decoding (its
    verify steps add columns a rejection masks again)."""
    from comap_async.inference.token_sampling import make_generator

    outputs = {}
    for spec in (0, 3):
        eng = make_engine(tiny_model_dir, "fused", speculative_tokens=spec)
        eng.start()
        try:
            tok = eng.tokenizer
            seqs = [
                Sequence(
                    tok(p).input_ids,
                    SamplingParams(max_tokens=4 + 5 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True),
                    generator=make_generator(i),
                )
                for i, p in enumerate(PROMPTS * 2)
            ]
            run(eng, seqs, stagger_s=0.003)
            assert eng.stats.batch_rows > eng.stats.steps  # rows were really batched
            outputs[spec] = [s.out_ids for s in seqs]
        finally:
            eng.stop()
    assert outputs[0] == outputs[3]
