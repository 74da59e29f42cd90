"""Does the revise probability ``p`` learn to discriminate? Reflection-mode training variants on a
run's own suffix-labelled samples, scored on games held out from training.

A run's replay holds the reflection-mode initialisation samples (``source: suffix``): a state, the
policy's draft, the real observation after it, and the outcome label ``y`` (1: the expert's action
wins strictly sooner). This script splits them by game, trains the policy adapter on one part with
the learner's own :class:`~learner.trainer.Trainer` (the same losses as a run) and measures on the
other, teacher-forced, the figures the evaluator's probe reports for ``p``:

* ``p_discrimination``: mean ``p`` on ``y = 1`` samples minus mean ``p`` on ``y = 0`` samples;
* ``auc``: the chance that a ``y = 1`` sample gets a higher ``p`` than a ``y = 0`` one (0.5: none);
* ``p_mean``: where ``p`` sits (the label prior it may have learned instead);
* with ``--draft-doubt``, ``draft_doubt_auc``: the same AUC for the starting policy's own doubt in
  its draft (its tokens' mean negative log-probability), what the policy knows before any
  reflection training: a reference for what ``p`` could learn.

Variants (``--variants``, run one after the other from the same starting adapter and seed):
``plain`` (the BCE as a run trains it) and ``balanced`` (``method.bce_balance``: each label's
samples weigh as much in total as the other's).

    python experiments/studies/reflect_discrimination.py --replay RUN/replay --adapter RUN/adapters/policy-v5 \\
        [--epochs 2] [--holdout 0.3] [--variants plain,balanced] [--max-train 200] [--set method.bce_weight=1.0]

Last line: ``plain_discrimination=X balanced_discrimination=Y`` (the held-out ``p_discrimination``
after the last epoch of each variant).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from comap_async.wire.messages import REFLECT_INIT  # noqa: E402
from evaluator.probes import auc  # noqa: E402  (the probes' figure, the same function)

VARIANTS = {"plain": {"bce_balance": False}, "balanced": {"bce_balance": True}}


def load_samples(replay: Path) -> list[dict[str, Any]]:
    import msgpack

    from broker.store import ReplayStore

    store = ReplayStore(replay, {"reflections": 10**7}, readonly=True)
    try:
        rows = [msgpack.unpackb(b, raw=False) for b in store.iter_store("reflections")]
    finally:
        store.close()
    return [r for r in rows if r.get("source") == "suffix" and r.get("s_bar")]


def held_out(game: str, share: float) -> bool:
    return int(hashlib.sha256(game.encode()).hexdigest()[:8], 16) / 16**8 < share


def revise_probabilities(trainer: Any, samples: list[dict[str, Any]]) -> list[float]:
    """Teacher-forced ``p`` at the decision position of each sample."""
    import torch

    from comap_async.method.decision import revise_probability
    from learner.packing import pack
    from learner.peft_model import activate

    enc = trainer.encoder
    ps: list[float] = []
    activate(trainer.model, "policy", trainable=False)
    with torch.no_grad():
        for i in range(0, len(samples), 4):
            part = samples[i : i + 4]
            packed = pack([[enc.reflection(r)] for r in part], trainer.pad_id, trainer.device)
            logits = trainer.forward.target_logits(packed)
            at = torch.tensor(packed.first, dtype=torch.long)
            ps.extend(revise_probability(logits[at, enc.keep_id], logits[at, enc.revise_id]).tolist())
    return ps


def score(trainer: Any, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The discrimination figures of teacher-forced ``p`` over ``samples``."""
    ps = revise_probabilities(trainer, samples)
    pos = [p for p, r in zip(ps, samples) if r["y"] == 1]
    neg = [p for p, r in zip(ps, samples) if r["y"] == 0]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {
        "n": len(ps),
        "n_revise": len(pos),
        "p_mean": mean(ps),
        "p_revise_label": mean(pos),
        "p_keep_label": mean(neg),
        "p_discrimination": None if not pos or not neg else mean(pos) - mean(neg),
        "auc": auc(pos, neg),
    }


def draft_doubts(trainer: Any, samples: list[dict[str, Any]]) -> list[float]:
    """Per sample, the policy's doubt in its own draft: minus the mean log-probability of the
    draft's tokens (as the actor reads them from its sampled draft: no end-of-turn), teacher-forced
    on the draft prompt."""
    import torch

    from learner.packing import pack
    from learner.peft_model import activate

    enc = trainer.encoder
    doubt: list[float] = []
    activate(trainer.model, "policy", trainable=False)
    with torch.no_grad():
        for i in range(0, len(samples), 4):
            seqs = [enc.seq(enc.prompts.draft(r["s"]), r["a_draft"], add_eos=False) for r in samples[i : i + 4]]
            packed = pack([[q] for q in seqs], trainer.pad_id, trainer.device)
            logp = torch.log_softmax(trainer.forward.target_logits(packed), dim=-1)
            token = logp.gather(1, packed.targets.unsqueeze(1)).squeeze(1)
            total = torch.zeros(len(seqs)).index_add_(0, packed.owner, token)
            doubt.extend((-total / torch.tensor(packed.counts, dtype=torch.float)).tolist())
    return doubt


def draft_doubt(trainer: Any, samples: list[dict[str, Any]], doubt: list[float] | None = None) -> dict[str, Any]:
    """What the policy already knows about its drafts, as a reference for ``p``: the AUC of its
    doubt in each draft (:func:`draft_doubts`, or ``doubt`` already computed for ``samples``) for
    telling ``y = 1`` samples from ``y = 0`` ones."""
    doubt = draft_doubts(trainer, samples) if doubt is None else doubt
    pos = [d for d, r in zip(doubt, samples) if r["y"] == 1]
    neg = [d for d, r in zip(doubt, samples) if r["y"] == 0]
    return {"draft_doubt_auc": auc(pos, neg), "n": len(doubt)}


