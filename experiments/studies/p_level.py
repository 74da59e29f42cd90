"""Where does the revise probability ``p`` sit, version by version? The level of ``p`` on a fixed set
of labelled reflection samples, teacher-forced, for each published policy adapter of a run.

Why: the gate opens only where ``p`` is over ``tau_p``. A policy can keep ranking wrong drafts over
right ones (the AUC) while its whole level of ``p`` slides under ``tau_p`` and the gate shuts; the
probes' held-out walkthrough states see this late and the played games later still. The gate was
found shut within ten learner steps of co-evolution's rate coming back to 1e-3 (docs/findings.md, "The
gate also shuts when co-evolution's learning rate climbs back"); this script is that measurement.

The samples come from a run's replay (``--samples-from``, default the run itself), drawn once with a
fixed seed, so every version is scored on the same rows:

* ``suffix``: reflection-mode initialisation labels (``source: suffix``), ``--per-label`` of each label;
* ``gate``: labels the broker made in co-evolution from the gate's own outcomes, the same number.

    python experiments/studies/p_level.py RUN_DIR [--versions 18,19|first,last] [--samples-from OTHER_RUN]
        [--per-label 40]

Per adapter and set, a JSON line: mean ``p`` on ``y = 1`` and on ``y = 0`` rows, the AUC, the share of
rows over ``tau_p``. Last line: ``p_over_tau_first=X p_over_tau_last=Y`` (the ``suffix`` set's share of
``y = 1`` rows whose ``p`` is over ``tau_p``, first and last version scored).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from comap_async.wire.messages import POLICY, REFLECT_INIT, adapter_name, adapter_version  # noqa: E402
from evaluator.probes import auc  # noqa: E402
from experiments.studies.reflect_discrimination import build_trainer, revise_probabilities  # noqa: E402


def labelled_sets(replay: Path, per_label: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """The fixed samples: per source (``suffix`` or ``gate``), up to ``per_label`` rows of each label."""
    import msgpack

    from broker.store import ReplayStore

    store = ReplayStore(replay, {"reflections": 10**7}, readonly=True)
    try:
        rows = [msgpack.unpackb(b, raw=False) for b in store.iter_store("reflections")]
    finally:
        store.close()
    rows = [r for r in rows if r.get("s_bar")]
    rng = random.Random(seed)
    sets: dict[str, list[dict[str, Any]]] = {}
    for name, keep in (
        ("suffix", lambda r: r.get("source") == "suffix"),
        ("gate", lambda r: r.get("source") != "suffix"),
    ):
        chosen: list[dict[str, Any]] = []
        for y in (1, 0):
            pool = [r for r in rows if keep(r) and r.get("y") == y]
            chosen += rng.sample(pool, min(per_label, len(pool)))
        if chosen:
            sets[name] = chosen
    return sets


def policy_adapters(run: Path, versions: list[str] | None) -> list[tuple[int, Path]]:
    """The run's published policy adapters, oldest first; ``versions`` picks some (numbers, or ``first`` /
    ``last``: the oldest and the newest the run still holds)."""
    found = sorted(
        (adapter_version(p.name), p)
        for p in (run / "adapters").glob(f"{POLICY}-*")
        if p.name == adapter_name(POLICY, adapter_version(p.name))
    )
    if not found:
        raise SystemExit(f"p_level: {run / 'adapters'} holds no published policy adapter")
    if versions is None:
        return found
    named = {"first": found[0][0], "last": found[-1][0]}
    try:
        wanted = {named[v] if v in named else int(v) for v in versions}
    except ValueError:
        raise SystemExit(f"p_level: --versions takes numbers, first or last, not {','.join(versions)}") from None
    missing = sorted(wanted - {v for v, _ in found})
    if missing:
        raise SystemExit(f"p_level: {run} has no policy adapter for version {', '.join(map(str, missing))}")
    return [(v, p) for v, p in found if v in wanted]


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def over(ps: list[float], tau: float) -> float | None:
    return sum(p > tau for p in ps) / len(ps) if ps else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run directory (its adapters/policy-vN are scored)")
    ap.add_argument(
        "--versions", default=None, help="comma-separated versions, or first / last (default: every published one)"
    )
    ap.add_argument("--samples-from", type=Path, default=None, help="the run whose replay gives the samples")
    ap.add_argument("--per-label", type=int, default=40)
    ap.add_argument("--config", default=str(ROOT / "configs" / "local.yaml"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from comap_async.config import load_config

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [])
    replay = (args.samples_from or args.run) / "replay"
    if not replay.is_dir():
        raise SystemExit(f"p_level: no replay at {replay}")
    versions = None if args.versions is None else [v.strip() for v in args.versions.split(",") if v.strip()]
    adapters = policy_adapters(args.run, versions)
    sets = labelled_sets(replay, args.per_label, args.seed)
    if not sets:
        raise SystemExit(f"p_level: {replay} holds no labelled reflection samples")
    tau = cfg.method.tau_p
    first_last: list[float | None] = []
    for version, adapter in adapters:
        trainer = build_trainer(cfg, adapter, {}, 10, REFLECT_INIT)
        for name, samples in sets.items():
            ps = revise_probabilities(trainer, samples)
            pos = [p for p, r in zip(ps, samples) if r["y"] == 1]
            neg = [p for p, r in zip(ps, samples) if r["y"] == 0]
            row = {
                "version": version,
                "set": name,
                "n_revise": len(pos),
                "n_keep": len(neg),
                "p_revise_label": mean(pos),
                "p_keep_label": mean(neg),
                "auc": auc(pos, neg),
                "revise_over_tau": over(pos, tau),
                "keep_over_tau": over(neg, tau),
            }
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            if name == "suffix":
                first_last.append(row["revise_over_tau"])
        del trainer

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    first, last = (first_last[0], first_last[-1]) if first_last else (None, None)
    print(f"p_over_tau_first={fmt(first)} p_over_tau_last={fmt(last)}")


if __name__ == "__main__":
    main()
