"""``experiments/studies/reflect_discrimination.py``: the AUC, and the policy's doubt in its own drafts
(the reference ``p`` is compared with) computed as a plain forward pass would."""

from __future__ import annotations

import pytest
import torch

from evaluator.probes import auc
from experiments.studies.reflect_discrimination import draft_doubt, draft_doubts
from tests.fixtures.learner import make_trainer, reflection_record


def test_auc_counts_pairs_and_ties():
    assert auc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert auc([0.1], [0.9]) == 0.0
    assert auc([0.5, 0.9], [0.5]) == 0.75
    assert auc([], [0.3]) is None


def test_draft_doubt_is_the_drafts_mean_negative_log_probability(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir)
    samples = [reflection_record(1), reflection_record(0), {**reflection_record(1), "a_draft": "look"}]
    model, enc = trainer.model, trainer.encoder
    expected = []
    with torch.no_grad():
        for r in samples:
            seq = enc.seq(enc.prompts.draft(r["s"]), r["a_draft"], add_eos=False)
            logits = model(input_ids=torch.tensor([seq.ids])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            targets = seq.ids[seq.start : seq.start + seq.n_target]
            nll = [-logp[seq.start - 1 + k, t].item() for k, t in enumerate(targets)]
            expected.append(sum(nll) / len(nll))
    assert draft_doubts(trainer, samples) == pytest.approx(expected, rel=1e-4)
    got = draft_doubt(trainer, samples)
    assert got["n"] == 3 and got["draft_doubt_auc"] == auc([expected[0], expected[2]], [expected[1]])


def test_the_learner_renders_a_records_draft_confidence_in_its_reflection_prompt(tiny_model_dir):
    enc = make_trainer(tiny_model_dir).encoder
    r = reflection_record(1)
    plain = enc.tokenizer.decode(enc.reflection(r).ids)
    shown = enc.tokenizer.decode(enc.reflection({**r, "draft_confidence": 0.95}).ids)
    assert "confidence" not in plain and "Your confidence in the draft: high\n" in shown