def build_trainer(cfg: Any, adapter: Path | None, overrides: dict[str, Any], budget: int, phase: str) -> Any:
    """The learner's trainer as a run builds it (config, prompts, LoRA adapters), its policy adapter
    loaded from ``adapter`` (None: the base model's), in ``phase`` with ``budget`` steps of schedule."""
    import torch
    from safetensors.torch import load_file

    from comap_async.models import load_model_and_tokenizer, resolve_model
    from comap_async.prompts import Prompts
    from learner.batches import Encoder
    from learner.paw import paw_entropy
    from learner.peft_model import build_peft_model, load_adapter_state
    from learner.trainer import Trainer

    # an override of the method's section (method.bce_balance) goes there, any other to the learner's
    ours = {k: v for k, v in overrides.items() if k in type(cfg.method).model_fields}
    lc = cfg.learner.model_copy(update={k: v for k, v in overrides.items() if k not in ours})
    torch.manual_seed(cfg.run.seed)
    path = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    base, tok = load_model_and_tokenizer(path, cfg.model.dtype, lc.device)
    model = build_peft_model(
        base, lc.lora_r, lc.lora_alpha, lc.lora_dropout, lc.target_modules, lc.gradient_checkpointing
    )
    if adapter is not None:
        load_adapter_state(model, "policy", load_file(str(Path(adapter) / "adapter_model.safetensors")))
    encoder = Encoder.for_learner(tok, Prompts.for_model(path, cfg), lc)
    trainer = Trainer(model, encoder, lc, lc.device, method=cfg.method.model_copy(update=ours))
    trainer.paw_entropy = paw_entropy(cfg)
    trainer.scheduler.enter(phase, 0, budget)  # one warm-up and cosine over the whole budget
    return trainer


def run_variant(name: str, cfg: Any, args: argparse.Namespace, train: list, test: list) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    bs = cfg.learner.batch_size
    budget = args.epochs * math.ceil(len(train) / bs)
    overrides = {**VARIANTS[name], "lr": args.lr or cfg.learner.lr}
    trainer = build_trainer(cfg, args.adapter, overrides, budget, REFLECT_INIT)
    # the starting policy's doubt in each held-out draft: the reference, and the confidence shown
    test_doubts = draft_doubts(trainer, test) if args.confidence or args.draft_doubt else None
    if args.confidence:  # the reflection prompts show the starting policy's confidence in each draft
        for rows, doubts in ((train, draft_doubts(trainer, train)), (test, test_doubts)):
            for r, doubt in zip(rows, doubts):
                r["draft_confidence"] = math.exp(-doubt)
    out = {"variant": name, "before": score(trainer, test), "epochs": []}
    if args.draft_doubt:
        out["draft_doubt"] = draft_doubt(trainer, test, test_doubts)
        print(json.dumps({"variant": name, "reference": "draft_doubt", **out["draft_doubt"]}), flush=True)
    print(json.dumps({"variant": name, "epoch": 0, **out["before"]}), flush=True)
    rng = random.Random(args.seed)
    for epoch in range(1, args.epochs + 1):
        order = list(train)
        rng.shuffle(order)
        t0 = time.perf_counter()
        for i in range(0, len(order), bs):
            trainer.train_step([{"reflections": order[i : i + bs]}])
        res = {**score(trainer, test), "train_s": round(time.perf_counter() - t0, 1)}
        out["epochs"].append(res)
        print(json.dumps({"variant": name, "epoch": epoch, **res}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replay", type=Path, required=True)
    ap.add_argument("--adapter", type=Path, required=True, help="a published policy adapter (the starting point)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "local.yaml"))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--holdout", type=float, default=0.3, help="share of games held out from training")
    ap.add_argument("--max-train", type=int, default=200)
    ap.add_argument("--variants", default="plain,balanced")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--confidence",
        action="store_true",
        help="show the draft's confidence (the starting policy's geometric-mean token probability, as a word) "
        "in every reflection prompt, trained and scored (the prompt's optional confidence line)",
    )
    ap.add_argument(
        "--draft-doubt",
        action="store_true",
        help="also score the starting policy's doubt in its own drafts on the held-out samples (a reference for p)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the full results as JSON here")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config field, as the commands' --set (e.g. method.bce_weight=1.0, "
        "learner.gradient_checkpointing=false: 8 minutes an epoch of 65 labels with it on)",
    )
    args = ap.parse_args()

    from comap_async.config import load_config

    cfg = load_config(args.config, args.overrides)
    samples = load_samples(args.replay)
    test = [r for r in samples if held_out(r["game"], args.holdout)]
    train = [r for r in samples if not held_out(r["game"], args.holdout)]
    random.Random(args.seed).shuffle(train)
    train = train[: args.max_train]
    print(
        json.dumps(
            {
                "samples": len(samples),
                "train": len(train),
                "train_revise_share": sum(r["y"] for r in train) / max(len(train), 1),
                "test": len(test),
                "test_revise_share": sum(r["y"] for r in test) / max(len(test), 1),
            }
        ),
        flush=True,
    )
    results = [run_variant(v, cfg, args, train, test) for v in args.variants.split(",")]
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))

    def last(r: dict[str, Any]) -> str:
        d = (r["epochs"] or [r["before"]])[-1]["p_discrimination"]
        return "n/a" if d is None else f"{d:.4f}"

    print(" ".join(f"{r['variant']}_discrimination={last(r)}" for r in results))


if __name__ == "__main__":
    main()
